#!/bin/sh
# Exact commands behind assets/models/kjv-mdlm/eval/ and anchor_profile.json (run from the repository root, on a
# quiet machine, 1 thread). Prompts are windows of the held-out books (eval/heldout_tokens.bin, written by the
# trainer), slid to windows whose tokens are all in the model's compact vocabulary. The cache and decoding benchmarks
# of this model are in tests/bench/results/mdlm_*_2026-12-04.* (commands at the top of each .txt).
set -e
M=assets/models/kjv-mdlm
E=$M/eval
T=$E/heldout_tokens.bin
export OMP_NUM_THREADS=1

# Anchor profile (per-layer staleness classes from uncached runs).
./build/anchor-text --threads 1 diffusion calibrate -m $M --prompts-from $T --n-prompts 4 --prompt-len 64 \
    --length 256 --steps 64 --unmask ancestral -o $M/anchor_profile.json --overwrite

# Generative perplexity under the KJV GPT-2 of sampled continuations (ancestral; temperature 1 and 0.8), off and two
# anchor settings, 8 prompts.
for temp in 1 0.8; do
    ./build/anchor-text --threads 1 diffusion bench -m $M --length 256 --prompt-len 64 --steps-list 64 --repeats 8 \
        --unmask ancestral --temperature $temp --prompts-from $T --score-with assets/models/kjv-gpt2 \
        --cache anchor --cache anchor:stale=16,rho=0,masked=reuse \
        --json $E/gen_ppl_T$temp.json --overwrite | tee $E/gen_ppl_T$temp.txt
done
