#!/usr/bin/env bash
# Device check: builds AnchorCache against the GPU machine's LibTorch (the pip `torch` package, C++20 for >= 2.13),
# runs the CUDA tests (kernels, attention through scaled_dot_product_attention; CUDA vs CPU references) and the
# kernel performance mode, then measures the whole job on the GPU and prints one table (issue 58): the SD 1.5 UNet at
# 512x512, a 20-step txt2img on a random SD 1.5 single file (with CPU-seed parity at 256x256), SDXL 1024x1024, the
# cache modes on the GPU with latent PSNR, GPT-2 and text diffusion, each with its peak GPU memory. Rows this build
# cannot measure say so ("n/a: why"). Designed to finish within 8 minutes on a 16-core H100/H200 machine.
#
#   kernels/device-check.sh                 # build dir: build-gpu
#   BUILD=/tmp/b OUT=/tmp/o kernels/device-check.sh
#   DRY_RUN=1 TORCH_PYTHON=/opt/anchor-torch2/bin/python BUILD=$PWD/build-torch2 kernels/device-check.sh
#       # no GPU: the self-test compiles, an existing build folder is reused (configured by `cli/setup.sh --torch
#       # pip`), the tests run (the CUDA ones skip) and the table lists the commands a GPU run makes
#
# Header-only dependencies the GPU image lacks (CLI11, nlohmann-json, Catch2, stb, pcre2.h, zlib.h) are read from
# $ANCHOR_THIRD_PARTY (default ./.device, filled by `kernels/device-check.sh --bundle` on a Debian machine that has the
# packages); OpenCV is optional.
#
# Exit status: 0 when every kernel and CUDA test passed on a GPU (with DRY_RUN=1: when the CPU-side steps worked),
# 1 on a test failure, 2 when the build could not be made or no GPU was usable (the table says which).
set -uo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)

if [ "${1:-}" = "--bundle" ]; then # run here (Debian, packages installed): copy the headers the GPU image lacks
    B=$ROOT/.device/include
    mkdir -p "$B/catch2" "$B/stb"
    cp -r /usr/include/nlohmann /usr/include/CLI "$B/"
    cp /usr/include/catch2/catch.hpp "$B/catch2/"
    cp /usr/include/stb/stb_image_write.h /usr/include/stb/stb_image.h "$B/stb/"
    cp /usr/include/pcre2.h /usr/include/zlib.h /usr/include/zconf.h "$B/"
    EXCLUDE=$(git rev-parse --git-path info/exclude) # a worktree's .git is a file
    mkdir -p "$(dirname "$EXCLUDE")"
    grep -qx '/.device/' "$EXCLUDE" 2>/dev/null || echo '/.device/' >>"$EXCLUDE"
    du -sh "$ROOT/.device"
    exit 0
fi

BUILD=${BUILD:-$ROOT/build-gpu}
OUTDIR=${OUT:-$BUILD/out}
THIRD=${ANCHOR_THIRD_PARTY:-$ROOT/.device}
START=$(date +%s)
LOG=$OUTDIR/device-check.log
mkdir -p "$BUILD" "$OUTDIR"
: >"$LOG"

DRY=${DRY_RUN:-0}
left() { echo $((${BUDGET_S:-470} - ($(date +%s) - START))); }
say() { echo "[device-check $(($(date +%s) - START))s] $*"; }

say "GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo 'nvidia-smi unavailable')"
say "CPU: $(nproc) cores; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"

NVCC=${CUDACXX:-}
[ -z "$NVCC" ] && command -v nvcc >/dev/null && NVCC=$(command -v nvcc)
[ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc
if [ -z "$NVCC" ]; then
    say "FAIL: nvcc not found (set CUDACXX)"
    exit 2
fi
say "nvcc: $NVCC ($("$NVCC" --version | tail -1))"

ARCH=${CUDA_ARCH:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '.')}
ARCH=${ARCH:-90}

