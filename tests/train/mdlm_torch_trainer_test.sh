#!/usr/bin/env bash
# text/train/mdlm_train_torch.py (the trainer for machines with only PyTorch) against the C++ trainer
# (anchor-text diffusion train) on the same tiny KJV run, CPU, same LibTorch version:
#   1. its --init writes the C++ trainer's step-0 weights bit for bit (the C++ side: one step at lr 0, which leaves the
#      weights as initialised) and the same compact vocabulary;
#   2. resumed from a C++ checkpoint at step 2, it logs the same losses as the C++ trainer for steps 3-6 (same batches,
#      times and masks from the per-step generator, same loss, AdamW, schedule and clip), to 4 decimals;
#   3. the C++ trainer resumes what it writes.
# Usage: mdlm_torch_trainer_test.sh BUILD_DIR. Exit 0 = pass; 77 = skipped (no python3 torch, or no KJV text).
set -euo pipefail
B=$(cd "$1" && pwd)
SRC=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=
for p in python3 /usr/bin/python3; do # the first interpreter with torch (a pyenv python3 may shadow Debian's)
    if "$p" -c 'import torch' 2>/dev/null; then PYTHON=$p && break; fi
done
[ -n "$PYTHON" ] || { echo "SKIP: no python3 with torch (apt-get install python3-torch)"; exit 77; }
PY="$PYTHON $SRC/text/train/mdlm_train_torch.py"
[ -e /usr/lib/bible.data ] || { echo "SKIP: bible-kjv-text is not installed"; exit 77; }
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
export OMP_NUM_THREADS=1
common=(--layers 2 --dim 32 --heads 2 --cond-dim 16 --seq-len 32 --batch 4 --seed 3 --loss-weight masked_mean)
tr() { "$B/anchor-text" --threads 1 diffusion train --kjv "${common[@]}" --log-every 1 --checkpoint-every 100 "$@"; }

# 1. step-0 weights
tr -o "$W/zero" --steps 1 --lr 0 --warmup 0 >/dev/null
mkdir "$W/pyinit"
cp "$W/zero/config.json" "$W/zero/train_tokens.bin" "$W/pyinit/"
$PY "$W/pyinit" --init --steps 1 --batch 4 --seq-len 32 --lr 0 --warmup 0 --stop-after 1 --seed 3 >/dev/null
$PYTHON - "$W/zero/model.safetensors" "$W/pyinit/model.safetensors" "$SRC/text/train" <<'PY'
import sys
sys.path.insert(0, sys.argv[3])
import torch, mdlm_train_torch as m
a, _ = m.read_safetensors(sys.argv[1])
b, _ = m.read_safetensors(sys.argv[2])
assert sorted(a) == sorted(b), f"tensor names differ: {sorted(set(a) ^ set(b))}"
bad = [n for n in a if not torch.equal(a[n], b[n])]
assert not bad, f"step-0 weights differ in {bad[:5]}"
print(f"init: {len(a)} tensors equal bit for bit, vocab_ids {a['vocab_ids'].numel()}")
PY

# 2. steps 3-6 from a C++ checkpoint at step 2
tr -o "$W/cpp" --steps 6 --lr 1e-2 --warmup 2 --stop-after 2 >/dev/null
cp -r "$W/cpp" "$W/py"
tr -o "$W/cpp" --steps 6 --lr 1e-2 --warmup 2 >/dev/null
$PY "$W/py" --steps 6 --batch 4 --seq-len 32 --lr 1e-2 --warmup 2 --seed 3 --log-every 1 --eval-every 0 >/dev/null
want=$(grep -E '^step [3-6]/6 ' "$W/cpp/train_log.txt" | awk '{print $2, $4}')
got=$(grep -E '^step [3-6]/6 ' "$W/py/train_log.txt" | awk '{print $2, $4}')
echo "C++:     $(echo $want)"
echo "PyTorch: $(echo $got)"
$PYTHON - "$want" "$got" <<'PY'
import sys
w = [l.split() for l in sys.argv[1].splitlines()]
g = [l.split() for l in sys.argv[2].splitlines()]
assert len(w) == 4 and [x[0] for x in w] == [x[0] for x in g], "steps 3-6 missing from a log"
for (s, a), (_, b) in zip(w, g):
    assert abs(float(a) - float(b)) <= 2e-4, f"step {s}: C++ loss {a}, PyTorch loss {b}"
PY

# 3. the C++ trainer resumes the PyTorch trainer's folder
resumed=$(tr -o "$W/py" --steps 7 --lr 1e-2 --warmup 2)
echo "$resumed" | grep "resumed from .* at step 6"
echo "$resumed" | grep -q "^step 7/7 loss"
echo "PASS"
