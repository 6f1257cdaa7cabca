#!/usr/bin/env bash
# `mpirun --oversubscribe -np 2 anchor-sd --prompts-file F -o DIR/` on the embedded demo model gives the same images
# (pixels: the PNGs' IDAT data) as one process, numbered by global index, with one manifest of every image from rank
# 0; a removed image is made again by a rerun with --skip-existing, and only that one. The same for anchor-text's
# --prompts-file (GPT-2 generation and text diffusion, one text file per prompt). Exit 77 (skip) without mpirun.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
build="$(cd "${1:-$root/build}" && pwd)"
command -v mpirun >/dev/null || { echo "SKIP: mpirun not installed (apt-get install openmpi-bin)"; exit 77; }
work="$build/tests/scale/mpi"
rm -rf "$work"; mkdir -p "$work"
cd "$root"
printf 'a shirt\na dress\na sneaker\na bag\na coat\n' > "$work/prompts.txt"
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
args=(--prompts-file "$work/prompts.txt" --steps 3 --sampler ddim --seed 5 --cache deepcache:2)
"$build/anchor-sd" "${args[@]}" -o "$work/one/" > "$work/one.log" 2>&1 || { cat "$work/one.log"; exit 1; }
root_flag=(); [ "$(id -u)" = 0 ] && root_flag=(--allow-run-as-root)
mpirun "${root_flag[@]}" --oversubscribe -np 2 -x OMP_NUM_THREADS -x OMP_WAIT_POLICY \
  "$build/anchor-sd" "${args[@]}" -o "$work/two/" > "$work/two.log" 2>&1 || { cat "$work/two.log"; exit 1; }
pixels() { python3 - "$@" <<'PY'
import struct, sys, zlib
for path in sys.argv[1:]:
    b = open(path, "rb").read()
    i, idat = 8, b""
    while i < len(b):
        n, = struct.unpack(">I", b[i:i + 4])
        if b[i + 4:i + 8] == b"IDAT":
            idat += b[i + 8:i + 8 + n]
        i += 12 + n
    print(path.rsplit("/", 1)[-1], zlib.crc32(zlib.decompress(idat)))
PY
}
a=$(cd "$work/one" && pixels 0000*.png); b=$(cd "$work/two" && pixels 0000*.png)
[ "$(echo "$a" | wc -l)" = 5 ] || { echo "FAIL: one process wrote $(echo "$a" | wc -l) images"; exit 1; }
[ "$a" = "$b" ] || { echo "FAIL: images differ"; echo "$a"; echo "$b"; exit 1; }
grep -q "MPI rank 1 of 2" "$work/two.log" || { echo "FAIL: no rank 1"; cat "$work/two.log"; exit 1; }
python3 - "$work/two/manifest.json" <<'PY' || exit 1
import json, sys
m = json.load(open(sys.argv[1]))
assert m["image_count"] == 5 and m["shards"] == 2, m
assert [im["image_index"] for im in m["images"]] == [0, 1, 2, 3, 4]
assert all("timings_s" in im and "seed" in im and "prompt" in im for im in m["images"])
PY
# Resume: only the missing image is made again, the same as before.
rm "$work/two/00003.png" "$work/two/00003.png.json"
mpirun "${root_flag[@]}" --oversubscribe -np 2 -x OMP_NUM_THREADS -x OMP_WAIT_POLICY \
  "$build/anchor-sd" "${args[@]}" -o "$work/two/" --skip-existing > "$work/resume.log" 2>&1 || { cat "$work/resume.log"; exit 1; }
[ "$(grep -c '^saved ' "$work/resume.log")" = 1 ] || { echo "FAIL: resume ran more than the missing image"; cat "$work/resume.log"; exit 1; }
[ "$(cd "$work/two" && pixels 00003.png)" = "$(cd "$work/one" && pixels 00003.png)" ] || { echo "FAIL: resumed image differs"; exit 1; }

# anchor-text: GPT-2 generation and text diffusion of a prompts file, 2 ranks = 1 process, resumed the same way.
printf 'In the beginning\nAnd God said\nBlessed are\n# a comment\nThe LORD is my\nand it came to pass\n' > "$work/text_prompts.txt"
text_job() { # NAME ARGS...: one process into NAME-one/, two ranks into NAME-two/, the same texts and a manifest
  local name=$1; shift
  "$build/anchor-text" "$@" --prompts-file "$work/text_prompts.txt" -o "$work/$name-one/" > "$work/$name-one.log" 2>&1 ||
    { cat "$work/$name-one.log"; exit 1; }
  mpirun "${root_flag[@]}" --oversubscribe -np 2 -x OMP_NUM_THREADS -x OMP_WAIT_POLICY \
    "$build/anchor-text" "$@" --prompts-file "$work/text_prompts.txt" -o "$work/$name-two/" > "$work/$name-two.log" 2>&1 ||
    { cat "$work/$name-two.log"; exit 1; }
  grep -q "MPI rank 1 of 2" "$work/$name-two.log" || { echo "FAIL: $name: no rank 1"; cat "$work/$name-two.log"; exit 1; }
  [ "$(ls "$work/$name-one" | grep -c '^0000[0-9].txt$')" = 5 ] || { echo "FAIL: $name: not 5 outputs"; exit 1; }
  for f in "$work/$name-one"/0000?.txt; do
    cmp -s "$f" "$work/$name-two/$(basename "$f")" || { echo "FAIL: $name: $(basename "$f") differs"; exit 1; }
  done
  python3 - "$work/$name-two/manifest.json" <<'PY' || exit 1
import json, sys
m = json.load(open(sys.argv[1]))
assert m["count"] == 5 and m["shards"] == 2, m
assert [it["index"] for it in m["items"]] == [0, 1, 2, 3, 4]
assert m["items"][3]["item"] == "The LORD is my", m["items"][3]
assert all("timings_s" in it and "seed" in it for it in m["items"])
PY
  rm "$work/$name-two/00001.txt" "$work/$name-two/00001.txt.json"
  mpirun "${root_flag[@]}" --oversubscribe -np 2 -x OMP_NUM_THREADS -x OMP_WAIT_POLICY \
    "$build/anchor-text" "$@" --prompts-file "$work/text_prompts.txt" -o "$work/$name-two/" --skip-existing \
    > "$work/$name-resume.log" 2>&1 || { cat "$work/$name-resume.log"; exit 1; }
  [ "$(grep -c '^wrote ' "$work/$name-resume.log")" = 1 ] || { echo "FAIL: $name: resume ran more than one"; exit 1; }
  cmp -s "$work/$name-one/00001.txt" "$work/$name-two/00001.txt" || { echo "FAIL: $name: resumed text differs"; exit 1; }
}
text_job gpt2 gpt2 generate -m assets/models/kjv-gpt2 --max-new 12 --temperature 0.8 --seed 3
text_job mdlm diffusion generate --length 40 --steps 8 -s 2 --cache anchor
echo "mpi: ok (2 ranks = 1 process on 5 images; resume remade 1; anchor-text gpt2 and diffusion: 5 texts each, resumed 1)"
