#!/usr/bin/env bash
# Fast-path speed of two builds side by side, interleaved: the SD 1.5-shaped UNet at 256x256 (2 threads, CFG batch 2)
# and the fashion-sd UNet shapes at 64x64 (1 thread, batch 20, deepcache:4 shallow step), each with --attention
# exact and fused where the build has the option. Usage: tests/bench/fastpath_ab.sh BEFORE_BIN AFTER_BIN [ROUNDS]
set -euo pipefail
before="$1" after="$2" rounds="${3:-3}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
fashion="$root/assets/models/fashion-sd/unet/config.json"
step() { grep -E "UNet step|cached \(shallow" | sed -E 's/ over .*//' | tr '\n' ' '; }
for r in $(seq 1 "$rounds"); do
  echo "round $r, load $(cut -d' ' -f1-3 /proc/loadavg)"
  for side in before after after-fused; do
    bin="$before"; extra=()
    [ "$side" != before ] && bin="$after"
    [ "$side" = after-fused ] && extra=(--attention fused)
    echo "  sd15-256 $side: $("$bin" bench --threads 2 -W 256 -H 256 --repeat 3 --deepcache 3 "${extra[@]}" 2>&1 | step)"
    echo "  fashion  $side: $("$bin" bench --threads 1 --unet-config "$fashion" -W 64 -H 64 --batch 20 --deepcache 4 --repeat 9 "${extra[@]}" 2>&1 | step)"
  done
done
