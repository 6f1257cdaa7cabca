#!/usr/bin/env bash
# SDXL on this machine (issue 19): the SDXL base UNet with random weights at 512x512 and 1024x1024 (seconds per CFG
# step, MACs, achieved GFLOP/s against the GEMM rate of the same run, peak RSS), and a whole 1024x1024 txt2img (2
# steps) from a random-weight SDXL single file written by `anchor-sd random-model`, under /usr/bin/time -v.
# Usage: tests/bench/sdxl.sh BUILD_DIR OUT.txt [THREADS] [SCRATCH_DIR]
set -euo pipefail
build="$1" out="$2" threads="${3:-2}" scratch="${4:-/tmp}"
sd="$build/anchor-sd"
{
  echo "# tests/bench/sdxl.sh $*  ($(date -u +%F\ %T) UTC, $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg))"
  # 1024x1024: one warm-up and one timed step (a CFG step is minutes on two cores).
  for run in "512 2 1" "1024 1 1"; do
    read -r size repeat warmup <<<"$run"
    echo "## $sd bench --family sdxl -W $size -H $size --repeat $repeat --warmup $warmup --deepcache 3 --threads $threads"
    "$sd" bench --family sdxl -W "$size" -H "$size" --repeat "$repeat" --warmup "$warmup" --deepcache 3 --threads "$threads"
  done
  ckpt="$scratch/sdxl_random_f16.safetensors"
  [ -f "$ckpt" ] || "$sd" random-model --family sdxl --dtype f16 -o "$ckpt"
  echo "## /usr/bin/time -v $sd -m $ckpt -p 'a lighthouse on a cliff at dusk' --steps 2 -W 1024 -H 1024 --threads $threads"
  /usr/bin/time -v "$sd" -m "$ckpt" -p "a lighthouse on a cliff at dusk" --steps 2 -W 1024 -H 1024 \
    --threads "$threads" -o "$scratch/sdxl_1024.png" --overwrite 2>&1 | tr '\r' '\n' |
    grep -E "loaded|Maximum resident|Elapsed|2/2|wrote|error"
} | tee "$out"
