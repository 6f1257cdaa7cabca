#!/bin/sh
# Streaming perplexity of kjv-gpt2 on its held-out books (Ruth, Ecclesiastes, Jonah, Titus; heldout.txt is the
# trainer's build/kjv-gpt2-run/heldout.txt), W = 128 < n_positions = 256. Run from the repository root.
set -e
M=assets/models/kjv-gpt2
E=$M/eval
BIN=${BIN:-./build/anchor-text}
# The whole held-out text (13k tokens, far past the 256-token context); default positions (wrap).
$BIN --threads 1 gpt2 ppl -m $M --file $E/heldout.txt --compare full,window:128,sink:4,124,recompute:128 \
    --json $E/ppl_w128.json --overwrite > $E/ppl_w128.txt
# The same with --positions cache (a token past the buffer takes the last slot's position).
$BIN --threads 1 gpt2 ppl -m $M --file $E/heldout.txt --positions cache --compare window:128,sink:4,124 \
    --json $E/ppl_w128_positions_cache.json --overwrite > $E/ppl_w128_positions_cache.txt
# The first 256 tokens only, where `full` can run too.
$BIN --threads 1 gpt2 ppl -m $M --file $E/heldout.txt --max-tokens 256 \
    --compare full,window:128,sink:4,124,recompute:128 --json $E/ppl_first256.json --overwrite > $E/ppl_first256.txt
# A wider window, W = 224 (wrap, then cache positions).
$BIN --threads 1 gpt2 ppl -m $M --file $E/heldout.txt --compare window:224,sink:4,220,recompute:224 \
    --json $E/ppl_w224.json --overwrite > $E/ppl_w224.txt
$BIN --threads 1 gpt2 ppl -m $M --file $E/heldout.txt --positions cache --compare window:224,sink:4,220 \
    --json $E/ppl_w224_positions_cache.json --overwrite > $E/ppl_w224_positions_cache.txt
# In-order positions with re-encoding when the buffer is full (--positions reencode), next to recompute above.
$BIN --threads 1 gpt2 ppl -m $M --file $E/heldout.txt --positions reencode --compare window:128,sink:4,124,recompute:128 \
    --json $E/ppl_w128_positions_reencode.json --overwrite > $E/ppl_w128_positions_reencode.txt
$BIN --threads 1 gpt2 ppl -m $M --file $E/heldout.txt --positions reencode --compare window:224,sink:4,220,sink:4,252 \
    --json $E/ppl_w224_positions_reencode.json --overwrite > $E/ppl_w224_positions_reencode.txt
