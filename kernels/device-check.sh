#!/usr/bin/env bash
# Device check: builds AnchorCache against the GPU machine's LibTorch (the pip `torch` package), runs the CUDA kernel
# tests (CUDA vs CPU reference, relative error), the kernel performance mode and the cache benchmark on the GPU, and
# prints one table. Designed to finish within 10 minutes on a 16-core H200 machine.
#
#   kernels/device-check.sh                 # build dir: build-gpu
#   BUILD=/tmp/b OUT=/tmp/o kernels/device-check.sh
#
# Header-only dependencies the GPU image lacks (CLI11, nlohmann-json, Catch2, stb, pcre2.h, zlib.h) are read from
# $ANCHOR_THIRD_PARTY (default ./.device, filled by `kernels/device-check.sh --bundle` on a Debian machine that has the
# packages); OpenCV is optional.
#
# Exit status: 0 when every kernel test passed on a GPU, 1 on a test failure, 2 when the build could not be made or
# no GPU was usable (the table says which).
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
    grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >>.git/info/exclude
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

left() { echo $((570 - ($(date +%s) - START))); }
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
    echo "kernel               | shape            | max rel err | result"
    timeout 60 "$BUILD/kernel_selftest" | tee "$OUTDIR/selftest.txt"
    SELFTEST_RC=${PIPESTATUS[0]}
else
    say "self-test did not compile; see $LOG"
    tail -20 "$LOG"
fi

# Step 2: the project against the machine's LibTorch, then the Catch2 kernel tests through the torch dispatcher.
PREFIX=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>>"$LOG")
if [ -z "$PREFIX" ]; then
    say "FAIL: python3 cannot import torch (see $LOG)"
    exit 2 # the self-test result above still stands
fi
say "torch $(python3 -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)' 2>/dev/null) at $PREFIX"
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
say "configure (arch sm_$ARCH, third-party headers from $THIRD)"
if ! timeout "$(left)" cmake -S "$ROOT" -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$PREFIX" -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES="$ARCH" \
    -DANCHOR_CUDA=ON -DANCHOR_THIRD_PARTY="$THIRD" -DCMAKE_DISABLE_FIND_PACKAGE_Catch2=ON >>"$LOG" 2>&1; then
    say "FAIL: cmake configure failed (self-test exit $SELFTEST_RC); last lines of $LOG:"
    tail -30 "$LOG"
    exit 2
fi
grep "AnchorCache: LibTorch CUDA" "$LOG" | tail -1
if ! grep -q "CUDA kernels linked=ON" "$LOG"; then
    say "WARNING: the CUDA kernels are not linked into the engine (LibTorch without CUDA?); tests will skip"
fi

say "build anchor_tests + anchor-sd ($(nproc) jobs, $(left)s left)"
KEEP=()
[ ${#GEN[@]} -gt 0 ] && KEEP=(-- -k 0)
if ! timeout "$(($(left) - 90))" cmake --build "$BUILD" --target anchor_tests anchor-sd -j "$(nproc)" "${KEEP[@]}" \
    >>"$LOG" 2>&1; then
    say "FAIL: build failed or timed out (self-test exit $SELFTEST_RC); errors in $LOG:"
    grep -E "error|Error" "$LOG" | grep -v "^-- " | sort -u | head -40
    tail -15 "$LOG"
    exit 2
fi

say "run anchor_tests [kernels] ($(left)s left)"
KT=$OUTDIR/kernels-tests.txt
timeout 120 "$BUILD/tests/anchor_tests" "[kernels]" -r compact >"$KT" 2>&1
RC=$?
say "run anchor_tests [.kernels-perf] ($(left)s left)"
KP=$OUTDIR/kernels-perf.txt
timeout 120 "$BUILD/tests/anchor_tests" "[.kernels-perf]" -r compact >"$KP" 2>&1
PERF_RC=$?

BC=$OUTDIR/bench-cache-cuda.txt
if [ "$(left)" -gt 60 ]; then
    say "anchor-sd bench-cache on the GPU: SD 1.5 random weights, 512x512 and 256x256, 20 DDIM steps ($(left)s left)"
    timeout "$(($(left) - 30))" "$BUILD/anchor-sd" bench-cache --device cuda -W 512 -H 512 --repeat 3 -o "$BC" \
        --overwrite >"$OUTDIR/bench-cache-512.log" 2>&1
    echo "bench-cache 512 exit $?" >>"$LOG"
    timeout "$(($(left) - 20))" "$BUILD/anchor-sd" bench-cache --device cuda -W 256 -H 256 --repeat 3 \
        -o "$OUTDIR/bench-cache-cuda-256.txt" --overwrite >"$OUTDIR/bench-cache-256.log" 2>&1
    echo "bench-cache 256 exit $?" >>"$LOG"
fi

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
echo "== cache benchmark on the GPU"
cat "$BC" 2>/dev/null || tail -20 "$OUTDIR/bench-cache-512.log"
cat "$OUTDIR/bench-cache-cuda-256.txt" 2>/dev/null || tail -5 "$OUTDIR/bench-cache-256.log" 2>/dev/null
echo
tail -3 "$KT"
SKIPPED=$(grep -c "skipped: CUDA kernels" "$KT" || true)
if [ "$SKIPPED" != "0" ]; then
    say "CUDA tests SKIPPED (no usable GPU or kernels not built): see $KT"
    exit 2
fi
if [ $RC -ne 0 ] || [ "$SELFTEST_RC" != "0" ]; then
    say "FAIL: kernel tests exit $RC, self-test exit $SELFTEST_RC; details in $KT"
    grep -B2 -A6 "failed" "$KT" | head -60
    exit 1
fi
say "PASS: all kernel tests passed on the GPU"
exit 0
