#!/usr/bin/env bash
# The transformer's freq default measured on the MMDiT demo model (assets/models/fashion-mmdit): 28 flow-matching
# Euler steps, CFG 5, the 10 class captions x seeds 9501-9504 (never used before), one image per run (--batch 1), one
# thread. The default (dit_freq_defaults) was frozen before these seeds ran; README.md has the commit.
# MODES / OUT override the mode list and the output name (run_bracket.sh).
set -euo pipefail
cd "$(dirname "$0")/../../../.."
d=tests/bench/results/eval_cache_2026-12-07_mmdit_default
modes=${MODES:-"off;freq;freq:thr=0.1;freq:thr=0.16;freq:thr=0.12,skip=0;fbcache:thr=0.15;fbcache:thr=0.2;fbcache:thr=0.25;teacache;teacache:thr=0.6;taylorseer;taylorseer:interval=4"}
out=${OUT:-grid}
OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE nice -n 5 build/anchor-sd --threads 1 eval-cache -m assets/models/fashion-mmdit \
  --classifier assets/models/fashion-sd/eval/classifier.safetensors --prompts $d/prompts.txt \
  --seeds 9501,9502,9503,9504 --batch 1 --steps 28 --cfg-scale 5 --modes "$modes" -o $d/$out "$@" | tee $d/${out}_table.txt
python3 tests/bench/results/eval_cache_2026-12-07_mmdit/summarize.py $d/$out/cache_eval.json | tee $d/${out}_summary.txt
