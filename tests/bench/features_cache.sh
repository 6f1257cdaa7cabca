#!/usr/bin/env bash
# The cache with each feature on and off (issue 61's cache-with-features table): PSNR and speed-up of the default
# `freq` against `off` (`anchor-sd --compare off,freq`, one image per run) on the demo model fashion-sd, per feature
# and sampler, on prompts and seeds no cache choice was tuned on.
#
#   tests/bench/features_cache.sh [BUILD_DIR] [OUT_FILE]
#
# Features: none; ControlNet (tests/bench/make_fashion_controlnet.py: a random ControlNet, control image an edge map);
# LoRA at multipliers 0.5, 1, 1.5 (tests/bench/make_fashion_lora.py: a random kohya LoRA); img2img (strength 0.6,
# the init image the uncached image of the same prompt at seed + 1000); inpaint (the same, a centred mask); hires fix
# (2x, latent upscaler, denoise 0.5, when the build has it). Samplers: SAMPLERS ("ddim euler_a"), STEPS (20),
# SEEDS ("8101 8102 8103 8104"), the held-out prompts PROMPTS (every 6th line of tests/bench/prompts/fashion_heldout.txt).
# CONTROLNET: a trained ControlNet instead of the random one (e.g. assets/models/fashion-sd/controlnet-canny); the
# control image of each prompt is then the Canny edge map of the first test-set image of the prompt's class
# (`anchor-sd fashion-edges -p PROMPT`), held out from the ControlNet's training.
# FEATURES: a subset of the names above. PY: a python with diffusers 0.27.2 for the two generators (default /tmp/d27/bin/python); WORK: scratch folder.
# Full steps are exact; the speed-up (median wall of off / of freq per run) is a timing: run on a quiet machine.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
out=${2:-$root/tests/bench/results/features_cache_$(date +%F).txt}
py=${PY:-/tmp/d27/bin/python}
work=${WORK:-/tmp/features_cache}
samplers=${SAMPLERS:-ddim euler_a}
steps=${STEPS:-20}
seeds=${SEEDS:-8101 8102 8103 8104}
sd=$build/anchor-sd
model=$root/assets/models/fashion-sd
[ -x "$sd" ] || { echo "error: $sd not built" >&2; exit 2; }
[ -e "$out" ] && { echo "error: $out exists (not overwritten)" >&2; exit 2; }
mkdir -p "$work"
cd "$root"
if [ -n "${CONTROLNET:-}" ]; then
  cn=$CONTROLNET; edges="" # per prompt: $work/edges_<prompt>.png, below
  [ -e "$cn" ] || { echo "error: CONTROLNET=$cn does not exist" >&2; exit 2; }
else
  cn=/tmp/fashion_cn; edges=/tmp/fashion_edges.png # where make_fashion_controlnet.py writes them
  [ -d "$cn" ] && [ -f "$edges" ] || "$py" tests/bench/make_fashion_controlnet.py >/dev/null 2>&1 || true
  [ -d "$cn" ] || { echo "error: no ControlNet at $cn (run tests/bench/make_fashion_controlnet.py with $py)" >&2; exit 2; }
