#!/usr/bin/env bash
# Ours and the peers, interleaved in one run on this machine (issue: CPU speed against the peers), one results file.
#
#   tests/bench/peers.sh [BUILD_DIR] [OUT_FILE] [ROUNDS]
#
# Each round runs, one after the other with the same thread count:
#   SD 1.5 UNet, one CFG step (batch 2), 256x256: anchor-sd bench   | diffusers 0.27.2 (diffusers_sd15_step.py)
#   SD 1.5 UNet step 512x512 and the VAE decode 512x512: the same two programs (--vae)
#   GPT-2-small decode at context 16: anchor-text gpt2 bench (f32, f16, q8_0) | llama.cpp llama-bench tg64 (same)
#                                       | plain PyTorch with a preallocated KV cache (gpt2_torch_kv_bench.py)
# and the summary gives min / median / max of every run of every round and the ratio of medians (peer / ours).
#
# The peers are installed as ../shared/peers/README.md describes; where they are:
#   PEERS      the peers folder (default: ../shared/peers next to the checkout)
#   REF        diffusers v0.27.2 and huggingface_hub v0.22.2 sources, REF/diffusers and REF/hfhub
#   LLAMA_CPP  a llama.cpp source tree built with -DGGML_NATIVE=ON (build/bin/llama-bench, gguf-py); optional
#   PRECISIONS ("f32"): "f32 bf16" also runs both sides in bfloat16 - ours with --gemm bf16 --weights-dtype bf16
#              (bf16 operands, float32 sums and activations), diffusers with its model cast to torch.bfloat16
#              (tests/bench/diffusers_sd15_dtype.py) - as rows unet256-bf16, unet512-bf16, vae512-bf16
#   THREADS (2), REPS (3), SIZES ("256 512"), GGUF_DIR (where the random GPT-2 GGUFs are written; default BUILD_DIR/peers)
#   ONLY       "gpt2": the GPT-2 rows alone (no SD runs; REF not needed); "sd": the SD rows alone; "sdxl": the SDXL
#              rows alone (SDXL=1 implied)
#   SDXL       1: also the SDXL base UNet, one CFG step at SDXL_SIZE^2 (default 1024): anchor-sd bench --family sdxl |
#              diffusers-torch2 (tests/bench/sdxl_unet_peer.py, TORCH2_PY) for each of PRECISIONS, rows
#              unet1024-sdxl[-bf16]; ~10 GB each side, one at a time
#   The modern peers (issue: CPU speed against the engines CPU users pick today), each optional, rows named by peer:
#   TORCH2_PY  python of a venv with PyPI torch 2.x and current diffusers: rows diffusers-torch2 (UNet step, VAE decode,
#              the whole STEPS-step pipeline; f32 and, with PRECISIONS bf16, bf16) via tests/bench/sd15_pipeline_peer.py
#   OV_PY      python of a venv with optimum-intel and openvino: rows openvino (the same three parts, static SIZE^2
#              shapes, INFERENCE_PRECISION_HINT f32 / bf16); exported once under PEER_WORK (default BUILD_DIR/peers/sd15)
#   SDCPP      a stable-diffusion.cpp build folder (bin/sd-cli, GGML's CPU backend, -DGGML_NATIVE=ON): rows sdcpp-f32,
#              sdcpp-f16, sdcpp-q8_0, each also with --diffusion-fa (-fa), on SD15_FILE converted by its own
#              `-M convert` (SDCPP_CONFIGS picks the settings); its own per-run timings (sampling / SDCPP_STEPS, decode_first_stage) are read from its log
#   SD15_FILE  a random-weight SD 1.5 single file (anchor-sd random-model --family sd1 --dtype f16 -o F): sd.cpp's
#              input and our whole-image rows (anchor-sd bench-cache -m SD15_FILE --modes off,freq: text encoder,
#              STEPS steps, VAE decode); default BUILD_DIR/peers/sd15_random_f16.safetensors, made when missing
#   IMAGE      1 (default when TORCH2_PY or OV_PY is set): the whole-image rows image512; STEPS (20), IMAGE_REPS (1)
#   CONTROL_PRECISIONS ("f32 bf16"): the precisions that also run the diffusers 0.27.2 same-backend control rows
#   PEER_GLIBC_TUNABLES  GLIBC_TUNABLES for the Python peers alone, e.g. glibc.malloc.mmap_max=0:glibc.malloc.
#              trim_threshold=68719476736:glibc.malloc.hugetlb=1 (freed blocks kept for reuse, on huge pages): where a
#              page fault is expensive, PyTorch on glibc's defaults pays one per 4 KiB of every large activation,
#              and this gives diffusers what cache/util/heap.h gives us
# The Python peers run with the OpenBLAS kernels anchor-sd runs with (OPENBLAS_CORETYPE as it reports), so both sides
# use the same GEMM; on CPUs Debian's OpenBLAS does not know, Python would otherwise run the Prescott kernels.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
out=${2:-$root/tests/bench/results/peers_$(date +%F).txt}
rounds=${3:-2}
peers=${PEERS:-$root/../shared/peers}
ref=${REF:-}
threads=${THREADS:-2}
reps=${REPS:-3}
gguf_dir=${GGUF_DIR:-$build/peers}
torch2_py=${TORCH2_PY:-}
ov_py=${OV_PY:-}
sdcpp=${SDCPP:-}
steps=${STEPS:-20}
peer_work=${PEER_WORK:-$build/peers/sd15}
sd15_file=${SD15_FILE:-$build/peers/sd15_random_f16.safetensors}
image=${IMAGE:-}
[ -z "$image" ] && { [ -n "$torch2_py$ov_py" ] && image=1 || image=0; }
sdcpp_steps=${SDCPP_STEPS:-2}
sdcpp_configs=${SDCPP_CONFIGS:-f32 f32-fa f16 f16-fa q8_0 q8_0-fa} # weight type, -fa: with --diffusion-fa
image_reps=${IMAGE_REPS:-1} # whole-image runs per round and side (a 20-step 512^2 image is minutes on 2 cores)
control_precisions=${CONTROL_PRECISIONS:-f32 bf16} # which precisions run the diffusers 0.27.2 control rows
sd=$build/anchor-sd
text=$build/anchor-text
[ -f "$peers/diffusers_sd15_step.py" ] || { echo "error: no peers folder at $peers (set PEERS)" >&2; exit 2; }
only=${ONLY:-}
case "$only" in "" | gpt2 | sd | sdxl) ;; *) echo "error: ONLY must be empty, gpt2, sd or sdxl, got '$only'" >&2; exit 2 ;; esac
sdxl=${SDXL:-0}; [ "$only" = sdxl ] && sdxl=1
sdxl_size=${SDXL_SIZE:-1024}
if [ "$only" != gpt2 ]; then
  [ -n "$ref" ] && [ -d "$ref/diffusers/src" ] || { echo "error: set REF to the folder with diffusers/ and hfhub/" >&2; exit 2; }