# Step 1: the kernels alone (no LibTorch), against host float64 references: independent of the project build.
say "standalone kernel self-test (nvcc, sm_$ARCH)"
SELFTEST_RC=2
if timeout 150 "$NVCC" -std=c++17 -O2 -arch="sm_$ARCH" -I"$ROOT" "$ROOT/kernels/cuda/selftest/kernel_selftest.cu" \
    "$ROOT/kernels/cuda/dct_energy.cu" "$ROOT/kernels/cuda/ring_write.cu" -lcufft -o "$BUILD/kernel_selftest" \
    >>"$LOG" 2>&1; then
    if [ "$DRY" = 1 ]; then
        say "self-test compiled (dry run: not run)"
        SELFTEST_RC=0
    else
        echo "kernel               | shape            | max rel err | result"
        timeout 60 "$BUILD/kernel_selftest" | tee "$OUTDIR/selftest.txt"
        SELFTEST_RC=${PIPESTATUS[0]}
    fi
else
    say "self-test did not compile; see $LOG"
    tail -20 "$LOG"
fi

# Step 2: the project against the machine's LibTorch, then the Catch2 kernel tests through the torch dispatcher.
PY=${TORCH_PYTHON:-python3}
PREFIX=$("$PY" -W ignore -c 'import torch.utils; print(torch.utils.cmake_prefix_path)' 2>>"$LOG")
if [ -z "$PREFIX" ]; then
    say "FAIL: python3 cannot import torch (see $LOG)"
    exit 2 # the self-test result above still stands
fi
say "torch $("$PY" -W ignore -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)' 2>/dev/null) at $PREFIX"
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
CONFIGURE=(-DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$PREFIX" -DCMAKE_CUDA_COMPILER="$NVCC"
    -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DANCHOR_CUDA=ON -DANCHOR_THIRD_PARTY="$THIRD"
    -DCMAKE_DISABLE_FIND_PACKAGE_Catch2=ON)
if [ "$DRY" = 1 ] && [ -f "$BUILD/build.ninja" ]; then
    say "dry run: reusing the configured $BUILD (the GPU run configures with: ${CONFIGURE[*]})"
    CONFIGURE=()
else
    say "configure (arch sm_$ARCH, third-party headers from $THIRD)"
fi
if ! timeout "$(left)" cmake -S "$ROOT" -B "$BUILD" "${GEN[@]}" "${CONFIGURE[@]}" >>"$LOG" 2>&1; then
    say "FAIL: cmake configure failed (self-test exit $SELFTEST_RC); last lines of $LOG:"
    tail -30 "$LOG"
    exit 2
fi
grep "AnchorCache: LibTorch" "$LOG" | tail -1
if ! grep -q "CUDA kernels linked=ON" "$LOG"; then
    say "WARNING: the CUDA kernels are not linked into the engine (LibTorch without CUDA?); tests will skip"
fi

