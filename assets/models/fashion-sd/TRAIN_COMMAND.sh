#!/usr/bin/env bash
# Exact commands that made assets/models/fashion-sd (Debian 12, 2 shared cores, one thread each; see README.md).
# Data: Debian package dataset-fashion-mnist (/usr/share/datasets/fashion-mnist).
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=assets/models/fashion-sd
# 1. VAE: 1500 steps were planned; the run was stopped at step 353 to save time and resumed from its step-200
#    checkpoint with a 700-step schedule (the log shows both segments).
build/anchor-sd train-vae -o $out --steps 1500 --batch 64 --threads 1   # stopped at step 353
build/anchor-sd train-vae -o $out --steps 700 --batch 64 --threads 1 --resume
# 2. UNet + text encoder on the frozen VAE's latents.
build/anchor-sd train-unet -o $out --steps 2000 --batch 64 --lr 7e-4 --threads 1
# 3. Classifier for prompt adherence (evaluation only).
build/anchor-sd train-classifier -o $out/eval --steps 800 --batch 128 --threads 1
# 4. Figures.
build/anchor-sd plot-loss $out/train_vae_log.txt -o $out/loss_vae.png --title "fashion-sd VAE: MSE + 1e-6 KL"
build/anchor-sd plot-loss $out/train_unet_log.txt -o $out/loss_unet.png --title "fashion-sd UNet: epsilon MSE"
build/anchor-sd eval-fashion -m $out --seeds 4 --steps 20 --cfg-scale 5
