#!/bin/sh
# Exact commands behind assets/models/kjv-mdlm/eval/ and anchor_profile.json (run from the repository root, on a
# quiet machine). Prompts are windows of the held-out books (eval/heldout_tokens.bin, written by the trainer), slid
# to windows whose tokens are all in the model's compact vocabulary.
set -e
M=assets/models/kjv-mdlm
E=$M/eval
T=$E/heldout_tokens.bin

# Anchor profile (per-layer staleness classes from uncached runs).
./build/anchor-text --threads 2 diffusion calibrate -m $M --prompts-from $T --n-prompts 4 --prompt-len 64 \
    --length 256 --steps 64 --unmask ancestral -o $M/anchor_profile.json --overwrite

# Generative perplexity under the KJV GPT-2 of sampled continuations (ancestral; temperature 1 and 0.8), off and anchor.
for temp in 1 0.8; do
    ./build/anchor-text --threads 2 diffusion bench -m $M --length 256 --prompt-len 64 --steps-list 64 --repeats 4 \
        --unmask ancestral --temperature $temp --prompts-from $T --score-with assets/models/kjv-gpt2 \
        --cache anchor --cache anchor:stale=16,rho=0,masked=reuse \
        --json $E/gen_ppl_T$temp.json --overwrite | tee $E/gen_ppl_T$temp.txt
done

# The sampled cache curve (the cache issue's goal: speed-up at >= 95 % token agreement or gen-PPL within 5 %):
# ancestral unmasking at temperature 1, same seed off and cached, 4 held-out prompts, T = 64, 128, 256.
./build/anchor-text --threads 2 diffusion bench -m $M --length 256 --prompt-len 64 --steps-list 64,128,256 --repeats 4 \
    --unmask ancestral --temperature 1 --prompts-from $T --score-with assets/models/kjv-gpt2 \
    --cache anchor --cache anchor:stale=4,rho=0 \
    --cache anchor:stale=4,rho=0,masked=reuse --cache anchor:stale=8,rho=0,masked=reuse \
    --cache anchor:stale=16,rho=0,masked=reuse --cache anchor:stale=16,rho=0.05,masked=reuse \
    --cache anchor:stale=32,rho=0,masked=reuse --cache anchor:profile=$M/anchor_profile.json,rho=0,masked=reuse \
    --json $E/cache_curve_sampled.json --plot $E/cache_curve_sampled.png --overwrite | tee $E/cache_curve_sampled.txt

# The cache curve: greedy confidence unmasking (so token agreement measures the cache only), L=256, prompt 64.
./build/anchor-text --threads 2 diffusion bench -m $M --length 256 --prompt-len 64 --steps-list 32,64 --repeats 3 \
    --unmask confidence --prompts-from $T --score-with assets/models/kjv-gpt2 \
    --cache anchor:stale=1,rho=0 --cache anchor:stale=2,rho=0 --cache anchor \
    --cache anchor:stale=4,rho=0 --cache anchor:stale=4,rho=0.1 --cache anchor:stale=8,rho=0 \
    --cache anchor:profile=$M/anchor_profile.json \
    --json $E/cache_curve.json --plot $E/cache_curve.png --overwrite | tee $E/cache_curve.txt
