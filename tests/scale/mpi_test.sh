#!/usr/bin/env bash
# `mpirun --oversubscribe -np 2 anchor-sd --prompts-file F -o DIR/` on the embedded demo model gives the same images
# (pixels: the PNGs' IDAT data) as one process, numbered by global index, with one manifest of every image from rank
# 0; a removed image is made again by a rerun with --skip-existing, and only that one. Exit 77 (skip) without mpirun.
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
echo "mpi: ok (2 ranks = 1 process on 5 images; resume remade 1)"
