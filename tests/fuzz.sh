#!/usr/bin/env bash
# Builds the libFuzzer targets with clang + ASan/UBSan into build-fuzz/ and runs each for SECONDS (default 60).
# Usage: tests/fuzz.sh [SECONDS] [TARGET...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
secs="${1:-60}"; shift || true
command -v clang++ >/dev/null || { apt-get install -y -qq clang libclang-rt-dev >/dev/null; }
"$root/cli/setup.sh" >/dev/null   # installs the other dependencies
bd="$root/build-fuzz"
if [ ! -f "$bd/build.ninja" ]; then
  CC=clang CXX=clang++ cmake -S "$root" -B "$bd" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DANCHOR_FUZZ=ON \
    -DANCHOR_SANITIZE=ON -DANCHOR_CUDA=OFF -DANCHOR_BUILD_TESTS=OFF >/dev/null
fi
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  for f in "$root"/tests/fuzz/fuzz_*.cpp; do targets+=("$(basename "${f%.cpp}")"); done
fi
ninja -C "$bd" "${targets[@]}" | grep -v '^\[' || true
export ASAN_OPTIONS="detect_leaks=1:allocator_may_return_null=1"
for t in "${targets[@]}"; do
  corpus="$root/tests/fuzz/corpus/${t#fuzz_}"
  work="$bd/corpus-run/${t#fuzz_}"; mkdir -p "$work" "$corpus"
  echo "fuzz: $t for ${secs}s"
  "$bd/$t" -max_total_time="$secs" -timeout=10 -rss_limit_mb=4096 -max_len=65536 \
    -artifact_prefix="$root/tests/fuzz/crashes/${t}-" "$work" "$corpus" 2>&1 | tail -3
done
