#!/usr/bin/env bash
# Builds the libFuzzer targets (clang + ASan/UBSan, in build-asan/) and runs each for SECONDS (default 60), keeping
# new corpus entries in tests/fuzz/corpus/<target>/ and writing crashing inputs to tests/fuzz/crashes/.
# Usage: tests/fuzz.sh [SECONDS] [TARGET...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
secs="${1:-60}"; shift || true
# The fuzz targets live in the sanitizer build (clang, ASan + UBSan, libFuzzer coverage on all code): build-asan/.
"$root/cli/setup.sh" --sanitize
bd="$root/build-asan"
[ -f "$bd/CMakeCache.txt" ] && grep -q "ANCHOR_FUZZ:BOOL=ON" "$bd/CMakeCache.txt" ||
  { echo "fuzz: $bd was not configured with clang and -DANCHOR_FUZZ=ON; remove it and run again" >&2; exit 1; }
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
