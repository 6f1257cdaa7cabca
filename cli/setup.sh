#!/usr/bin/env bash
# Installs what is missing (Debian 12, as root), configures and builds Release into build/.
# Idempotent and quiet when there is nothing to do.
# Usage: cli/setup.sh [--sanitize] [--torch debian|pip] [--build-dir DIR] [--programs-only (anchor-sd, anchor-text)]
#   --torch debian (default): Debian's libtorch-dev (LibTorch 1.13, CPU) into build/.
#   --torch pip: PyPI's torch wheel (LibTorch 2.x with CUDA, C++20) into build-torch2/, from the virtual environment
#     $ANCHOR_TORCH_VENV (default /opt/anchor-torch2, or ~/.cache/anchorcache/torch2 when /opt is not writable),
#     created with `pip install $ANCHOR_TORCH_PIP` (default torch) when it has no torch: once per machine, every
#     clone reuses it. The CUDA kernels compile with the machine's nvcc for architectures $ANCHOR_CUDA_ARCHS (80;90).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir=""
cmake_extra=()
sanitize=0
torch=debian
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    # One clang build serves the sanitizer test run and the libFuzzer targets (tests/fuzz.sh); gcc when no clang.
    --sanitize) sanitize=1
                cmake_extra+=(-DANCHOR_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo -DANCHOR_CUDA=OFF) ;;
    --torch) [ $# -ge 2 ] || { echo "setup.sh: --torch needs debian or pip" >&2; exit 2; }
             case "$2" in debian|pip) torch="$2" ;;
               *) echo "setup.sh: --torch expects debian or pip, got '$2'" >&2; exit 2 ;; esac
             shift ;;
    --build-dir) [ $# -ge 2 ] || { echo "setup.sh: --build-dir needs a folder" >&2; exit 2; }
                 build_dir="$2"; shift ;;
    --programs-only) targets=(anchor-sd anchor-text) ;;
    *) echo "setup.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
if [ "$sanitize" = 1 ] && [ "$torch" = pip ]; then
  echo "setup.sh: --sanitize builds against Debian's LibTorch only (not --torch pip)" >&2; exit 2
fi
if [ -z "$build_dir" ]; then
  build_dir="$root/build"
  [ "$sanitize" = 1 ] && build_dir="$root/build-asan"
  [ "$torch" = pip ] && build_dir="$root/build-torch2"
fi

# libopenblas0-openmp is mandatory: without it LibTorch's GEMM runs on reference BLAS (an order of magnitude slower).
# python3-torch: tests/train/ checks the PyTorch MDLM trainer (text/train/mdlm_train_torch.py, for GPU machines) against
# the C++ trainer on the same LibTorch version.
packages=(dataset-fashion-mnist bible-kjv-text build-essential cmake ninja-build pkg-config libtorch-dev libopenblas0-openmp libopencv-dev libstb-dev
          libcli11-dev libdnnl-dev catch2 nlohmann-json3-dev libpcre2-dev libbenchmark-dev zlib1g-dev libpng-dev
          libcpp-httplib-dev libssl-dev libbrotli-dev curl nginx chromium nodejs openmpi-bin python3-torch)
if [ "$sanitize" = 1 ]; then
  packages+=(clang libclang-rt-14-dev)
fi
if [ "$torch" = pip ]; then
  packages+=(python3-venv)
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

# Where another OpenBLAS build (pthreads, serial) is installed too, Debian's alternatives may resolve libblas.so.3 to
# it; LibTorch is packaged for the OpenMP build (one thread pool, and the thread count LibTorch sets holds for BLAS).
multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || echo x86_64-linux-gnu)
for lib in libblas.so.3 liblapack.so.3; do
  want=/usr/lib/$multiarch/openblas-openmp/$lib
  now=$(readlink -f "/usr/lib/$multiarch/$lib" 2>/dev/null || true)
  if [ -e "$want" ] && [ "$now" != "$(readlink -f "$want")" ]; then
    if [ "$(id -u)" -eq 0 ]; then
      echo "setup: $lib -> the OpenMP OpenBLAS build (was $now)"
      update-alternatives --quiet --set "$lib-$multiarch" "$want"
    else
      echo "setup: warning: $lib resolves to $now, not the OpenMP OpenBLAS build; as root: update-alternatives --set $lib-$multiarch $want" >&2
    fi
  fi
done

if [ "$torch" = pip ]; then
  # PyPI's torch in a virtual environment outside the checkout (several GB with its CUDA libraries): made once.
  venv="${ANCHOR_TORCH_VENV:-}"
  if [ -z "$venv" ]; then
    venv=/opt/anchor-torch2
    if [ ! -x "$venv/bin/python" ] && ! { mkdir -p /opt 2>/dev/null && [ -w /opt ]; }; then
      venv="${XDG_CACHE_HOME:-$HOME/.cache}/anchorcache/torch2"
    fi
  fi
  if ! "$venv/bin/python" -c 'import torch' >/dev/null 2>&1; then
    echo "setup: installing PyPI's ${ANCHOR_TORCH_PIP:-torch} into $venv (once per machine)"
    mkdir -p "$(dirname "$venv")"
    ( flock 9
      [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
      "$venv/bin/pip" install -q --disable-pip-version-check ${ANCHOR_TORCH_PIP:-torch}
    ) 9>"$venv.lock" || { echo "setup: pip install ${ANCHOR_TORCH_PIP:-torch} into $venv failed" >&2; exit 1; }
  fi
  # torch.utils imports numpy when it can; the wheel does not need it, so its warning is noise here.
  torch_prefix=$("$venv/bin/python" -W ignore -c 'import torch.utils; print(torch.utils.cmake_prefix_path)' 2>/dev/null)
  cmake_extra+=(-DCMAKE_PREFIX_PATH="$torch_prefix" -DCMAKE_CUDA_ARCHITECTURES="${ANCHOR_CUDA_ARCHS:-80;90}")
  if [ -z "${CUDACXX:-}" ] && ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then
    echo "setup: warning: no nvcc (CUDA Toolkit): the CUDA kernels are not compiled in $build_dir" >&2
  fi
fi

start=$(date +%s)
if [ "$sanitize" = 1 ] && [ ! -f "$build_dir/build.ninja" ] && command -v clang++ >/dev/null; then
  export CC=clang CXX=clang++
  cmake_extra+=(-DANCHOR_FUZZ=ON)
fi
if [ ! -f "$build_dir/build.ninja" ]; then
  # The one configure line worth seeing: LibTorch version, C++ standard, whether the CUDA kernels compile and link.
  # (The rest, warnings included, is in the build folder's configure.log.)
  mkdir -p "$build_dir"
  if ! cmake -S "$root" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "${cmake_extra[@]}" \
      >"$build_dir/configure.log" 2>&1; then
    tail -30 "$build_dir/configure.log" >&2
    echo "setup: configure failed (whole output: $build_dir/configure.log)" >&2
    exit 1
  fi
  grep -E '^-- AnchorCache: LibTorch' "$build_dir/configure.log" || true
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
