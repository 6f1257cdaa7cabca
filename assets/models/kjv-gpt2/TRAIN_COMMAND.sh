#!/bin/sh
# Exact command used to train assets/models/kjv-gpt2 (run from the repository root; needs `apt-get install
# bible-kjv-text`; ~45 min on 1 CPU thread of a shared, loaded machine). Resumable: run it again after an interruption.
./build/anchor-text --threads 1 gpt2 train -o build/kjv-gpt2-run --export assets/models/kjv-gpt2 \
    --layers 4 --dim 128 --heads 4 --positions 256 --seq-len 256 --batch 8 --steps 1100 \
    --lr 2e-3 --warmup 100 --weight-decay 0.1 --ema 0.999 --holdout books:Ruth,Eccl,Jonah,Titus \
    --eval-every 100 --log-every 10 --checkpoint-every 100 --seed 0 --max-minutes 43
