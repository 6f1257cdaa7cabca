#!/bin/sh
# The cache table of the adapted KJV DiffuGPT (issue 64 item 4): off, prefix and dual (Fast-dLLM's K/V caches on
# block-wise DiffuGPT decoding) on 16 held-out prompts (windows of the held-out books Ruth, Eccl, Jonah, Titus, the
# same file as kjv-mdlm's), L = 256 (prompt 64 + 192 generated), blocks of 32, 192 steps (one token a step), gen-PPL
# under kjv-gpt2, unigram entropy, agreement with off, positions recomputed (the forward-cost proxy) and wall time.
# Usage: tests/bench/kjv_diffugpt_cache.sh [OUT.txt] [THREADS]   (from the repository root, after building anchor-text)
# Two runs: greedy (temperature 0, Fast-dLLM's setting) and DiffuGPT's own temperature 0.95 with top-p 0.9.
set -e
OUT=${1:-tests/bench/results/kjv_diffugpt_cache_$(date +%F).txt}
TH=${2:-1}
M=assets/models/kjv-diffugpt
P=assets/models/kjv-mdlm/eval/heldout_tokens.bin
G=assets/models/kjv-gpt2
export OMP_NUM_THREADS=$TH OMP_WAIT_POLICY=PASSIVE
: >"$OUT"
for T in ${TEMPS:-0 0.95}; do
  CMD="./build/anchor-text --threads $TH diffusion bench -m $M --gen-length 192 --block-length 32 --steps-list 192 \
--prompt-len 64 --repeats 16 --temperature $T --prompts-from $P --score-with $G --baseline off --cache prefix,dual \
--json ${OUT%.txt}_T$T.json --overwrite"
  { echo "# command: $CMD"
    echo "# date: $(date -u) git: $(git rev-parse --short HEAD 2>/dev/null || echo unknown) host load: $(cat /proc/loadavg) threads: $TH"
    $CMD 2>/dev/null
    echo "# host load at end: $(cat /proc/loadavg)"
    echo; } | tee -a "$OUT"
done
