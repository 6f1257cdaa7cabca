#!/usr/bin/env bash
# Device check for the CUDA kernels: builds AnchorCache against the GPU machine's LibTorch (the pip `torch` package),
# runs the kernel tests (CUDA vs CPU reference) and prints a table. Designed to finish within 10 minutes.
#
#   kernels/device-check.sh            # build dir: build-gpu
#   BUILD=/tmp/b kernels/device-check.sh
#
# Exit status: 0 when every kernel test passed on a GPU, 1 on a test failure, 2 when the build could not be made or
# no GPU was usable (the table says which).
set -uo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
BUILD=${BUILD:-$ROOT/build-gpu}
START=$(date +%s)
LOG=$BUILD/device-check.log
mkdir -p "$BUILD"
: >"$LOG"

left() { echo $((600 - ($(date +%s) - START))); }
say() { echo "[device-check $(($(date +%s) - START))s] $*"; }

say "GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo 'nvidia-smi unavailable')"

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
if timeout 240 "$NVCC" -std=c++17 -O2 -arch="sm_$ARCH" -I"$ROOT" "$ROOT/kernels/cuda/selftest/kernel_selftest.cu" \
    "$ROOT/kernels/cuda/dct_energy.cu" "$ROOT/kernels/cuda/ring_write.cu" -lcufft -o "$BUILD/kernel_selftest" \
    >>"$LOG" 2>&1; then
    echo "kernel               | shape            | max rel err | result"
    timeout 120 "$BUILD/kernel_selftest"
    SELFTEST_RC=$?
else
    say "self-test did not compile; see $LOG"
fi

# Step 2: the project against the machine's LibTorch, then the Catch2 kernel tests through the torch dispatcher.
PREFIX=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>>"$LOG")
if [ -z "$PREFIX" ]; then
    say "FAIL: python3 cannot import torch (see $LOG)"
    exit 2  # the self-test result above still stands
fi
say "torch $(python3 -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)' 2>/dev/null) at $PREFIX"
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
say "configure (arch sm_$ARCH)"
if ! timeout "$(left)" cmake -S "$ROOT" -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$PREFIX" -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES="$ARCH" \
    -DANCHOR_CUDA=ON >>"$LOG" 2>&1; then
    say "FAIL: cmake configure failed (self-test exit $SELFTEST_RC); last lines of $LOG:"
    tail -25 "$LOG"
    exit 2
fi
grep "AnchorCache: LibTorch CUDA" "$LOG" | tail -1
if ! grep -q "CUDA kernels linked=ON" "$LOG"; then
    say "WARNING: the CUDA kernels are not linked into the engine (LibTorch without CUDA?); tests will skip"
fi

say "build anchor_tests ($(nproc) jobs, $(left)s left)"
if ! timeout "$(($(left) - 60))" cmake --build "$BUILD" --target anchor_tests -j "$(nproc)" >>"$LOG" 2>&1; then
    say "FAIL: build failed or timed out (self-test exit $SELFTEST_RC); last lines of $LOG:"
    grep -E "error|Error" "$LOG" | head -20
    tail -15 "$LOG"
    exit 2
fi

say "run anchor_tests [kernels]"
OUT=$BUILD/kernels-tests.txt
timeout "$(left)" "$BUILD/tests/anchor_tests" "[kernels]" -r compact >"$OUT" 2>&1
RC=$?

echo
echo "kernel                       | shape                | max rel err | result"
echo "-----------------------------+----------------------+-------------+-------"
grep "^kernel-table |" "$OUT" | sed 's/^kernel-table | //'
SKIPPED=$(grep -c "skipped: CUDA kernels" "$OUT" || true)
echo
tail -3 "$OUT"
if [ "$SKIPPED" != "0" ]; then
    say "CUDA tests SKIPPED (no usable GPU or kernels not built): see $OUT"
    exit 2
fi
if [ $RC -ne 0 ] || [ "$SELFTEST_RC" != "0" ]; then
    say "FAIL: kernel tests exit $RC, self-test exit $SELFTEST_RC; details in $OUT"
    grep -B2 -A6 "failed" "$OUT" | head -60
    exit 1
fi
say "PASS: all kernel tests passed on the GPU"
exit 0