fi
if [ -e "$out" ]; then echo "error: $out exists (not overwritten)" >&2; exit 2; fi
if [ "$only" = gpt2 ]; then
  [ -x "$text" ] || { echo "error: $text not built" >&2; exit 2; }
  sd=$text # --version: the same build and BLAS report
else
  [ -x "$sd" ] && [ -x "$text" ] || { echo "error: $sd / $text not built" >&2; exit 2; }
fi
py=/usr/bin/python3
export PYTHONPATH="$peers/shim:$ref/diffusers/src:$ref/hfhub/src:$peers"
core=$("$sd" --version 2>&1 | sed -n 's/.*, core \([A-Za-z0-9]*\).*/\1/p' | head -1)
[ -n "$core" ] && export OPENBLAS_CORETYPE_PEERS=$core
llama_bench=
if [ -n "${LLAMA_CPP:-}" ] && [ -x "$LLAMA_CPP/build/bin/llama-bench" ]; then
  llama_bench=$LLAMA_CPP/build/bin/llama-bench
  mkdir -p "$gguf_dir"
  for t in f32 f16 q8_0 q4_0; do
    [ -f "$gguf_dir/gpt2-random-$t.gguf" ] ||
      $py "$root/tests/bench/make_gpt2_gguf.py" --gguf-py "$LLAMA_CPP/gguf-py" --vocab "$root/assets/vocab/gpt2" \
        --out "$gguf_dir/gpt2-random-$t.gguf" --type "$t" >/dev/null
  done
