#!/usr/bin/env bash
# The main job on a fresh Debian 12 machine (as root): installs what is missing, builds, then runs the demos on the
# embedded models and prints where everything is.
#   1. anchor-sd txt2img on the embedded SD model, uncached vs cached side by side (--compare)
#   2. anchor-text: GPT-2 streaming perplexity past the context window (sink-rolling KV vs the baselines)
#   3. anchor-text: text diffusion on the KJV MDLM, uncached vs anchor cache (--compare)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/cli/setup.sh"
bin="$root/build"
out="$root/out/demo"
mkdir -p "$out"
cd "$root"

sd_model="assets/models/sd15-tiny-random"
echo "== 1. txt2img with caching, cached vs uncached ($sd_model: golden tiny SD model, random weights)"
"$bin/anchor-sd" -m "$sd_model" -p "a photo of an astronaut riding a horse on mars" --steps 20 --sampler ddim -s 42 \
  --compare off,deepcache:3,freq -o "$out/compare.png" --overwrite

echo
echo "== 2. GPT-2 streaming past the context window (golden tiny GPT-2, KJV text)"
"$bin/anchor-text" gpt2 ppl -m tests/golden/text/gpt2_tiny --file tests/golden/text/eval/kjv_text.txt \
  --max-tokens 600 --compare full,window:32,sink:4,28,recompute:32
"$bin/anchor-text" gpt2 generate -m tests/golden/text/gpt2_tiny -p "In the beginning God created" --max-new 200 \
  --kv sink:4,28 --seed 1

echo
echo "== 3. Text diffusion, uncached vs anchor cache (assets/models/kjv-mdlm)"
"$bin/anchor-text" diffusion generate -m assets/models/kjv-mdlm -p "Ex3:14 And God said unto Moses," --length 64 --steps 64 \
  --compare off,anchor

echo
echo "demo outputs:"
ls -1 "$out" | sed "s|^|  $out/|"