say "build anchor_tests + anchor-sd + anchor-text ($(nproc) jobs, $(left)s left)"
KEEP=()
[ ${#GEN[@]} -gt 0 ] && KEEP=(-- -k 0)
if ! timeout "$(($(left) - 90))" cmake --build "$BUILD" --target anchor_tests anchor-sd anchor-text -j "$(nproc)" "${KEEP[@]}" \
    >>"$LOG" 2>&1; then
    say "FAIL: build failed or timed out (self-test exit $SELFTEST_RC); errors in $LOG:"
    grep -E "error|Error" "$LOG" | grep -v "^-- " | sort -u | head -40
    tail -15 "$LOG"
    exit 2
fi

say "run anchor_tests [kernels],[cuda] ($(left)s left)"
KT=$OUTDIR/kernels-tests.txt
timeout 150 "$BUILD/tests/anchor_tests" "[kernels],[cuda]" -r compact >"$KT" 2>&1
RC=$?
say "run anchor_tests [.kernels-perf] ($(left)s left)"
KP=$OUTDIR/kernels-perf.txt
timeout 90 "$BUILD/tests/anchor_tests" "[.kernels-perf]" -r compact >"$KP" 2>&1
PERF_RC=$?

# ---- the issue's table: one row per figure, "n/a: why" where this build cannot measure it -----------------------
GPU_OK=0
[ "$DRY" != 1 ] && nvidia-smi >/dev/null 2>&1 && GPU_OK=1
TABLE=$OUTDIR/table.txt
: >"$TABLE"
row() { printf '%-52s | %-34s | %s\n' "$1" "$2" "$3" >>"$TABLE"; }
# Peak GPU memory of a step: the device's memory.used sampled every 100 ms (the CUDA context included).
peak_start() {
    PEAKF=$OUTDIR/peak-$1.txt
    : >"$PEAKF"
    PEAK_PID=
    [ "$GPU_OK" = 1 ] || return 0
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 -lms 100 >"$PEAKF" 2>/dev/null &
    PEAK_PID=$!
}
peak_stop() {
    [ -n "$PEAK_PID" ] && { kill "$PEAK_PID" 2>/dev/null; wait "$PEAK_PID" 2>/dev/null; }
    local m
    m=$(sort -n "$PEAKF" 2>/dev/null | tail -1)
    echo "${m:-n/a} MiB peak"
}
# Runs a step when there is a GPU and time; in a dry run prints what it would run.
step() { # name seconds-needed command...
    local name=$1 need=$2
    shift 2
    if [ "$GPU_OK" != 1 ]; then
        echo "dry run: $*" >>"$OUTDIR/dry-run-commands.txt"
        return 3
    fi
    if [ "$(left)" -lt "$need" ]; then
        say "skip $name: $(left)s left, needs ~${need}s"
        return 4
    fi
    say "$name ($(left)s left)"
    peak_start "$name"
    timeout "$(($(left) - 10))" "$@" >"$OUTDIR/$name.log" 2>&1
    local rc=$?
    PEAK=$(peak_stop)
    echo "$name exit $rc" >>"$LOG"
    return $rc
}
why() { # the reason a row has no figure: the step's exit status
    case $1 in 3) echo "dry run (no GPU)" ;; 4) echo "skipped: time budget" ;; *) echo "failed (exit $1, see $OUTDIR)" ;; esac
}
json() { "$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); print($2)" "${@:3}" 2>/dev/null; }
SD=$BUILD/anchor-sd
# PSNR of two 8-bit RGB PNGs of the same size (standard library only: zlib and the five PNG row filters).
png_psnr() {
    "$PY" - "$1" "$2" <<'PY'
import math, struct, sys, zlib
def rgb(path):
    data = open(path, "rb").read()
    pos, idat, w, h = 8, b"", 0, 0
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            w, h, depth, color = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and color == 2, "8-bit RGB expected"
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw, stride, out, prev = zlib.decompress(idat), w * 3, [], bytearray(w * 3)
    for y in range(h):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - 3] if i >= 3 else 0
            b, c = prev[i], prev[i - 3] if i >= 3 else 0
            if f == 1: line[i] = (line[i] + a) & 255
            elif f == 2: line[i] = (line[i] + b) & 255
            elif f == 3: line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        out += line
        prev = line
    return out
x, y = rgb(sys.argv[1]), rgb(sys.argv[2])
mse = sum((p - q) ** 2 for p, q in zip(x, y)) / len(x)
print("identical" if mse == 0 else "%.1f dB" % (10 * math.log10(255 ** 2 / mse)))
PY
}

# 1. The cache modes on the GPU: random SD 1.5 UNet, 512x512, 20 DDIM steps, f32; the first mode's steps/s is the
#    UNet's CFG step rate (attention through scaled_dot_product_attention in a LibTorch 2.x build).
BC=$OUTDIR/bench-cache-512.txt
step bench-cache-512 150 "$SD" bench-cache --device cuda -W 512 -H 512 --steps 20 --sampler ddim --repeat 2 \
    --modes off,deepcache:3,freq -o "$BC" --overwrite
rc=$?
if [ $rc = 0 ]; then
    for i in 0 1 2; do
        row "bench-cache --device cuda 512² 20 DDIM: $(json "$BC.json" "d['modes'][$i]['mode']")" \
            "$(json "$BC.json" "'%.3f s, %.2fx, latent PSNR %s dB' % (d['modes'][$i]['wall_s_median'], d['modes'][$i]['speedup_vs_first_median'], d['modes'][$i]['latent_psnr_db'])")" \
            "$PEAK"
    done
    row "UNet 512² CFG steps/s f32 (bench-cache off, 20 steps)" \
        "$(json "$BC.json" "'%.1f' % (d['modes'][0]['total_steps'] / d['modes'][0]['wall_s_median'])")" "$PEAK"
