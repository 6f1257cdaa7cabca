#!/usr/bin/env bash
# One more fbcache point for run.sh's grid (same seeds 9501-9504, same settings): fbcache:thr=0.12, slower than the
# grid's fbcache points, so that fbcache's frontier brackets the default freq's full-step speed-up too.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
d=tests/bench/results/eval_cache_2026-12-07_mmdit_default
OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE nice -n 5 build/anchor-sd --threads 1 eval-cache -m assets/models/fashion-mmdit \
  --classifier assets/models/fashion-sd/eval/classifier.safetensors --prompts $d/prompts.txt \
  --seeds 9501,9502,9503,9504 --batch 1 --steps 28 --cfg-scale 5 \
  --modes "off;fbcache:thr=0.12" -o $d/grid_bracket "$@" | tee $d/grid_bracket_table.txt
