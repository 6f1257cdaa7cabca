#!/usr/bin/env bash
# Installs what is missing (Debian 12, as root), configures and builds Release into build/.
# Idempotent and quiet when there is nothing to do.
# Usage: cli/setup.sh [--sanitize] [--build-dir DIR] [--programs-only (anchor-sd, anchor-text; no tests)]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir="$root/build"
cmake_extra=()
sanitize=0
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    # One clang build serves the sanitizer test run and the libFuzzer targets (tests/fuzz.sh); gcc when no clang.
    --sanitize) build_dir="$root/build-asan"; sanitize=1
                cmake_extra+=(-DANCHOR_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo -DANCHOR_CUDA=OFF) ;;
    --build-dir) build_dir="$2"; shift ;;
    --programs-only) targets=(anchor-sd anchor-text) ;;
    *) echo "setup.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done

# libopenblas0-openmp is mandatory: without it LibTorch's GEMM runs on reference BLAS (~35x slower).
# python3-torch: tests/train/ checks the PyTorch MDLM trainer (text/train/mdlm_train_torch.py, for GPU machines) against
# the C++ trainer on the same LibTorch version.
packages=(dataset-fashion-mnist bible-kjv-text build-essential cmake ninja-build pkg-config libtorch-dev libopenblas0-openmp libopencv-dev libstb-dev
          libcli11-dev libdnnl-dev catch2 nlohmann-json3-dev libpcre2-dev libbenchmark-dev zlib1g-dev libpng-dev
          libcpp-httplib-dev libssl-dev libbrotli-dev curl nginx chromium nodejs openmpi-bin python3-torch)
if [ "$sanitize" = 1 ]; then
  packages+=(clang libclang-rt-14-dev)
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  if [ "$(id -u)" -ne 0 ]; then echo "setup: run as root to install packages" >&2; exit 1; fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

start=$(date +%s)
if [ "$sanitize" = 1 ] && [ ! -f "$build_dir/build.ninja" ] && command -v clang++ >/dev/null; then
  export CC=clang CXX=clang++
  cmake_extra+=(-DANCHOR_FUZZ=ON)
fi
if [ ! -f "$build_dir/build.ninja" ]; then
  cmake -S "$root" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "${cmake_extra[@]}" >/dev/null
fi
# Two cores and ~1 GB per torch translation unit: build with every core.
# The pipeline's status is ninja's (grep finding nothing to print is not a failure).
ninja_rc=0
ninja -C "$build_dir" "${targets[@]}" | { grep -v -E '^\[[0-9]+/[0-9]+\]|^ninja: (Entering|Leaving)' || true; } ||
  ninja_rc=$?
[ "$ninja_rc" -eq 0 ] || { echo "setup: build failed" >&2; exit 1; }
end=$(date +%s)
[ $((end - start)) -gt 5 ] && echo "setup: build finished in $((end - start)) s ($build_dir)"
exit 0