else
    row "UNet 512² CFG steps/s f32 (bench-cache off, 20 steps)" "$(why $rc)" "-"
    row "bench-cache --device cuda 512² off/deepcache:3/freq" "$(why $rc)" "-"
fi
[ -f "$BC.json" ] && row "  d2h scalars per step: off / deepcache:3 / freq" \
    "$(json "$BC.json" "' / '.join(str(m.get('d2h_scalars_per_step', 'n/a')) for m in d['modes'])")" "-"

# 2. txt2img end to end on a random SD 1.5 single file made here (--dtype auto = f16 on CUDA; the VAE decodes in
#    f32 where its config says force_upcast), then CPU-seed parity at 256x256 in f32.
CK=$BUILD/sd15-random-f16.safetensors
step random-sd15 60 "$SD" random-model --family sd1 --dtype f16 -o "$CK" --overwrite
rc=$?
if [ $rc = 0 ]; then
    T0=$(date +%s.%N)
    step txt2img-512 90 "$SD" -m "$CK" -p "a photograph of an astronaut riding a horse" --steps 20 --sampler ddim \
        -W 512 -H 512 -s 1 --device cuda -o "$OUTDIR/txt2img-512.png" --overwrite
    rc=$?
    T1=$(date +%s.%N)
    if [ $rc = 0 ]; then
        row "txt2img 20 DDIM 512² end to end, f16 (random SD 1.5)" \
            "$(json "$OUTDIR/txt2img-512.png.json" "'%.2f s process; text %.3f, denoise %.3f, VAE %.3f s' % ($T1 - $T0, d['timings_s']['text_encoder'], d['timings_s']['denoise'], d['timings_s']['vae_decode'])")" \
            "$PEAK"
    else
        row "txt2img 20 DDIM 512² end to end, f16 (random SD 1.5)" "$(why $rc)" "-"
    fi
    step parity-cpu 120 "$SD" -m "$CK" -p "a red bicycle" --steps 8 --sampler ddim -W 256 -H 256 -s 7 --device cpu \
        --dtype f32 -o "$OUTDIR/parity-cpu.png" --overwrite &&
        step parity-cuda 60 "$SD" -m "$CK" -p "a red bicycle" --steps 8 --sampler ddim -W 256 -H 256 -s 7 \
            --device cuda --dtype f32 -o "$OUTDIR/parity-cuda.png" --overwrite
    rc=$?
    if [ $rc = 0 ]; then
        row "CPU-seed parity 256² 8 DDIM f32: PSNR cuda vs cpu" \
            "$(png_psnr "$OUTDIR/parity-cpu.png" "$OUTDIR/parity-cuda.png" 2>&1)" "$PEAK"
    else
        row "CPU-seed parity 256² 8 DDIM f32: PSNR cuda vs cpu" "$(why $rc)" "-"
    fi
else
    row "txt2img 20 DDIM 512² end to end, f16 (random SD 1.5)" "$(why $rc)" "-"
fi
if [ "$GPU_OK" != 1 ] || [ -f "$CK" ]; then
    # 2b. The UNet's CFG step rate by dtype, with SDPA (--attention fused: scaled_dot_product_attention on CUDA) and
    #     without (--attention exact: matmul-softmax-matmul): 8 DDIM steps at 512², the sidecar's per-step time.
    for dt in f32 f16 bf16; do
        for att in fused exact; do
            step "unet-$dt-$att" 45 "$SD" -m "$CK" -p "a red bicycle" --steps 8 --sampler ddim -W 512 -H 512 -s 1 \
                --device cuda --dtype "$dt" --attention "$att" -o "$OUTDIR/unet-$dt-$att.png" --overwrite
            rc=$?
            name="SD 1.5 UNet 512² CFG steps/s $dt, $([ $att = fused ] && echo SDPA || echo 'no SDPA'), no graphs"
            if [ $rc = 0 ]; then
                row "$name" "$(json "$OUTDIR/unet-$dt-$att.png.json" "'%.1f' % (1 / d['timings_s']['per_step'])")" "$PEAK"
            else
                row "$name" "$(why $rc)" "-"
            fi
        done
    done
else
    row "SD 1.5 UNet 512² CFG steps/s f32/f16/bf16, SDPA or not" "n/a: no random SD 1.5 file" "-"
