#!/bin/sh
# Exact command used to train assets/models/kjv-mdlm (run from the repository root; needs `apt-get install
# bible-kjv-text`; ~45 min on 1 CPU thread). Resumable: run it again after an interruption.
./build/anchor-text --threads 1 diffusion train --kjv --holdout books:Ruth,Eccl,Jonah,Titus \
    -o build/kjv-mdlm-run --layers 4 --dim 128 --heads 4 --cond-dim 64 --gate time_anchor \
    --seq-len 256 --batch 8 --steps 1400 --lr 2e-3 --warmup 60 --weight-decay 0.01 --seed 0 \
    --checkpoint-every 100 --log-every 20 --export assets/models/kjv-mdlm --export-dtype f16
