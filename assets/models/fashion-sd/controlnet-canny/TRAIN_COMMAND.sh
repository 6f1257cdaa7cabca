#!/usr/bin/env bash
# Exact commands that made assets/models/fashion-sd/controlnet-canny (Debian 12, 2 shared cores, one thread; see
# README.md). Data: Debian package dataset-fashion-mnist (/usr/share/datasets/fashion-mnist).
set -euo pipefail
cd "$(dirname "$0")/../../../.."
out=assets/models/fashion-sd/controlnet-canny
# 1. The ControlNet on the frozen fashion-sd (UNet, VAE, text encoder), Canny edges of the training images as control.
#    Started with a peak learning rate of 5e-4; at step ~260 its zero convolutions had barely moved (mean |w| ~0.005,
#    no visible steering at the step-200 checkpoint), so it was stopped and resumed from the step-200 checkpoint with
#    1.5e-3 and the same end time (the log keeps steps 1-200 of the first segment, then the resumed run).
OMP_NUM_THREADS=1 nice -n 10 build/anchor-sd train-controlnet -m assets/models/fashion-sd -o $out \
    --steps 1200 --batch 64 --lr 5e-4 --max-seconds 2000 --threads 1    # stopped at step ~260
OMP_NUM_THREADS=1 nice -n 10 build/anchor-sd train-controlnet -m assets/models/fashion-sd -o $out \
    --steps 1200 --batch 64 --lr 1.5e-3 --max-seconds 1900 --threads 1 --resume
# 2. Loss curve.
build/anchor-sd plot-loss $out/train_controlnet_log.txt -o $out/loss_controlnet.png \
    --title "fashion-sd ControlNet (Canny): epsilon MSE of the frozen UNet"
# 3. Does it steer? Edge F1 / IoU of 20 held-out test images, with and without the ControlNet.
build/anchor-sd eval-controlnet -m assets/models/fashion-sd --control-net $out --images 20 --steps 20 \
    --cfg-scale 5 --sheet $out/eval_sheet.png --overwrite --threads 1 | tee $out/eval_controlnet.txt
# 4. diffusers 0.27.2 reads the folder; its residuals are the golden case tests/golden/sd/controlnet_fashion.
/tmp/d27/bin/python tests/golden/sd/controlnet_fashion/generate/make_controlnet_fashion.py