fi
[ -f "$work/lora.safetensors" ] || "$py" tests/bench/make_fashion_lora.py "$work/lora.safetensors" >/dev/null 2>&1
/usr/bin/python3 - "$work/mask.png" <<'PYEOF'
import sys
from PIL import Image, ImageDraw
m = Image.new("L", (32, 32), 0); ImageDraw.Draw(m).rectangle([8, 8, 23, 23], fill=255); m.save(sys.argv[1])
PYEOF
mapfile -t prompts < <(grep -v '^#' tests/bench/prompts/fashion_heldout.txt | grep -v '^$' | awk 'NR % 6 == 1')
help=$("$sd" --help 2>&1 || true) # (not piped into grep -q: under pipefail its early exit fails the pipe)
hires=(); [[ "$help" == *--hires-scale* ]] && hires=(hires)
features=(${FEATURES:-none controlnet lora0.5 lora1 lora1.5 img2img inpaint ${hires[*]}})
raw=$work/raw.txt; : >"$raw"
base=(-m "$model" --steps "$steps" --cfg-scale 5 -W 32 -H 32 --threads 1)
{
echo "# tests/bench/features_cache.sh $build $out   ($(date -u '+%F %H:%M UTC'); git $(git rev-parse --short HEAD); load $(cut -d' ' -f1-3 /proc/loadavg))"
echo "# fashion-sd 32x32, cfg 5, $steps steps, samplers: $samplers; seeds: $seeds; ${#prompts[@]} prompts: ${prompts[*]}"
echo "# ControlNet: $cn; control image: ${edges:-the Canny edges of the first test-set image of the class of each prompt}"
echo "# per run: feature sampler prompt seed | freq PSNR vs off (dB) | freq full steps | speed-up (off wall / freq wall)"
} | tee "$out.tmp"
for sampler in $samplers; do
  for prompt in "${prompts[@]}"; do
    for seed in $seeds; do
      tag=$(echo "${prompt}_${seed}_$sampler" | tr ' ' '_')
      init=$work/init_$tag.png
      [[ " ${features[*]} " == *" img2img "* || " ${features[*]} " == *" inpaint "* ]] &&
        "$sd" "${base[@]}" -p "$prompt" -s $((seed + 1000)) --sampler "$sampler" -o "$init" --overwrite >/dev/null 2>&1
      for f in "${features[@]}"; do
        extra=()
        case $f in
          controlnet)
            ctl=$edges
            if [ -z "$ctl" ]; then
              ctl=$work/edges_$(echo "$prompt" | tr ' ' '_').png
              [ -f "$ctl" ] || "$sd" fashion-edges -p "$prompt" -o "$ctl" >/dev/null
            fi
            extra=(--control-net "$cn" --control-image "$ctl") ;;
          lora*) extra=(--lora "$work/lora.safetensors:${f#lora}") ;;
          img2img) extra=(-i "$init" --strength 0.6) ;;
          inpaint) extra=(-i "$init" --mask "$work/mask.png" --strength 0.6) ;;
          hires) extra=(--hires-scale 2 --hires-denoise 0.5 --hires-upscaler latent) ;;
        esac
        o=$work/${tag}_$f.png
        if ! "$sd" "${base[@]}" -p "$prompt" -s "$seed" --sampler "$sampler" "${extra[@]}" --compare off,freq -o "$o" \
          --overwrite >"$work/log_${tag}_$f.txt" 2>&1; then
          echo "FAIL $f $sampler $tag: $(tail -1 "$work/log_${tag}_$f.txt")" | tee -a "$out.tmp"; continue
        fi
        /usr/bin/python3 - "${o%.png}_report.json" "$f" "$sampler" "$tag" <<'PYEOF' | tee -a "$out.tmp" >>"$raw"
import json, sys
r = json.load(open(sys.argv[1]))
m = {x["mode"]: x for x in r["modes"]}["freq"]
p = m["psnr_vs_first_db"]
print(sys.argv[2], sys.argv[3], sys.argv[4], "inf" if p is None else "%.2f" % p, m["full_steps"], "%.2f" % m["speedup_vs_first"])
PYEOF
      done
    done
  done
done
/usr/bin/python3 - "$raw" <<'PYEOF' | tee -a "$out.tmp"
import collections, statistics, sys
rows = collections.OrderedDict()
for line in open(sys.argv[1]):
    f, s, tag, p, full, sp = line.split()
    rows.setdefault((f, s), []).append((float(p), float(full), float(sp)))
print()
print("summary: the default freq against off, per feature and sampler (PSNR of the image; inf counted as 99 dB)")
print("%-10s %-8s %6s %9s %8s %8s %8s %10s" % ("feature", "sampler", "images", "PSNR mean", "worst", ">=30 dB", "full", "speed-up"))
for (f, s), v in rows.items():
    ps = [min(p, 99.0) for p, _, _ in v]
    print("%-10s %-8s %6d %9.2f %8.2f %7.0f%% %8.2f %9.2fx" % (f, s, len(v), statistics.mean(ps), min(ps),
          100.0 * sum(p >= 30 for p in ps) / len(ps), statistics.mean(x for _, x, _ in v),
          statistics.median(x for _, _, x in v)))
PYEOF
mv "$out.tmp" "$out"
echo "wrote $out" >&2
