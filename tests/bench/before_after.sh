#!/usr/bin/env bash
# Interleaved before/after timing of two builds: BEFORE=<folder with the older anchor-sd and anchor-text> (required),
# AFTER=<folder> (default build/), ROUNDS (default 3). Rounds alternate the order. Prints wall seconds per run and each
# program's own figures (eval-fashion on the demo model, the text-diffusion bench on a random 12 x 768 model).
set -u
B=${BEFORE:?set BEFORE to the folder of the older anchor-sd / anchor-text}; A=${AFTER:-build}; R=${ROUNDS:-3}
cd "$(dirname "$0")/../../.."
export OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE
run() { # side bin
  local side=$1 bin=$2 t0 t1
  t0=$(date +%s.%N)
  "$bin/anchor-sd" eval-fashion --modes off,deepcache:3,freq --seeds 2 --samplers ddim --steps 20 \
      -o /tmp/ba_ef_$side --overwrite > /tmp/ba_ef_$side.log 2>&1
  t1=$(date +%s.%N); echo "eval-fashion $side $(echo "$t1 - $t0" | bc) s"
  grep -iE "^ *(off|deepcache|freq)|speed|ms" /tmp/ba_ef_$side.log | head -8 | sed "s/^/  [$side] /"
  t0=$(date +%s.%N)
  "$bin/anchor-text" diffusion bench --steps-list 64 --repeats 1 --cache anchor > /tmp/ba_tb_$side.log 2>&1
  t1=$(date +%s.%N); echo "text-bench $side $(echo "$t1 - $t0" | bc) s"
  tail -6 /tmp/ba_tb_$side.log | sed "s/^/  [$side] /"
}
for r in $(seq 1 $R); do
  echo "== round $r"
  if (( r % 2 )); then run before $B; run after $A; else run after $A; run before $B; fi
done
