#!/usr/bin/env bash
# A LLaDA / Dream GGUF in anchor-text and in llama.cpp's llama-diffusion-cli, on the same file and thread count,
# interleaved in one run (issue: text diffusion on the published models, the 8B bench against llama.cpp).
#
#   tests/bench/dlm_peer.sh BUILD_DIR MODEL.gguf OUT_FILE [ROUNDS]
#
# Per round, one after the other:
#   ours  anchor-text diffusion bench --cache off: PROMPT_LEN prompt ids + GEN masked positions, one block, STEPS steps
#         (every step a full forward over the PROMPT_LEN + GEN positions); it runs the mode twice (as baseline and as
#         --cache), so each call gives two samples; the first pays the memory map's page faults and is logged, not counted
#   peer  llama-diffusion-cli -ub L -c L with L = PROMPT_LEN + GEN, one block of L, STEPS steps: its own "time per step"
#         (the prompt is a fixed text; every step runs all L positions, so the cost depends on L, not on the prompt)
# Then, once, the cached modes end to end in ours (E2E="gen:block:steps", CACHES): seconds per answer and the
# speed-up over `off`, from `diffusion bench` (synthetic prompt ids, temperature 0, no EOS stop).
# Peak RSS of each side from GNU time. Env: LLAMA_CPP (a llama.cpp tree with build/bin/llama-diffusion-cli),
# THREADS (2), GEN (256), PROMPT_LEN (64), STEPS (3), E2E ("64:32:32"; empty: skip), E2E_PROMPT_LEN (32),
# CACHES ("prefix,dual").
set -euo pipefail
build=${1:?usage: dlm_peer.sh BUILD_DIR MODEL.gguf OUT_FILE [ROUNDS]}
model=${2:?usage: dlm_peer.sh BUILD_DIR MODEL.gguf OUT_FILE [ROUNDS]}
out=${3:?usage: dlm_peer.sh BUILD_DIR MODEL.gguf OUT_FILE [ROUNDS]}
rounds=${4:-2}
threads=${THREADS:-2}
gen=${GEN:-256}
plen=${PROMPT_LEN:-64}
steps=${STEPS:-3}
e2e=${E2E-64:32:32}
e2e_plen=${E2E_PROMPT_LEN:-32}
caches=${CACHES:-prefix,dual}
# not passed on: llama.cpp reads some environment variables of these short names (GEN stopped its run at step 0)
unset GEN PROMPT_LEN STEPS E2E E2E_PROMPT_LEN CACHES
cli=${LLAMA_CPP:?set LLAMA_CPP to a llama.cpp tree built with llama-diffusion-cli}/build/bin/llama-diffusion-cli
[ -f "$model" ] || { echo "error: model file '$model' does not exist" >&2; exit 2; }
[ -x "$cli" ] || { echo "error: '$cli' is not an executable" >&2; exit 2; }
[ -e "$out" ] && { echo "error: '$out' exists; not overwriting it" >&2; exit 2; }
len=$((plen + gen))
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
log() { echo "$*" | tee -a "$tmp/out"; }
log "# dlm_peer: $(basename "$model") ($(du -BM "$model" | cut -f1)), threads $threads, $len positions per step ($plen prompt + $gen), $steps steps per run"
log "# ours: $(git -C "$(dirname "$0")" describe --always --dirty 2>/dev/null); llama.cpp: $("$cli" --version 2>&1 | grep -m1 -i version || echo '?')"
log "# $(lscpu | grep 'Model name' | sed 's/  */ /g'); $(date -u +%FT%TZ)"
for r in $(seq 1 "$rounds"); do
  /usr/bin/time -f "%M" -o "$tmp/rss" "$build/anchor-text" -t "$threads" diffusion bench -m "$model" --gen-length "$gen" \
    --block-length "$gen" --steps-list "$steps" --prompt-len "$plen" --repeats 1 --cache off >"$tmp/ours" 2>&1
  # the first run pays the memory map's page faults: logged, not counted
  awk -F' [|] ' '$1 == "off" {print $3}' "$tmp/ours" >"$tmp/v"
  [ "$(wc -l <"$tmp/v")" = 2 ] || { cat "$tmp/ours" >&2; echo "error: anchor-text diffusion bench printed no two 'off' rows" >&2; exit 1; }
  log "round $r ours s/step-cold $(head -1 "$tmp/v")"
  log "round $r ours s/step $(tail -1 "$tmp/v")"
  log "round $r ours peak_rss_mb $(( $(cat "$tmp/rss") / 1024 ))"
  /usr/bin/time -f "%M" -o "$tmp/rss" "$cli" -m "$model" -p "In the beginning God created the heaven and the earth." \
    -ub "$len" -c "$len" --diffusion-steps "$steps" --diffusion-block-length "$len" -t "$threads" --temp 0 >"$tmp/peer" 2>&1
  v=$(sed -n 's/.*, time per step: \([0-9.]*\)ms.*/\1/p' "$tmp/peer")
  [ -n "$v" ] || { cat "$tmp/peer" >&2; echo "error: llama-diffusion-cli printed no 'time per step'" >&2; exit 1; }
  log "round $r llama-diffusion-cli s/step $(awk -v m="$v" 'BEGIN {printf "%.4f", m / 1000}')"
  log "round $r llama-diffusion-cli peak_rss_mb $(( $(cat "$tmp/rss") / 1024 ))"
done
if [ -n "$e2e" ]; then
  IFS=: read -r eg eb es <<<"$e2e"
  log "# end to end in ours: gen $eg, block $eb, steps $es, prompt $e2e_plen, caches $caches against off"
  "$build/anchor-text" -t "$threads" diffusion bench -m "$model" --gen-length "$eg" --block-length "$eb" --steps-list "$es" \
    --prompt-len "$e2e_plen" --repeats 1 --cache "$caches" 2>&1 | tee -a "$tmp/out"
fi
log "summary (s/step: min / median / max over every sample; ratio = llama-diffusion-cli median / ours median)"
python3 - "$tmp/out" <<'EOF' | tee -a "$tmp/out"
import statistics, sys
d = {}
for line in open(sys.argv[1]):
    p = line.split()
    if len(p) == 5 and p[0] == "round" and p[3] == "s/step":
        d.setdefault(p[2], []).append(float(p[4]))
ours = d.get("ours", [])
for who, vs in d.items():
    med = statistics.median(vs)
    ratio = "" if who == "ours" or not ours else "  ratio %.2fx" % (med / statistics.median(ours))
    print("%-20s %.3f / %.3f / %.3f s per step (%d samples)%s" % (who, min(vs), med, max(vs), len(vs), ratio))
EOF
mv "$tmp/out" "$out.tmp" && mv "$out.tmp" "$out"
echo "wrote $out"