fi
if [ "$only" != gpt2 ] && { [ -n "$sdcpp" ] || [ "$image" = 1 ]; } && [ ! -f "$sd15_file" ]; then
  mkdir -p "$(dirname "$sd15_file")"
  "$sd" random-model --family sd1 --dtype f16 -o "$sd15_file" >/dev/null
fi
if [ -n "$sdcpp" ] && [ "$only" != gpt2 ]; then
  sdbin=$sdcpp/bin/sd-cli; [ -x "$sdbin" ] || sdbin=$sdcpp/bin/sd # sd-cli since 2026; sd before
  [ -x "$sdbin" ] || { echo "error: SDCPP=$sdcpp has neither bin/sd-cli nor bin/sd" >&2; exit 2; }
  for t in f32 f16 q8_0; do
    [ -f "$gguf_dir/sd15-random-$t.gguf" ] ||
      "$sdbin" -M convert -m "$sd15_file" -o "$gguf_dir/sd15-random-$t.gguf" --type "$t" >/dev/null 2>&1 ||
      { echo "error: sd.cpp could not convert $sd15_file to $t" >&2; exit 1; }
  done
fi
raw=$(mktemp)
trap 'rm -f "$raw"; [ -f "$out.tmp" ] && mv "$out.tmp" "$out.partial"' EXIT # a cut run keeps what it measured
log() { echo "$*" | tee -a "$out.tmp" >&2; }
# sample LABEL VALUE... : one measurement line per value (seconds or ms) into the raw table
sample() { local label=$1; shift; for v in "$@"; do echo "$label $v" >>"$raw"; done; }
peer_py() {
  local env=()
  [ -n "${OPENBLAS_CORETYPE_PEERS:-}" ] && env+=("OPENBLAS_CORETYPE=$OPENBLAS_CORETYPE_PEERS")
  [ -n "${PEER_GLIBC_TUNABLES:-}" ] && env+=("GLIBC_TUNABLES=$PEER_GLIBC_TUNABLES")
  env "${env[@]}" "$py" "$@"
}

log "# tests/bench/peers.sh $build $out $rounds   ($(date -u '+%F %H:%M UTC'); git $(git -C "$root" rev-parse --short HEAD))"
log "# $(nproc) cores, $threads threads per run, $reps repeats per run; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
if [ "$only" = gpt2 ]; then
  log "# ours: $("$text" -t "$threads" --version 2>&1 | grep -E 'BLAS|blas|threads|build' | xargs | tr '\n' ';')"
