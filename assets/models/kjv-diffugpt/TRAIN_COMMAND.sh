#!/bin/sh
# Exact command used to adapt assets/models/kjv-gpt2 into assets/models/kjv-diffugpt (run from the repository root;
# needs `apt-get install bible-kjv-text`). DiffuGPT's recipe (Gong et al. 2024): the AR weights, [MASK] appended,
# attention-mask annealing over the first 200 steps, the shift, the 1/t-weighted masked-diffusion loss; code in
# text/train/diffugpt_train.{h,cpp}. One CPU thread (the other core ran builds); a fixed step count, so the schedule and
# the result do not depend on the machine's speed (--time-budget S instead sizes the cosine schedule from the measured
# step rate).
set -e
OMP_NUM_THREADS=1 ./build/anchor-text --threads 1 diffusion train --family diffugpt \
    --init-from assets/models/kjv-gpt2 --kjv --holdout books:Ruth,Eccl,Jonah,Titus \
    -o build/kjv-diffugpt-run --export build/kjv-diffugpt-export \
    --batch 16 --steps 1500 --lr 1e-3 --warmup 50 --weight-decay 0.01 --anneal-steps 200 \
    --eval-every 100 --log-every 10 --seed 0 | tee build/kjv-diffugpt-run.stdout
# the exporter never replaces a model: export beside it, then copy over the committed one
cp build/kjv-diffugpt-export/model.safetensors build/kjv-diffugpt-export/config.json assets/models/kjv-diffugpt/
cp build/kjv-diffugpt-run/train_log.txt build/kjv-diffugpt-run/metrics.csv assets/models/kjv-diffugpt/
cp build/kjv-diffugpt-run.stdout assets/models/kjv-diffugpt/train_stdout.txt
mkdir -p assets/models/kjv-diffugpt/eval
cp build/kjv-diffugpt-run/heldout_tokens.bin assets/models/kjv-diffugpt/eval/
# The loss plot: the weighted training loss (train_log.txt) and the held-out NELBO per token (from metrics.csv).
awk -F, 'NR > 1 && $4 != "" { print $1, $4 }' assets/models/kjv-diffugpt/metrics.csv >build/kjv-diffugpt-run/val_nelbo.txt
./build/anchor-sd plot-loss assets/models/kjv-diffugpt/train_log.txt build/kjv-diffugpt-run/val_nelbo.txt \
    -o assets/models/kjv-diffugpt/loss.png --title "kjv-diffugpt: 1/t-weighted loss and held-out NELBO (nats/token)"
