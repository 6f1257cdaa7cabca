#!/bin/sh
# Exact commands used to train assets/models/kjv-mdlm (run from the repository root). Needs `apt-get install
# bible-kjv-text` here and a GPU machine with PyTorch (one H200, PyTorch 2.11, 2026-12-04: 6.4 minutes of it).
set -e
# 1. Here: the run folder: config.json, train_tokens.bin and heldout_tokens.bin (one step at lr 0 writes them).
./build/anchor-text --threads 2 diffusion train --kjv --holdout books:Ruth,Eccl,Jonah,Titus -o build/kjv-mdlm-run \
    --layers 8 --dim 384 --heads 6 --cond-dim 128 --gate time_anchor --seq-len 256 --batch 1 --steps 1 --lr 0 \
    --warmup 0 --seed 0 --loss-weight masked_mean
# 2. On the GPU machine, with text/train/ and those three files in build/kjv-mdlm-run: two variants at once, 360 s
#    each; the one with the lower held-out NELBO is exported (here the first), as the weights of its best evaluation.
#    The time budget makes the step count depend on the machine (5,514 steps here); to fix it, set BUDGET=0 and
#    --steps 5514.
RUN=build/kjv-mdlm-run OUT=build/kjv-mdlm-out BUDGET=360 \
    COMMON="--steps 40000 --batch 64 --seq-len 256 --warmup 300 --loss-weight masked_mean --seed 0 --log-every 250
            --checkpoint-every 1000000 --eval-every 500 --eval-windows 48" \
    text/train/mdlm_train_device.sh "--lr 1e-3 --weight-decay 0.05" "--lr 2e-3 --weight-decay 0.1"
# 3. Here again, with build/kjv-mdlm-out copied back: the float16 export, and the logs of the chosen run.
cat build/kjv-mdlm-out/model.safetensors.part-* >assets/models/kjv-mdlm/model.safetensors
cp build/kjv-mdlm-out/config.json assets/models/kjv-mdlm/
cp build/kjv-mdlm-out/v1.txt assets/models/kjv-mdlm/train_stdout.txt
cp build/kjv-mdlm-out/v2.txt assets/models/kjv-mdlm/train_stdout_lr2e-3.txt
grep -E '^(step|eval|time budget)' assets/models/kjv-mdlm/train_stdout.txt | sed 's/ (loss [0-9.]*)$//' \
    >assets/models/kjv-mdlm/train_log.txt