fi
if [ "$GPU_OK" != 1 ] || [ -f "$CK" ]; then
    # 2c. The same steps with SDPA replayed as a CUDA graph (--cuda-graphs: captured at the first step, so the
    #     per-step time of 8 steps includes one capture).
    for dt in f32 f16 bf16; do
        step "unet-$dt-graphs" 45 "$SD" -m "$CK" -p "a red bicycle" --steps 8 --sampler ddim -W 512 -H 512 -s 1 \
            --device cuda --dtype "$dt" --attention fused --cuda-graphs -o "$OUTDIR/unet-$dt-graphs.png" --overwrite
        rc=$?
        name="SD 1.5 UNet 512² CFG steps/s $dt, SDPA, CUDA graphs"
        if [ $rc = 0 ]; then
            row "$name" "$(json "$OUTDIR/unet-$dt-graphs.png.json" "'%.1f' % (1 / d['timings_s']['per_step'])")" "$PEAK"
        else
            row "$name" "$(why $rc)" "-"
        fi
    done
    # 2d. f16 with every switch: SDPA, CUDA graphs, channels-last weights, cuDNN benchmark mode, fused QKV.
    step unet-f16-all 45 "$SD" -m "$CK" -p "a red bicycle" --steps 8 --sampler ddim -W 512 -H 512 -s 1 \
        --device cuda --dtype f16 --attention fused --cuda-graphs --channels-last --cudnn-benchmark --fused-qkv \
        -o "$OUTDIR/unet-f16-all.png" --overwrite
    rc=$?
    name="SD 1.5 UNet 512² CFG steps/s f16, SDPA, graphs, channels-last, cuDNN benchmark, fused QKV"
    if [ $rc = 0 ]; then
        row "$name" "$(json "$OUTDIR/unet-f16-all.png.json" "'%.1f' % (1 / d['timings_s']['per_step'])")" "$PEAK"
    else
        row "$name" "$(why $rc)" "-"
    fi
else
    row "SD 1.5 UNet 512² CFG steps/s, CUDA graphs (f32/f16/bf16)" "n/a: no random SD 1.5 file" "-"
fi

# 3. GPT-2-small (random weights of its shapes) in f16 on the GPU: decode latency with a full KV cache at three
#    contexts, then a 10k-token sink:4,1020 stream (the KV ring on the GPU); the text-diffusion bench, 12 x 768
#    random MDLM, off against the anchor cache.
TXT=$BUILD/anchor-text
GB=$OUTDIR/gpt2-bench-f16.json
step gpt2-f16 90 "$TXT" gpt2 bench --device cuda --dtype f16 --contexts 16,256,1000 --stream-tokens 1000,10000 \
    --repeats 20 --recompute-repeats 2 --json "$GB" --overwrite
rc=$?
for i in 0 1 2; do
    ctx=$(echo 16 256 1000 | cut -d' ' -f$((i + 1)))
    if [ $rc = 0 ]; then
        row "GPT-2-small f16 decode ms/token, context $ctx" \
            "$(json "$GB" "'%.3f' % (d['decode'][0]['rows'][$i]['seconds'][1] * 1e3)")" "$PEAK"
    else
        row "GPT-2-small f16 decode ms/token, context $ctx" "$(why $rc)" "-"
    fi
done
if [ $rc = 0 ]; then
    row "GPT-2-small f16 10k-token sink stream, ms/token" \
        "$(json "$GB" "'%.3f at 1k, %.3f at 10k (%+.1f %%)' % (d['sink']['stream'][0]['seconds'][1] * 1e3, d['sink']['stream'][-1]['seconds'][1] * 1e3, d['sink']['stream'][-1]['latency_change_percent'])")" \
        "$PEAK"
else
    row "GPT-2-small f16 10k-token sink stream, ms/token" "$(why $rc)" "-"
fi
GG=$OUTDIR/gpt2-bench-f16-graphs.json
step gpt2-f16-graphs 60 "$TXT" gpt2 bench --device cuda --dtype f16 --cuda-graphs --contexts 16,256,1000 \
    --stream-tokens 1000 --repeats 20 --recompute-repeats 1 --json "$GG" --overwrite
