#!/usr/bin/env bash
# Two builds side by side, interleaved, one thread each (a 2-core machine: one-thread runs tolerate a neighbour
# better): the UNet step (fashion-sd shapes, batch 20, deepcache:4 shallow step), the fashion evaluation of
# off / deepcache:4 / freq, GPT-2-small decode and streaming, and text diffusion off vs anchor on kjv-mdlm.
# Usage: tests/bench/core_ab.sh BEFORE_BUILD_DIR AFTER_BUILD_DIR [ROUNDS]   (run from the repository root)
set -euo pipefail
before="$1" after="$2" rounds="${3:-3}"
fashion="assets/models/fashion-sd/unet/config.json"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
unet_step() { grep -E "UNet step|cached \(shallow" | sed -E 's/ over .*//' | tr '\n' ' '; }
fashion_eval() { grep -E "^ *(off|deepcache:4|freq)[ :]" | sed -E 's/  +/ /g' | tr '\n' ';'; }
gpt2() { grep -E "context +(16|900):|after +[0-9]+ tokens" | sed -E 's/ -> .*//; s/  +/ /g' | tr '\n' ';'; }
mdlm() { grep -E "^anchor" | tr '\n' ';'; }
for r in $(seq 1 "$rounds"); do
  echo "round $r, load $(cut -d' ' -f1-3 /proc/loadavg)"
  for side in before after; do
    dir="$before"
    [ "$side" = after ] && dir="$after"
    sd="$dir/anchor-sd" tx="$dir/anchor-text"
    echo "  unet-step   $side: $("$sd" bench --threads 1 --unet-config "$fashion" -W 64 -H 64 --batch 20 --deepcache 4 --repeat 9 2>&1 | unet_step)"
    [ "$side" = after ] &&
      echo "  unet-step   after --attention fused: $("$sd" bench --threads 1 --unet-config "$fashion" -W 64 -H 64 --batch 20 --deepcache 4 --repeat 9 --attention fused 2>&1 | unet_step)"
    echo "  eval-fashion $side: $("$sd" eval-fashion --threads 1 --modes off,deepcache:4,freq --seeds 1 --repeats 2 -o "$tmp/eval-$side" --overwrite 2>&1 | fashion_eval)"
    echo "  gpt2-bench  $side: $("$tx" --threads 1 gpt2 bench --repeats 3 --stream-tokens 300 --recompute-repeats 1 2>&1 | gpt2)"
    echo "  mdlm-bench  $side: $("$tx" --threads 1 diffusion bench -m assets/models/kjv-mdlm --steps-list 64,128 --repeats 2 --length 256 --prompt-len 64 2>&1 | mdlm)"
  done
done
