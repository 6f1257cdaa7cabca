#!/usr/bin/env bash
# The main job on a fresh Debian 12 machine (as root): installs what is missing, builds, then runs the demos on the
# embedded models and prints where everything is.
#   1. anchor-sd txt2img on the embedded SD model, uncached vs cached side by side (--compare)
#   2. anchor-text: GPT-2 streaming perplexity past the context window (sink-rolling KV vs the baselines)
#   3. anchor-text: text diffusion on the KJV MDLM, uncached vs the anchor cache and the dual block cache with reuse inside the block (--compare)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/cli/setup.sh" --programs-only # the tests are tests/run.sh's
bin="$root/build"
out="$root/out/demo"
rm -rf "$out" # outputs of an earlier run
mkdir -p "$out"
cd "$root"

# The embedded SD model: the Fashion-MNIST model trained by the project (assets/models/fashion-sd), or the golden
# tiny random model when that is absent.
sd_model="assets/models/fashion-sd"
sd_prompt="a photo of a sneaker"
if [ ! -f "$sd_model/unet/config.json" ]; then
  sd_model="assets/models/sd15-tiny-random"
  sd_prompt="a photo of an astronaut riding a horse on mars"
fi
echo "== 1. txt2img, uncached vs cached side by side ($sd_model, \"$sd_prompt\")"
"$bin/anchor-sd" -m "$sd_model" -p "$sd_prompt" --steps 20 --sampler ddim --cfg-scale 5 -s 42 \
  --compare off,deepcache:3,freq -o "$out/compare.png" --overwrite

# The KJV GPT-2 trained by the project (context 256), else the golden tiny GPT-2 (context 128).
gpt2_model="assets/models/kjv-gpt2"
text_file="assets/models/kjv-gpt2/eval/heldout.txt" # books the model never saw in training
if [ ! -f "$gpt2_model/config.json" ]; then
  gpt2_model="tests/golden/text/gpt2_tiny"
  text_file="tests/golden/text/eval/kjv_text.txt"
fi
echo
echo "== 2. GPT-2 streaming past the context window ($gpt2_model, KJV text)"
"$bin/anchor-text" gpt2 ppl -m "$gpt2_model" --file "$text_file" \
  --max-tokens 1200 --compare full,window:64,sink:4,60,recompute:64
# Learned absolute positions in order, re-encoding the sinks + newest W/2 tokens when the buffer is full:
# sink perplexity meets recompute's at a fraction of its cost.
"$bin/anchor-text" gpt2 ppl -m "$gpt2_model" --file "$text_file" \
  --max-tokens 1200 --positions reencode --compare sink:4,60,recompute:64
"$bin/anchor-text" gpt2 generate -m "$gpt2_model" -p "In the beginning God created" --max-new 200 \
  --kv sink:4,60 --temperature 0.8 --top-k 40 --seed 1

echo
echo "== 3. Text diffusion, uncached vs cached (assets/models/kjv-mdlm, the embedded default model)"
# The default anchor cache (stale=4, rho=0, masked=reuse: decoded and not-yet-decoded [MASK] positions are reused,
# as dLLM-Cache does) at generate's defaults: ancestral unmasking, temperature 1, length 128, 64 steps.
"$bin/anchor-text" diffusion generate -p "And God said unto Moses," -s 7 --compare off,anchor \
  --score-with assets/models/kjv-gpt2
echo
# Semi-autoregressive blocks of 32 under the ancestral sampler; Fast-dLLM's DualCache computes only the current block
# between block starts, with decoded=reuse,masked=reuse only the positions being decoded and the just-decoded ones,
# and with window=32 a block's first step computes the previous block and the block instead of the whole sequence:
# the fastest setting measured within 5 % gen-PPL and 2 % entropy of off at stale 4. Its linear layers run on oneDNN
# (+gemm=onednn), which gave the same tokens as LibTorch's on every measured prompt. Length 256, the length the
# text-diffusion figures are quoted at (tests/bench/results/mdlm_window*_L256_*).
"$bin/anchor-text" diffusion generate -p "And God said unto Moses," -s 7 --length 256 --steps 192 --block-length 32 \
  --compare off,dual:decoded=reuse,masked=reuse,window=32+gemm=onednn --score-with assets/models/kjv-gpt2

echo
echo "demo outputs:"
ls -1 "$out" | sed "s|^|  $out/|"
