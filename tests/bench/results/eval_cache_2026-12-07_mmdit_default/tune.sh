#!/usr/bin/env bash
# Tuning the transformer's freq defaults on the MMDiT demo model: seeds 9201-9202 only (the 10 class captions), 28
# flow-matching Euler steps, CFG 5, one image per run, one thread. usage: tune.sh NAME "MODES" (';'-separated).
set -euo pipefail
cd "$(dirname "$0")/../../../.."
d=tests/bench/results/eval_cache_2026-12-07_mmdit_default
name=$1
modes=$2
OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE nice -n 5 build/anchor-sd --threads 1 eval-cache -m assets/models/fashion-mmdit \
  --classifier assets/models/fashion-sd/eval/classifier.safetensors --prompts $d/prompts.txt \
  --seeds 9201,9202 --batch 1 --steps 28 --cfg-scale 5 --modes "$modes" -o /tmp/ditdef_$name --overwrite \
  | tee $d/tuning_$name.txt
cp /tmp/ditdef_$name/cache_eval.json $d/tuning_$name.json
python3 tests/bench/results/eval_cache_2026-12-07_mmdit/summarize.py $d/tuning_$name.json | tee $d/tuning_${name}_summary.txt
