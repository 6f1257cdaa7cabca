#!/usr/bin/env bash
# anchor-text serve on the embedded kjv-gpt2 / kjv-mdlm: curl (completion, SSE stream, models, diffusion, bad input)
# and the official npm `openai` client (tests/serve/node, installed here when missing; skipped with exit 77 only when
# npm or the registry is unavailable). Usage: text_serve_test.sh BUILD_DIR
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
build="$(cd "${1:-$root/build}" && pwd)"
source "$here/lib.sh"
work="$build/tests/serve"
mkdir -p "$work"
cd "$root"
start_server "$work/text_serve.log" "$build/anchor-text" serve
base="http://127.0.0.1:$PORT"
trap 'kill -9 $SERVER_PID 2>/dev/null || true' EXIT

# A completion, then the same one streamed: the chunks' text put together is the same.
r=$(curl -sS "$base/v1/completions" -H 'Content-Type: application/json' \
  -d '{"prompt":"In the beginning","max_tokens":8,"temperature":0}')
echo "$r" | grep -q '"object":"text_completion"' || fail "completion: $r"
echo "$r" | grep -q '"completion_tokens":8' || fail "usage: $r"
text=$(echo "$r" | python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["text"], end="")')
s=$(curl -sS -N "$base/v1/completions" -H 'Content-Type: application/json' \
  -d '{"prompt":"In the beginning","max_tokens":8,"temperature":0,"stream":true}')
[ "$(echo "$s" | grep -v "^$" | tail -n 1)" = "data: [DONE]" ] || fail "stream does not end with [DONE]: $s"
streamed=$(echo "$s" | python3 -c '
import json, sys
out = ""
for line in sys.stdin:
    if line.startswith("data: {"):
        out += json.loads(line[6:])["choices"][0]["text"]
print(out, end="")')
[ "$streamed" = "$text" ] || fail "streamed text '$streamed' != '$text'"
echo "$s" | grep -q '"finish_reason":"length"' || fail "no finish_reason in the stream"
# A stop sequence ends the completion before it.
r=$(curl -sS "$base/v1/completions" -H 'Content-Type: application/json' \
  -d "{\"prompt\":\"In the beginning\",\"max_tokens\":8,\"temperature\":0,\"stop\":[\"${text:3:2}\"]}")
echo "$r" | grep -q '"finish_reason":"stop"' || fail "stop sequence: $r"

curl -sS "$base/v1/models" | grep -q '"id":"kjv-gpt2"' || fail "models"
d=$(curl -sS "$base/anchor/v1/diffusion" -H 'Content-Type: application/json' \
  -d '{"prompt":"And God said","length":32,"steps":8,"seed":1,"cache":"anchor"}')
echo "$d" | grep -q '"text"' || fail "diffusion: $d"
echo "$d" | grep -q '"cache":"anchor' || fail "diffusion cache: $d"

# Bad input: 400 naming the field, one line.
expect_400() {
  local body="$1" field="$2" out code
  out=$(curl -sS -w '\n%{http_code}' "$base$3" -H 'Content-Type: application/json' -d "$body")
  code=$(echo "$out" | tail -1)
  [ "$code" = 400 ] || fail "$body: HTTP $code: $out"
  echo "$out" | head -1 | grep -q "\"param\":\"$field\"" || fail "$body: no param $field: $out"
}
expect_400 '{"prompt":"x","max_tokens":"many"}' max_tokens /v1/completions
expect_400 '{"prompt":"x","max_tokens":100000}' max_tokens /v1/completions
expect_400 '{"prompt":"x","kv":"sink:banana"}' kv /v1/completions
expect_400 '{"prompt":"x","temperature":9}' temperature /v1/completions
expect_400 '{"prompt":"x","max_tokens":300}' max_tokens /v1/completions # a full KV cache past n_positions
# A KV buffer no machine holds: refused by the memory estimate before anything is allocated.
expect_400 '{"prompt":"x","kv":"sink:4,1000000000","positions":"wrap"}' kv /v1/completions
expect_400 '{"prompt":"x", ' body /v1/completions
expect_400 '{"prompt":"x","cache":"anchor:tau=x"}' cache /anchor/v1/diffusion
expect_400 '{"prompt":"x","cache":"dual+gemm=bf16"}' cache /anchor/v1/diffusion

# A streaming client that goes away: its job stops (the queue is empty again long before 4000 tokens are done).
curl -sN --max-time 1 -o /dev/null "$base/v1/completions" -H 'Content-Type: application/json' \
  -d '{"prompt":"And God said","max_tokens":4000,"stream":true,"kv":"sink:4,60","positions":"reencode"}' || true
freed=0
for _ in $(seq 1 50); do
  curl -sS "$base/health" | grep -q '"queue":0' && { freed=1; break; }
  sleep 0.1
done
[ "$freed" = 1 ] || fail "the stream's job went on after its client left"

# The official openai client.
if command -v npm >/dev/null && command -v node >/dev/null; then
  if [ ! -d "$here/node/node_modules/openai" ]; then
    (cd "$here/node" && timeout 180 npm install --no-audit --no-fund >/dev/null 2>&1) || {
      echo "SKIP openai client: npm install failed (no registry?)"; npm_skip=1; }
  fi
  if [ -z "${npm_skip:-}" ]; then
    node "$here/node/openai_client.mjs" "$base/v1" || fail "openai client"
  fi
else
  echo "SKIP openai client: node/npm not installed"; npm_skip=1
fi

stop_server "$SERVER_PID" || fail "the server did not exit 0 after SIGTERM"
grep -q 'POST /v1/completions 200 .*kv=' "$work/text_serve.log" || fail "no request log line"
trap - EXIT
echo "text serve: ok"
[ -z "${npm_skip:-}" ] || exit 77
