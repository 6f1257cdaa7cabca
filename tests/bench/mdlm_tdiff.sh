#!/bin/sh
# Text-diffusion decoding benchmarks of issue 23 (run from the repository root after building anchor-text).
# Each section writes tests/bench/results/mdlm_<name>_<date>.{txt,json} with its command line at the top.
# Timings: one thread (OMP_NUM_THREADS=1), modes interleaved per prompt inside one process.
#   default   the default `anchor` mode: candidates on held-out prompts at generate's defaults (ancestral, T=1, L=128)
#   fast      parallel decoding + block caches against off on kjv-mdlm, L=256 (gen-PPL, entropy, agreement, curve)
#   fast_T1   the same at temperature 1 with low thresholds and the factor rule
#   ancestral the block caches under MDLM's ancestral sampler (temperature 1), L=256, blocks of 32
#   ancestral8 the anchor cache in that setting over 8 prompts
#   masked    the block caches' masked=reuse (with decoded=reuse) under the ancestral sampler, L=256, 16 prompts
#   masked_steps  the same with stale=8 and with fewer steps
#   gemm      the model's linear layers on torch / onednn / bf16 (--gemm), interleaved rounds (speed only)
#   stream    masked=reuse with a cached step's few rows streamed through the weights (kernels::few_rows_linear)
#   stream_stale  stale 5 and 6 in that setting, on LibTorch and oneDNN
#   stream_onednn  the same with off on oneDNN too (one library on both sides)
#   stale_masked  the block's [MASK] rows and its decoded rows on separate staleness (stale_masked=), one library
#   window    a block's first step recomputing the previous block and the block only (window=32), one library
#   window_torch  the same modes against the default off (LibTorch), the modes +gemm=onednn too
#   window_confidence  window=32 under greedy confidence decoding (Fast-dLLM's setting), one library
#   rows      the linear layers alone at those row counts: LibTorch, oneDNN, the streaming kernel
#   gemm_modes  masked=reuse on each library (+gemm=) against off on LibTorch, one interleaved run, 16 prompts
#   bf16      the block caches against off, both on bf16 operands (--gemm bf16)
#   random768 dual, dual:window=32 and dual:decoded=reuse,window=32 on the 12 x 768 random-weight model (speed only)
set -e
M=assets/models/kjv-mdlm
T=$M/eval/heldout_tokens.bin
G=assets/models/kjv-gpt2
R=tests/bench/results
D=${DATE:-$(date +%F)}
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
run() { # name, then the anchor-text arguments
    name=$1
    shift
    { echo "# command: ./build/anchor-text --threads 1 $*"; echo "# date: $(date -u) host load: $(cat /proc/loadavg)"
      echo "# machine shared with other builds and benchmarks (2 cores): timings are noisy"
      ./build/anchor-text --threads 1 "$@"; } | tee "$R/mdlm_${name}_$D.txt"
}
for s in "${@:-default fast random768}"; do
  for section in $s; do
    case $section in
    default)
      run default_anchor diffusion bench -m $M --length 128 --prompt-len 16 --steps-list 64 --repeats 16 \
        --unmask ancestral --temperature 1 --prompts-from $T --score-with $G \
        --cache anchor:stale=2,rho=0.05,masked=active --cache anchor:stale=4,rho=0,masked=active \
        --cache anchor:stale=2,rho=0,masked=reuse --cache anchor:stale=4,rho=0,masked=reuse \
        --cache anchor:stale=8,rho=0,masked=reuse --cache anchor:stale=16,rho=0,masked=reuse \
        --cache anchor:stale=32,rho=0,masked=reuse \
        --json $R/mdlm_default_anchor_$D.json --overwrite ;;
    fast)
      run fast_L256 diffusion bench -m $M --length 256 --prompt-len 64 --steps-list 192 --repeats ${REPEATS:-8} \
        --unmask confidence --temperature 0 --block-length 32 --prompts-from $T --score-with $G \
        --cache dual --cache prefix --cache off+threshold=0.9 --cache dual+threshold=0.9 \
        --cache dual+threshold=0.7 --cache dual+threshold=0.5 --cache dual+steps=96 \
        --json $R/mdlm_fast_L256_$D.json --plot $R/mdlm_fast_L256_$D.png --overwrite ;;
    fast_T1)
      # Sampled (temperature 1), low thresholds: written for the earlier 4 x 128 model, whose greedy decoding was
      # degenerate (unigram entropy ~1.4 nats) and whose confidences rarely exceeded 0.1.
      run fast_L256_T1 diffusion bench -m $M --length 256 --prompt-len 64 --steps-list 192 --repeats ${REPEATS:-4} \
        --unmask confidence --temperature 1 --block-length 32 --prompts-from $T --score-with $G \
        --cache dual --cache dual+threshold=0.1 --cache dual+threshold=0.05 --cache dual+factor=2 \
        --cache dual+factor=4 --cache anchor \
        --json $R/mdlm_fast_L256_T1_$D.json --plot $R/mdlm_fast_L256_T1_$D.png --overwrite ;;
    ancestral)
      # MDLM's ancestral sampler (temperature 1) in blocks of 32: only the positions being unmasked need logits, so the
      # block caches save the forward and the head is small.
      run ancestral_L256 diffusion bench -m $M --length 256 --prompt-len 64 --steps-list 192 --repeats ${REPEATS:-8} \
        --unmask ancestral --temperature 1 --block-length 32 --prompts-from $T --score-with $G \
        --cache dual --cache prefix --cache anchor:stale=4,rho=0,masked=reuse --cache anchor:stale=8,rho=0,masked=reuse \
        --cache anchor:stale=16,rho=0,masked=reuse --cache dual:refresh=8 \
        --json $R/mdlm_ancestral_L256_$D.json --plot $R/mdlm_ancestral_L256_$D.png --overwrite ;;
    ancestral8)
      # The anchor cache under the same sampler over 8 prompts (a tighter gen-PPL interval).
      run ancestral_L256_anchor diffusion bench -m $M --length 256 --prompt-len 64 --steps-list 192 --repeats 8 \
        --unmask ancestral --temperature 1 --block-length 32 --prompts-from $T --score-with $G \
        --cache anchor:stale=16 --cache anchor --cache anchor:stale=64 \
        --json $R/mdlm_ancestral_L256_anchor_$D.json --plot $R/mdlm_ancestral_L256_anchor_$D.png --overwrite ;;
    masked)
      # Of the block's masks only those the ancestral draw unmasks now are computed (masked=reuse).
      run masked_reuse_L256 diffusion bench -m $M --length 256 --prompt-len 64 --steps-list 192 --repeats ${REPEATS:-16} \
        --unmask ancestral --temperature 1 --block-length 32 --prompts-from $T --score-with $G \
        --cache dual --cache dual:decoded=reuse --cache dual:masked=reuse --cache dual:decoded=reuse,masked=reuse \
        --cache dual:decoded=reuse,masked=reuse,stale=2 \
        --json $R/mdlm_masked_reuse_L256_$D.json --plot $R/mdlm_masked_reuse_L256_$D.png --overwrite ;;
    masked_steps)
      run masked_reuse_steps_L256 diffusion bench -m $M --length 256 --prompt-len 64 --steps-list 192 \
        --repeats ${REPEATS:-16} --unmask ancestral --temperature 1 --block-length 32 --prompts-from $T --score-with $G \
        --cache dual:decoded=reuse,masked=reuse,stale=8 --cache dual:decoded=reuse,masked=reuse+steps=144 \
        --cache dual:decoded=reuse,masked=reuse+steps=96 --cache dual:decoded=reuse,masked=reuse,stale=8+steps=144 \
        --json $R/mdlm_masked_reuse_steps_L256_$D.json --plot $R/mdlm_masked_reuse_steps_L256_$D.png --overwrite ;;
    gemm)
      { for round in 1 2; do for g in torch onednn bf16; do
          echo "## round $round: --gemm $g"
          ./build/anchor-text --threads 1 diffusion bench -m $M --length 256 --prompt-len 64 --steps-list 192 \
            --repeats 3 --unmask ancestral --temperature 1 --block-length 32 --prompts-from $T --gemm $g \
            --cache dual --cache dual:decoded=reuse,masked=reuse
        done; done; } | tee "$R/mdlm_gemm_backends_$D.txt" ;;
    stream)
      # A cached step's few rows through kernels::few_rows_linear (the weights streamed once; the default on LibTorch
      # up to 64 rows, on oneDNN up to 32, AVX-512); off keeps LibTorch's bits. stale=8 and the oneDNN library beside.
      run stream_L256 diffusion bench -m $M --length 256 --prompt-len 64 --steps-list 192 --repeats ${REPEATS:-16} \
        --unmask ancestral --temperature 1 --block-length 32 --prompts-from $T --score-with $G \
        --cache dual:decoded=reuse,masked=reuse --cache dual:decoded=reuse,masked=reuse,stale=8 \
        --cache dual:decoded=reuse,masked=reuse+gemm=onednn --cache dual:decoded=reuse,masked=reuse,stale=8+gemm=onednn \
        --json $R/mdlm_stream_L256_$D.json --plot $R/mdlm_stream_L256_$D.png --overwrite ;;
    stream_stale)
      # Between stale 4 (-0.4 % gen-PPL) and 8 (+4.6 %), on each library.
      run stream_stale_L256 diffusion bench -m $M --length 256 --prompt-len 64 --steps-list 192 --repeats ${REPEATS:-16} \
        --unmask ancestral --temperature 1 --block-length 32 --prompts-from $T --score-with $G \
        --cache dual:decoded=reuse,masked=reuse,stale=5 --cache dual:decoded=reuse,masked=reuse,stale=6 \
        --cache dual:decoded=reuse,masked=reuse,stale=5+gemm=onednn --cache dual:decoded=reuse,masked=reuse,stale=6+gemm=onednn \
        --json $R/mdlm_stream_stale_L256_$D.json --plot $R/mdlm_stream_stale_L256_$D.png --overwrite ;;
    stream_onednn)
      # The same on one library: off on oneDNN too (--gemm onednn), so the ratio is the cache's and the streaming's.
      run stream_onednn_L256 diffusion bench -m $M --length 256 --prompt-len 64 --steps-list 192 --repeats ${REPEATS:-16} \
        --unmask ancestral --temperature 1 --block-length 32 --prompts-from $T --score-with $G --gemm onednn \
        --cache dual:decoded=reuse,masked=reuse --cache dual:decoded=reuse,masked=reuse,stale=8 \
        --json $R/mdlm_stream_onednn_L256_$D.json --plot $R/mdlm_stream_onednn_L256_$D.png --overwrite ;;
    stale_masked)
      # Masks and decoded rows of the block on their own staleness, off and the modes on oneDNN (one library).
      run stale_masked_L256 diffusion bench -m $M --length 256 --prompt-len 64 --steps-list 192 --repeats ${REPEATS:-16} \
        --unmask ancestral --temperature 1 --block-length 32 --prompts-from $T --score-with $G --gemm onednn \
        --cache dual:decoded=reuse,masked=reuse,stale_masked=12 --cache dual:decoded=reuse,masked=reuse,stale=8,stale_masked=4 \
        --cache dual:decoded=reuse,masked=reuse,stale=16,stale_masked=4 --cache dual:decoded=reuse,masked=reuse,stale=32,stale_masked=5 \
        --cache dual:decoded=reuse,masked=reuse,stale=32,stale_masked=6 \
        --json $R/mdlm_stale_masked_L256_$D.json --plot $R/mdlm_stale_masked_L256_$D.png --overwrite ;;
    window)
      # window=32: a block's first step recomputes the previous block and the block, not the whole sequence; off and
      # the modes on oneDNN (one library).
      run window_L256 diffusion bench -m $M --length 256 --prompt-len 64 --steps-list 192 --repeats ${REPEATS:-16} \
        --unmask ancestral --temperature 1 --block-length 32 --prompts-from $T --score-with $G --gemm onednn \
        --cache dual:decoded=reuse,masked=reuse,window=32 --cache dual:decoded=reuse,masked=reuse,stale=8,window=32 \
        --cache dual:decoded=reuse,masked=reuse,window=16 \
        --json $R/mdlm_window_L256_$D.json --plot $R/mdlm_window_L256_$D.png --overwrite ;;
    window_torch)
      run window_torch_L256 diffusion bench -m $M --length 256 --prompt-len 64 --steps-list 192 --repeats ${REPEATS:-16} \
        --unmask ancestral --temperature 1 --block-length 32 --prompts-from $T --score-with $G \
        --cache dual:decoded=reuse,masked=reuse,window=32 --cache dual:decoded=reuse,masked=reuse,stale=8,window=32 \
        --cache dual:decoded=reuse,masked=reuse,window=32+gemm=onednn \
        --json $R/mdlm_window_torch_L256_$D.json --plot $R/mdlm_window_torch_L256_$D.png --overwrite ;;
    window_confidence)
      run window_confidence_L256 diffusion bench -m $M --length 256 --prompt-len 64 --steps-list 192 --repeats ${REPEATS:-8} \
        --unmask confidence --temperature 0 --block-length 32 --prompts-from $T --score-with $G --gemm onednn \
        --cache dual --cache dual:window=32 --cache dual:decoded=reuse,window=32 --cache dual+threshold=0.9 \
        --cache dual:window=32+threshold=0.9 \
        --json $R/mdlm_window_confidence_L256_$D.json --plot $R/mdlm_window_confidence_L256_$D.png --overwrite ;;
    rows)
      # The linear layers alone at a cached step's row counts (tests/bench/linear_rows_bench.cpp), kjv-mdlm's shapes.
      { echo "# command: OMP_NUM_THREADS=1 ./build/tests/linear_rows_bench 384 8 9"; echo "# date: $(date -u) load: $(cat /proc/loadavg)"
        ./build/tests/linear_rows_bench 384 8 9; } | tee "$R/mdlm_few_rows_linear_$D.txt" ;;
    gemm_modes)
      run gemm_modes_L256 diffusion bench -m $M --length 256 --prompt-len 64 --steps-list 192 --repeats ${REPEATS:-16} \
        --unmask ancestral --temperature 1 --block-length 32 --prompts-from $T --score-with $G \
        --cache off+gemm=bf16 --cache dual:decoded=reuse,masked=reuse --cache dual:decoded=reuse,masked=reuse+gemm=onednn \
        --cache dual:decoded=reuse,masked=reuse+gemm=bf16 \
        --json $R/mdlm_gemm_modes_L256_$D.json --plot $R/mdlm_gemm_modes_L256_$D.png --overwrite ;;
    bf16)
      run bf16_L256 diffusion bench -m $M --length 256 --prompt-len 64 --steps-list 192 --repeats ${REPEATS:-16} \
        --unmask ancestral --temperature 1 --block-length 32 --prompts-from $T --score-with $G --gemm bf16 \
        --cache dual --cache dual:decoded=reuse,masked=reuse --cache dual:decoded=reuse,masked=reuse,stale=8 \
        --json $R/mdlm_bf16_L256_$D.json --plot $R/mdlm_bf16_L256_$D.png --overwrite ;;
    random768)
      run random768 diffusion bench --layers 12 --dim 768 --length 256 --prompt-len 64 --steps-list 48 --repeats ${REPEATS:-2} \
        --unmask confidence --temperature 0 --block-length 32 \
        --cache dual --cache dual:window=32 --cache dual:decoded=reuse,window=32 \
        --json $R/mdlm_random768_$D.json --overwrite ;;
    esac
  done
done
