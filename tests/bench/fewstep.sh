#!/usr/bin/env bash
# Issue 59's few-step goals on a quiet machine (SD 1.5 shapes, random weights, 512x512):
#   (i)   TAESD vs the full VAE decode of one latent, interleaved in one process (goal: TAESD >= 20x faster);
#   (ii)  a 1-step Turbo-style image end to end (text encoder + UNet + decode), with TAESD (goal <= 2.5 s) and with
#         the full VAE (goal <= 6 s): cold (a fresh process per image) and warm (4 images in one process);
#   (iii) a 4-step LCM image with TAESD (goal <= 10 s), cold and warm.
# The end-to-end figures are each image's sidecar timings_s (text_encoder + unet + decode); the process wall time
# (loading included) is printed too.
# Usage: tests/bench/fewstep.sh BUILD_DIR OUT.txt [THREADS] [SCRATCH_DIR]
set -euo pipefail
build="$1" out="$2" threads="${3:-2}" scratch="${4:-/tmp}"
sd="$build/anchor-sd"
ckpt="$scratch/sd15_random_f16.safetensors" taesd="$scratch/taesd_random.safetensors"
# The text encoder + UNet + decode seconds of each sidecar given.
sum_timings() {
  python3 -c '
import json, sys
for f in sys.argv[1:]:
    t = json.load(open(f))["timings_s"]
    e = t["text_encoder"] + t["denoise"] + t["vae_decode"]
    print("  %s: text %.3f + denoise %.3f + decode %.3f = %.3f s" % (f, t["text_encoder"], t["denoise"], t["vae_decode"], e))
' "$@"
}
{
  echo "# tests/bench/fewstep.sh $*  ($(date -u +%F\ %T) UTC, $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg))"
  [ -f "$ckpt" ] || "$sd" random-model --family sd1 --dtype f16 -o "$ckpt"
  [ -f "$taesd" ] || "$sd" random-taesd -o "$taesd"
  echo "## (i) $sd bench-vae -W 512 -H 512 --warmup 1 --repeat 5 --taesd-file $taesd --threads $threads"
  "$sd" bench-vae -W 512 -H 512 --warmup 1 --repeat 5 --taesd-file "$taesd" --threads "$threads"
  turbo=(-p "a photo of a cat" --steps 1 --cfg-scale 1 --timestep-spacing trailing --sampler euler_a -W 512 -H 512)
  lcm=(-p "a photo of a cat" --steps 4 --cfg-scale 1 --sampler lcm -W 512 -H 512)
  for run in "turbo_taesd turbo taesd" "turbo_vae turbo full" "lcm4_taesd lcm taesd"; do
    read -r name args decoder <<<"$run"
    dec=(--vae-decoder full)
    [ "$decoder" = taesd ] && dec=(--vae-decoder "taesd:$taesd")
    if [ "$args" = turbo ]; then a=("${turbo[@]}"); else a=("${lcm[@]}"); fi
    echo "## ($name) cold: 3 fresh processes, seeds 1-3"
    for s in 1 2 3; do
      /usr/bin/time -f "  process wall %e s, peak RSS %M KB" "$sd" -m "$ckpt" "${a[@]}" "${dec[@]}" -s "$s" \
        --threads "$threads" -o "$scratch/${name}_cold_$s.png" --overwrite 2>&1 | grep -E "process wall|error" || true
    done
    sum_timings "$scratch/${name}_cold_1.png.json" "$scratch/${name}_cold_2.png.json" "$scratch/${name}_cold_3.png.json"
    echo "## ($name) warm: 4 images in one process (-b 4; the first carries the first-call costs)"
    /usr/bin/time -f "  process wall %e s, peak RSS %M KB" "$sd" -m "$ckpt" "${a[@]}" "${dec[@]}" -s 1 -b 4 \
      --threads "$threads" -o "$scratch/${name}_warm.png" --overwrite 2>&1 | grep -E "process wall|error" || true
    sum_timings "$scratch"/${name}_warm*.png.json
  done
} | tee "$out"
