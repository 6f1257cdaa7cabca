#!/bin/sh
# Exact command used to train assets/models/kjv-mdlm (run from the repository root; needs `apt-get install
# bible-kjv-text`; ~47 min on 1 CPU thread of a shared machine). Resumable: run it again after an interruption.
# --loss-weight masked_mean: with batches of 8 the NELBO's 1/t weight let a few tokens at t ~ 0 dominate the
# gradient and a 46-minute run with `nelbo` never left the unigram loss (6.05 nats); see README.md.
./build/anchor-text --threads 1 diffusion train --kjv --holdout books:Ruth,Eccl,Jonah,Titus \
    -o build/kjv-mdlm-run --layers 4 --dim 128 --heads 4 --cond-dim 64 --gate time_anchor \
    --seq-len 256 --batch 8 --steps 1600 --lr 2e-3 --warmup 60 --weight-decay 0.01 --seed 0 \
    --loss-weight masked_mean --checkpoint-every 100 --log-every 20 \
    --export assets/models/kjv-mdlm --export-dtype f16
