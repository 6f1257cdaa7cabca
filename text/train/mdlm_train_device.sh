#!/usr/bin/env bash
# Train kjv-mdlm on a GPU machine that has PyTorch but not our C++ build (text/train/mdlm_train_torch.py), and hand
# back the float16 export in pieces small enough for the machine's file transfer.
#
#   RUN=<run folder> OUT=<folder> BUDGET=<seconds> COMMON="<trainer options>" \
#       text/train/mdlm_train_device.sh "<options of variant 1>" ["<options of variant 2>"]
#
# RUN holds config.json, train_tokens.bin and heldout_tokens.bin, written on the Debian machine by
# `anchor-text diffusion train --kjv ... --steps 1 --lr 0` (the trainer here starts it at step 0 with --init). Each
# variant trains in its own copy of RUN, all at once on the one GPU (a model this small leaves it mostly idle), for
# BUDGET seconds each; the variant with the lowest held-out NELBO is exported. OUT receives device.txt, one
# <variant>.txt log per variant, config.json and model.safetensors.part-* (reassemble with cat). Two variants at most:
# the transfer takes 8 files. DEVICE=cpu AMP=off runs the same flow on a CPU (a dry run with a small BUDGET).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
: "${RUN:?RUN must name the run folder}" "${OUT:?OUT must name the output folder}"
[ $# -ge 1 ] && [ $# -le 2 ] || { echo "usage: RUN=... OUT=... $0 'variant options' ['variant options']" >&2; exit 2; }
BUDGET=${BUDGET:-300}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())'
    echo "budget ${BUDGET}s; common: ${COMMON:-}"
} | tee "$OUT/device.txt"
i=0
for v in "$@"; do
    i=$((i + 1))
    mkdir -p "$work/v$i"
    cp "$RUN"/config.json "$RUN"/train_tokens.bin "$RUN"/heldout_tokens.bin "$work/v$i/"
    echo "v$i: $v" | tee -a "$OUT/device.txt"
    # shellcheck disable=SC2086 # the options are word lists
    python3 "$here/mdlm_train_torch.py" "$work/v$i" --init --device "${DEVICE:-cuda}" --amp "${AMP:-bf16}" \
        --time-budget "$BUDGET" ${COMMON:-} $v --export "$work/v$i/export" >"$OUT/v$i.txt" 2>&1 &
done
wait
best= best_nelbo=
for d in "$work"/v*; do
    n=$(grep "held-out NELBO" "$d/train_log.txt" 2>/dev/null | awk '{print $6}' | sort -g | head -1)
    [ -n "$n" ] && [ -f "$d/export/model.safetensors" ] || continue
    echo "$(basename "$d"): lowest held-out NELBO $n" | tee -a "$OUT/device.txt"
    if [ -z "$best" ] || awk "BEGIN{exit !($n < $best_nelbo)}"; then best=$d best_nelbo=$n; fi
done
[ -n "$best" ] || { echo "no variant finished" | tee -a "$OUT/device.txt"; exit 1; }
echo "exported: $(basename "$best")" | tee -a "$OUT/device.txt"
cp "$best/export/config.json" "$OUT/"
split -b 15m "$best/export/model.safetensors" "$OUT/model.safetensors.part-"
sha256sum "$best/export/model.safetensors" | tee -a "$OUT/device.txt"
ls -la "$OUT"
