#!/usr/bin/env bash
# Makes ../quants.safetensors with ggml's reference quantizers.
#   build.sh GGML_SOURCE_TREE   (a ggml checkout, e.g. the one stable-diffusion.cpp's ggml submodule names)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
ggml=${1:?usage: build.sh GGML_SOURCE_TREE}
b=$(mktemp -d)
cmake -S "$ggml" -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF >/dev/null
ninja -C "$b" ggml-base >/dev/null
cc -O2 -fopenmp -I "$ggml/include" "$here/gen_ggml_quants.c" "$b/src/libggml-base.a" -lm -lstdc++ -lpthread -o "$b/gen"
"$b/gen" "$here/../quants.safetensors.tmp" 24 7 > "$here/../quants.json.tmp"
echo "{\"ggml_commit\": \"$(git -C "$ggml" rev-parse HEAD 2>/dev/null || echo unknown)\"," \
  "\"made_with\": \"tests/golden/text/ggml_quants/generate/build.sh\", \"case\": $(cat "$here/../quants.json.tmp")}" \
  > "$here/../quants.json"
rm "$here/../quants.json.tmp"
mv "$here/../quants.safetensors.tmp" "$here/../quants.safetensors"
rm -rf "$b"
