#!/usr/bin/env bash
# The test command: installs what is missing, builds, runs every test through CTest (each Catch2 test case and
# golden_runner registered individually).
# Usage: tests/run.sh [--sanitize | --torch debian|pip] [ctest args...]
#   --torch pip: the LibTorch 2.x build (PyPI's torch, CUDA kernels compiled and linked) in build-torch2/; see
#   cli/setup.sh. Tests that need a GPU report "Skipped" with the reason when none is present.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir="$root/build"
setup_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --sanitize)
      setup_args+=(--sanitize); build_dir="$root/build-asan"
      export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1" UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" ;;
    --torch)
      [ $# -ge 2 ] || { echo "run.sh: --torch needs debian or pip" >&2; exit 2; }
      setup_args+=(--torch "$2"); [ "$2" = pip ] && build_dir="$root/build-torch2"
      shift ;;
    *) break ;;
  esac
  shift
done
"$root/cli/setup.sh" "${setup_args[@]}"
start=$(date +%s)
cd "$build_dir"
# Two test processes at a time on two cores: one intra-op thread each, and no OpenMP spin-waiting, or the runs
# collapse (OpenMP busy-waiting on an oversubscribed machine costs ~100x). Tests that need threads set them.
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
ctest --output-on-failure -j2 "$@"
echo "tests: finished in $(( $(date +%s) - start )) s ($(basename "$build_dir"))"