else
log "# ours: $("$sd" bench --help >/dev/null 2>&1 && "$sd" -t "$threads" bench -W 8 -H 8 --repeat 1 --warmup 0 --deepcache 2 2>/dev/null | grep -E '^  (build|blas):' | tr '\n' ';')"
fi
log "# peers: ${only:+ONLY=$only; }diffusers $(cd "$ref/diffusers" 2>/dev/null && git describe --tags 2>/dev/null || echo 0.27.2) on Debian torch $($py -c 'import torch;print(torch.__version__)'), OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE_PEERS:-default}, GLIBC_TUNABLES=${PEER_GLIBC_TUNABLES:-default}; llama.cpp ${llama_bench:-not given (LLAMA_CPP)}"
modern_py() { # modern_py PY ARGS...: a peer venv's python, without the 0.27.2 sources on the path
  local py2=$1; shift
  env -u PYTHONPATH ${PEER_GLIBC_TUNABLES:+GLIBC_TUNABLES=$PEER_GLIBC_TUNABLES} "$py2" "$@"
}
pipeline_peer() { # pipeline_peer BACKEND PY PRECISION SIZE PARTS: lines "<prefix>_<part>_s SIZE T"
  modern_py "$2" "$root/tests/bench/sd15_pipeline_peer.py" --backend "$1" --peers "$peers" \
    --vocab "$root/assets/vocab/clip/bpe_simple_vocab_16e6.txt.gz" --workdir "$peer_work" --size "$4" --reps "$reps" \
    --threads "$threads" --precision "$3" --steps "$steps" --parts "$5" --pipeline-reps "$image_reps" 2>&1
}
[ -n "$torch2_py" ] && log "# diffusers-torch2: $(modern_py "$torch2_py" -c 'import torch, diffusers; print("torch", torch.__version__, "diffusers", diffusers.__version__, "mkldnn", torch.backends.mkldnn.is_available(), "SDPA default")' 2>&1 | tail -1)"
[ -n "$ov_py" ] && log "# openvino: $(modern_py "$ov_py" -c 'import openvino; from importlib.metadata import version; print("openvino", openvino.__version__, "optimum-intel", version("optimum-intel"), "diffusers", version("diffusers"), "INFERENCE_NUM_THREADS='"$threads"'")' 2>&1 | tail -1)"
[ -n "$sdcpp" ] && log "# sdcpp: $("$sdbin" --help 2>&1 | grep -m1 -i 'version' | xargs), $(grep -m1 '^GGML_NATIVE' "$sdcpp/CMakeCache.txt" 2>/dev/null), -t $threads, $sdcpp_steps steps per run (a UNet step = sampling time / steps)"
for r in $(seq 1 "$rounds"); do
  log "round $r, load $(cut -d' ' -f1-3 /proc/loadavg)"
  sizes=${SIZES:-256 512}
  [ "$only" = gpt2 ] || [ "$only" = sdxl ] && sizes=
  for prec in ${PRECISIONS:-f32}; do
  ours_prec=(); sfx=; peer_script=("$peers/diffusers_sd15_step.py")
  if [ "$prec" = bf16 ]; then
    ours_prec=(--gemm bf16 --weights-dtype bf16); sfx=-bf16
    peer_script=("$root/tests/bench/diffusers_sd15_dtype.py" --dtype bf16)
  elif [ "$prec" != f32 ]; then
    echo "error: PRECISIONS holds f32 and/or bf16, got '$prec'" >&2; exit 2
  fi
  for size in $sizes; do
    vae=(); [ "$size" = 512 ] && vae=(--vae "$reps")
    o=$("$sd" -t "$threads" bench -W $size -H $size --repeat "$reps" --warmup 1 --deepcache 3 "${ours_prec[@]}" "${vae[@]}" 2>&1)
    u=$(echo "$o" | grep -A1 '^UNet step' | sed -n 's/^  runs: \(.*\) s$/\1/p')
    log "  ours      unet$sfx $size: $u s   ($(echo "$o" | grep -m1 'attention:' | xargs); $(echo "$o" | grep -m1 'linear layers and convolutions:' | cut -d';' -f1 | xargs))"
    sample "unet$size$sfx ours" $u
    if [ "$size" = 512 ]; then
      v=$(echo "$o" | grep -A1 '^VAE decode' | sed -n 's/^  runs: \(.*\) s$/\1/p')
      log "  ours      vae$sfx  $size: $v s"
      sample "vae$size$sfx ours" $v
      log "  ours      $(echo "$o" | grep -m1 '^peak RSS' | xargs)"
    fi
    pvae=(); [ "$size" = 512 ] && pvae=(--vae)
    if [[ " $control_precisions " == *" $prec "* ]]; then
    p=$(peer_py "${peer_script[@]}" --size $size --reps "$reps" --threads "$threads" "${pvae[@]}" 2>&1)
    pu=$(echo "$p" | awk '$1 == "unet_step_s" {print $3}' | xargs)
    log "  diffusers unet$sfx $size: $pu s"
    sample "unet$size$sfx diffusers" $pu
    if [ "$size" = 512 ]; then
      pv=$(echo "$p" | awk '$1 == "vae_decode_s" {print $3}' | xargs)
      log "  diffusers vae$sfx  $size: $pv s"
      sample "vae$size$sfx diffusers" $pv
    fi
    fi
    if [ "$size" = 512 ]; then # the modern peers, at 512^2 (the issue's goals)
      for peer in torch2 ov; do
        pp=$torch2_py; name=diffusers-torch2; backend=torch; pre=torch
        [ "$peer" = ov ] && { pp=$ov_py; name=openvino; backend=openvino; pre=ov; }
        [ -n "$pp" ] || continue
        parts=unet,vae; [ "$image" = 1 ] && parts=unet,vae,pipeline
        p=$(pipeline_peer "$backend" "$pp" "$prec" "$size" "$parts")
        for part in unet vae; do
          key=unet_step_s; [ "$part" = vae ] && key=vae_decode_s
          v=$(echo "$p" | awk -v k="${pre}_$key" '$1 == k {print $3}' | xargs)
          [ -n "$v" ] || { log "  $name $part$sfx $size: failed: $(echo "$p" | grep -v Warning | tail -2 | xargs)"; continue; }
          log "  $name $part$sfx $size: $v s"
          sample "$part$size$sfx $name" $v
        done
        if [ "$image" = 1 ]; then
          v=$(echo "$p" | awk -v k="${pre}_pipeline_s" '$1 == k {print $3}' | xargs)
          [ -n "$v" ] && { log "  $name image$sfx $size ($steps steps, uncached): $v s"; sample "image$size$sfx $name" $v; }
        fi
      done
      if [ "$image" = 1 ]; then # ours, the whole image: off and the default freq, interleaved by bench-cache
        o=$("$sd" -t "$threads" bench-cache -m "$sd15_file" "${ours_prec[@]}" -W $size -H $size --steps "$steps" \
              --modes off,freq --repeat "$image_reps" --max-prompts 1 2>&1)
        for mode in off freq; do
          v=$(echo "$o" | awk -v m="$mode" '$1 == m {split($7, a, "/"); print a[2]}')
          who=ours; [ "$mode" = off ] && who=ours-off
          log "  ours      image$sfx $size ($steps steps, $mode): $v s   ($(echo "$o" | awk -v m="$mode" '$1 == m {print $2 " full steps"}'))"
          sample "image$size$sfx $who" $v
        done
      fi
      if [ -n "$sdcpp" ] && [ "$prec" = f32 ]; then
        for cfg in $sdcpp_configs; do
          t=${cfg%-fa}; fa=; [ "$t" != "$cfg" ] && fa=--diffusion-fa
          {
            name=sdcpp-$t${fa:+-fa}
            p=$("$sdbin" -m "$gguf_dir/sd15-random-$t.gguf" -p "a red dress on a wooden table" -W $size -H $size \
                  --steps "$sdcpp_steps" --cfg-scale 7.5 -t "$threads" $fa -o "$peer_work.sdcpp.png" 2>&1 || true)
            st=$(echo "$p" | sed -n 's/.*sampling completed, taking \([0-9.]*\)s.*/\1/p' | tail -1)
            dt=$(echo "$p" | sed -n 's/.*decode_first_stage completed, taking \([0-9.]*\)s.*/\1/p' | tail -1)
            [ -n "$st" ] || { log "  $name: failed: $(echo "$p" | tail -2 | xargs)"; continue; }
            u=$(awk -v s="$st" -v n="$sdcpp_steps" 'BEGIN {printf "%.3f", s / n}')
            log "  $name unet $size: $u s per step ($st s for $sdcpp_steps steps), vae: ${dt:-?} s"
            sample "unet$size $name" $u
            [ -n "$dt" ] && sample "vae$size $name" $dt
          }
        done
      fi
    fi
  done
  done
  if [ "$sdxl" = 1 ] && [ "$only" != gpt2 ]; then # SDXL base UNet, one CFG step (issue 60's third goal)
    for prec in ${PRECISIONS:-f32}; do
      ours_prec=(); sfx=; [ "$prec" = bf16 ] && { ours_prec=(--gemm bf16 --weights-dtype bf16); sfx=-bf16; }
      o=$("$sd" -t "$threads" bench --family sdxl -W "$sdxl_size" -H "$sdxl_size" --repeat "$reps" --warmup 1 \
            "${ours_prec[@]}" 2>&1)
      u=$(echo "$o" | grep -A1 '^UNet step' | sed -n 's/^  runs: \(.*\) s$/\1/p')
      log "  ours      sdxl unet$sfx $sdxl_size: $u s   ($(echo "$o" | grep -m1 '^peak RSS' | xargs))"
      sample "unet$sdxl_size-sdxl$sfx ours" $u
      if [ -n "$torch2_py" ]; then
        p=$(modern_py "$torch2_py" "$root/tests/bench/sdxl_unet_peer.py" --size "$sdxl_size" --reps "$reps" \
              --threads "$threads" --precision "$prec" 2>&1 || true)
        v=$(echo "$p" | awk '$1 == "torch_sdxl_unet_step_s" {print $3}' | xargs)
        [ -n "$v" ] || { log "  diffusers-torch2 sdxl unet$sfx: failed: $(echo "$p" | tail -2 | xargs)"; continue; }
        log "  diffusers-torch2 sdxl unet$sfx $sdxl_size: $v s"
        sample "unet$sdxl_size-sdxl$sfx diffusers-torch2" $v
      fi
    done
  fi
  [ "$only" = sd ] || [ "$only" = sdxl ] && continue
  o=$("$text" -t "$threads" gpt2 bench --repeats "$reps" --stream-tokens 32 --recompute-repeats 1 2>&1)
  f32=$(echo "$o" | grep -A1 'f32 weights' | sed -n 's/^  context   16: \([0-9.]*\) \/ \([0-9.]*\) \/ \([0-9.]*\) ms.*/\1 \2 \3/p')
  f16=$(echo "$o" | grep -A1 'f16 weights' | sed -n 's/^  context   16: \([0-9.]*\) \/ \([0-9.]*\) \/ \([0-9.]*\) ms.*/\1 \2 \3/p')
  q8=$(echo "$o" | grep -A1 'q8_0 weights' | sed -n 's/^  context   16: \([0-9.]*\) \/ \([0-9.]*\) \/ \([0-9.]*\) ms.*/\1 \2 \3/p')
  q4=$(echo "$o" | grep -A1 'q4_0 weights' | sed -n 's/^  context   16: \([0-9.]*\) \/ \([0-9.]*\) \/ \([0-9.]*\) ms.*/\1 \2 \3/p')
  log "  ours      gpt2 decode ctx16 ms/token: f32 $f32 (min/median/max), f16 $f16, q8_0 $q8, q4_0 $q4   ($(echo "$o" | grep -o 'decode matrix-vector kernel: [^,]*'))"
  sample "gpt2-f32 ours" $f32
  sample "gpt2-f16 ours" $f16
  sample "gpt2-q8_0 ours" $q8
  sample "gpt2-q4_0 ours" $q4
  if [ -n "$llama_bench" ]; then
    for t in f32 f16 q8_0 q4_0; do
      j=$("$llama_bench" -m "$gguf_dir/gpt2-random-$t.gguf" -t "$threads" -p 0 -n 64 -r "$reps" -o json 2>/dev/null)
      ms=$(echo "$j" | $py -c 'import json,sys; print(" ".join("%.2f" % (1e3 / v) for v in json.load(sys.stdin)[0]["samples_ts"]))')
      log "  llama.cpp gpt2 tg64 $t ms/token: $ms"
      sample "gpt2-$t llama.cpp" $ms
    done
  fi
  p=$(peer_py "$peers/gpt2_torch_kv_bench.py" --threads "$threads" --ctx 16 --reps "$reps" --prefill 2>&1 || true)
  pt=$(echo "$p" | sed -n 's/^ctx   16->.*ms\/token min \([0-9.]*\) median \([0-9.]*\) max \([0-9.]*\).*/\1 \2 \3/p')
  log "  pytorch   gpt2 decode ctx16 ms/token: $pt (min/median/max)"
  sample "gpt2-f32 pytorch" $pt
done
log ""
log "summary (min / median / max over every run of every round - for the GPT-2 rows of ours and PyTorch, over each run's min, median and max; ratio = peer median / our median, > 1: we are faster)"
$py - "$raw" <<'EOF' | tee -a "$out.tmp" >&2
import collections, statistics, sys
d = collections.OrderedDict()
for line in open(sys.argv[1]):
    work, who, v = line.split()
    d.setdefault(work, collections.OrderedDict()).setdefault(who, []).append(float(v))
units = {w: "s" for w in ("unet256", "unet512", "vae512", "image512", "unet1024-sdxl", "unet512-sdxl")}
units.update({w + "-bf16": "s" for w in list(units)})
for work, sides in d.items():
    ours = sides.get("ours")
    for who, vs in sides.items():
        med = statistics.median(vs)
        ratio = "" if who == "ours" or not ours else "  ratio %.2fx" % (med / statistics.median(ours))
        print("%-9s %-10s %8.3f / %8.3f / %8.3f %s (n=%d)%s" % (work, who, min(vs), med, max(vs), units.get(work, "ms"), len(vs), ratio))
EOF
mv "$out.tmp" "$out"
echo "wrote $out" >&2
