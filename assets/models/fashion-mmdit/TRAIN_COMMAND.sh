#!/usr/bin/env bash
# Exact commands that made assets/models/fashion-mmdit (Debian 12, 2 shared cores, one thread; see README.md).
# Data: Debian package dataset-fashion-mnist (/usr/share/datasets/fashion-mnist). Python: Debian's python3-torch 1.13
# with diffusers 0.31.0, transformers 4.38.2, safetensors in a venv (python3 -m venv --system-site-packages).
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=assets/models/fashion-mmdit
PY=${PY:-/tmp/d63/bin/python}
# 1. The folder (VAE and frozen text encoders from fashion-sd, scheduler) and the transformer, trained with a time
#    budget: it stops and saves after TIME_BUDGET seconds of training even if --steps are not done.
OMP_NUM_THREADS=1 nice -n 10 $PY unet/train/train_fashion_mmdit.py --out $out --heads 4 --head-dim 16 --layers 8 \
  --steps 800 --lr 1e-3 --warmup 50 --time-budget 2000   # the budget stopped it at step 495
# 2. Figures and evaluation (the classifier is fashion-sd's).
build/anchor-sd plot-loss $out/train_mmdit_log.txt -o $out/loss_mmdit.png --title "fashion-mmdit: rectified-flow velocity MSE"
# 3. The same image from diffusers' pipeline and from anchor-sd (0 levels apart).
build/anchor-sd --threads 1 -m $out -p "a photo of a sneaker" -s 1 --cfg-scale 5 -o /tmp/mmdit_check.png
$PY unet/train/check_fashion_mmdit.py $out /tmp/mmdit_check.png "a photo of a sneaker" 1 28 5
# 4. Samples, prompt adherence and the cache grid: tests/bench/results/eval_cache_2026-12-07_mmdit/run.sh