rc=$?
if [ $rc = 0 ]; then
    row "GPT-2-small f16 decode ms/token, CUDA graphs, ctx 16/256/1000" \
        "$(json "$GG" "' / '.join('%.3f' % (r['seconds'][1] * 1e3) for r in d['decode'][0]['rows'])")" "$PEAK"
else
    row "GPT-2-small f16 decode ms/token, CUDA graphs, ctx 16/256/1000" "$(why $rc)" "-"
fi
DB=$OUTDIR/diffusion-bench-12x768.json
step diffusion-12x768 90 "$TXT" diffusion bench --device cuda --dtype f16 --layers 12 --dim 768 --steps-list 128 \
    --repeats 2 --cache anchor --json "$DB" --overwrite
rc=$?
if [ $rc = 0 ]; then
    row "text diffusion 12x768 L=256 128 steps f16: off vs anchor" \
        "$(json "$DB" "'%.3f s vs %.3f s, %.2fx' % (d['rows'][0]['off_s'][1], d['rows'][0]['cached_s'][1], d['rows'][0]['speedup_median'])")" \
        "$PEAK"
else
    row "text diffusion 12x768 L=256 128 steps f16: off vs anchor" "$(why $rc)" "-"
fi

# 4. SDXL base at 1024x1024, f16 (random weights written here: ~5 GB).
CX=$BUILD/sdxl-random-f16.safetensors
step random-sdxl 120 "$SD" random-model --family sdxl --dtype f16 -o "$CX" --overwrite &&
    step sdxl-1024 90 "$SD" -m "$CX" -p "a lighthouse at dusk" --steps 4 --sampler ddim -W 1024 -H 1024 -s 1 \
        --device cuda -o "$OUTDIR/sdxl-1024.png" --overwrite
rc=$?
if [ $rc = 0 ]; then
    row "SDXL 1024² CFG steps/s f16 (4 DDIM steps)" \
        "$(json "$OUTDIR/sdxl-1024.png.json" "'%.2f' % (1 / d['timings_s']['per_step'])")" "$PEAK"
else
    row "SDXL 1024² CFG steps/s f16 (4 DDIM steps)" "$(why $rc)" "-"
fi
rm -f "$CX"

echo
echo "== correctness: CUDA kernel vs CPU reference"
echo "kernel                       | shape                | max rel err | result"
echo "-----------------------------+----------------------+-------------+-------"
grep "^kernel-table |" "$KT" | sed 's/^kernel-table | //'
echo
echo "== performance (median ms): ours | torch ops on the same device | CPU float64 reference | ratios"
grep "^kernel-perf |" "$KP" | sed 's/^kernel-perf | //'
[ $PERF_RC -ne 0 ] && tail -5 "$KP"
echo
echo "== the whole job on the GPU (issue 58)$([ "$GPU_OK" = 1 ] || echo ': DRY RUN, no GPU: no figures')"
printf '%-52s | %-34s | %s\n' "figure" "value" "peak GPU memory"
echo "-----------------------------------------------------+------------------------------------+----------------"
cat "$TABLE"
[ -f "$OUTDIR/dry-run-commands.txt" ] && { echo; echo "== commands the GPU run makes"; cat "$OUTDIR/dry-run-commands.txt"; }
echo
tail -3 "$KT"
SKIPPED=$(grep -c "skipped: CUDA" "$KT" || true)
if [ "$DRY" = 1 ]; then
    if [ $RC -ne 0 ]; then
        say "DRY RUN FAIL: tests exit $RC; details in $KT"
        exit 1
    fi
    say "DRY RUN: build, configure and the CPU-side tests passed; CUDA tests skipped ($SKIPPED cases), no figures"
    exit 0
fi
if [ "$SKIPPED" != "0" ]; then
    say "CUDA tests SKIPPED (no usable GPU or kernels not built): see $KT"
    exit 2
fi
if [ $RC -ne 0 ] || [ "$SELFTEST_RC" != "0" ]; then
    say "FAIL: kernel tests exit $RC, self-test exit $SELFTEST_RC; details in $KT"
    grep -B2 -A6 "failed" "$KT" | head -60
    exit 1
fi
say "PASS: all kernel and CUDA tests passed on the GPU"
exit 0
