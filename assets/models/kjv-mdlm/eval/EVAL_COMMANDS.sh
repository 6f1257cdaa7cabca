#!/bin/sh
# Exact commands behind assets/models/kjv-mdlm/eval/ (run from the repository root). Prompts are windows of the
# model's own corpus (tests/golden/text/eval/kjv_tokens.bin): its compact vocabulary holds only those tokens.
set -e
M=assets/models/kjv-mdlm
E=$M/eval
T=tests/golden/text/eval/kjv_tokens.bin

# Generative perplexity under the KJV GPT-2 of sampled continuations (temperature 1, ancestral), off and anchor.
./build/anchor-text --threads 1 diffusion bench -m $M --length 128 --prompt-len 32 --steps-list 64 --repeats 4 \
    --unmask ancestral --temperature 1 --prompts-from $T --score-with assets/models/kjv-gpt2 \
    --cache anchor --json $E/gen_ppl.json --overwrite | tee $E/gen_ppl.txt

# The cache curve: greedy confidence unmasking (so token agreement measures the cache only), L=128, prompt 32.
./build/anchor-text --threads 1 diffusion bench -m $M --length 128 --prompt-len 32 --steps-list 32,64 --repeats 3 \
    --unmask confidence --prompts-from $T --score-with assets/models/kjv-gpt2 \
    --cache anchor:stale=1,rho=0 --cache anchor:stale=2,rho=0 --cache anchor \
    --cache anchor:stale=4,rho=0 --cache anchor:stale=4,rho=0.1 --cache anchor:stale=8,rho=0 \
    --cache anchor:profile=$M/anchor_profile.json \
    --json $E/cache_curve.json --plot $E/cache_curve.png --overwrite | tee $E/cache_curve.txt
