#!/usr/bin/env bash
# The cache evaluation grid of issue 24 on the embedded fashion-sd model (anchor-sd eval-cache): held-out prompts
# (tests/bench/prompts/fashion_heldout.txt, 30 prompts) x seeds x samplers x step counts, every mode interleaved per
# cell, PSNR/SSIM against the uncached image of the same prompt and seed.
# Usage: tests/bench/eval_cache.sh BUILD_DIR OUT_DIR [SEEDS] [MODES] [BATCH]   (run from the repository root)
# BATCH: images per run (default 0: every prompt of a seed in one batch; 1: one image at a time, as a user meets it).
set -euo pipefail
build="$1" out="$2"
seeds="${3:-7001,7002,7003,7004}"
modes="${4:-off,deepcache:2,deepcache:3,deepcache:4,freq}"
batch="${5:-0}"
export OMP_WAIT_POLICY=PASSIVE
"$build/anchor-sd" eval-cache --threads 1 --prompts tests/bench/prompts/fashion_heldout.txt --seeds "$seeds" \
  --samplers ddim,dpmpp_2m,euler,euler_a,lms --steps 10,20,30,50 --modes "$modes" --batch "$batch" -o "$out" --overwrite
