#!/usr/bin/env bash
# anchor-text serve on the embedded kjv-gpt2 / kjv-mdlm: curl (completion, SSE stream, models, diffusion, bad input)
# and PyPI's official `openai` client (tests/serve/openai_client.py, installed into a venv outside the checkout when
# missing; skipped with exit 77 only when PyPI is unreachable). Usage: text_serve_test.sh BUILD_DIR
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

# The official openai client: PyPI's `openai` in the virtual environment $ANCHOR_PY_VENV (default /opt/anchor-py,
# shared with the other Python test clients; ~/.cache/anchorcache/py when /opt is not writable), installed when
# missing. Skipped (exit 77) only when PyPI cannot be reached; any other install failure fails the test.
py_venv="${ANCHOR_PY_VENV:-/opt/anchor-py}"
[ -n "${ANCHOR_PY_VENV:-}" ] || [ -x "$py_venv/bin/python" ] || { mkdir -p /opt 2>/dev/null && [ -w /opt ]; } ||
  py_venv="${XDG_CACHE_HOME:-$HOME/.cache}/anchorcache/py"
if ! "$py_venv/bin/python" -c 'import openai' >/dev/null 2>&1; then
  mkdir -p "$(dirname "$py_venv")"
  if ! ( flock 9
         [ -x "$py_venv/bin/python" ] || python3 -m venv "$py_venv"
         timeout 300 "$py_venv/bin/pip" install -q --disable-pip-version-check openai ) 9>"$py_venv.lock" \
       >"$work/pip_openai.log" 2>&1; then
    if curl -sS --max-time 20 -o /dev/null https://pypi.org/simple/openai/ 2>/dev/null; then
      fail "pip install openai into $py_venv failed with PyPI reachable: $(tail -3 "$work/pip_openai.log")"
    fi
    echo "SKIP openai client: PyPI unreachable (pip install openai into $py_venv failed)"; openai_skip=1
  fi
fi
if [ -z "${openai_skip:-}" ]; then
  "$py_venv/bin/python" "$here/openai_client.py" "$base/v1" || fail "openai client"
fi

stop_server "$SERVER_PID" || fail "the server did not exit 0 after SIGTERM"
grep -q 'POST /v1/completions 200 .*kv=' "$work/text_serve.log" || fail "no request log line"
trap - EXIT
echo "text serve: ok"
[ -z "${openai_skip:-}" ] || exit 77
