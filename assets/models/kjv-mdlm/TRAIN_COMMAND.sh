#!/bin/sh
# Exact command used to train assets/models/kjv-mdlm (run from the repository root; ~25 min on 1 CPU thread).
./build/anchor-text --threads 1 diffusion train --tokens tests/golden/text/eval/kjv_tokens.bin \
    -o build/kjv-mdlm-run --layers 4 --dim 128 --heads 4 --cond-dim 64 --gate time_anchor \
    --seq-len 128 --batch 8 --steps 1200 --lr 2e-3 --warmup 50 --weight-decay 0.01 --seed 0 \
    --checkpoint-every 100 --log-every 20 --export assets/models/kjv-mdlm --export-dtype f16
