#!/usr/bin/env bash
# The DiT cache grid on the MMDiT demo model (assets/models/fashion-mmdit): 28 flow-matching Euler steps, CFG 5, the
# 10 class captions x seeds 9301-9304, one image per run (--batch 1), one thread. The modes and thresholds were chosen
# from tuning runs on seed 9201 only (tuning_9201_*.txt, on a step-150 snapshot of the model), before these seeds ran.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
d=tests/bench/results/eval_cache_2026-12-07_mmdit
OMP_NUM_THREADS=1 nice -n 5 build/anchor-sd --threads 1 eval-cache -m assets/models/fashion-mmdit \
  --classifier assets/models/fashion-sd/eval/classifier.safetensors --prompts $d/prompts.txt \
  --seeds 9301,9302,9303,9304 --batch 1 --steps 28 --cfg-scale 5 \
  --modes "off;freq;freq:thr=0.08;freq:thr=0.12;freq:thr=0.16;freq:thr=0.24;fbcache;fbcache:thr=0.15;fbcache:thr=0.25;teacache;teacache:thr=0.8;teacache:thr=1.2;taylorseer:interval=2;taylorseer;taylorseer:interval=4;taylorseer:interval=6" \
  -o $d/grid "$@" | tee $d/grid_table.txt
