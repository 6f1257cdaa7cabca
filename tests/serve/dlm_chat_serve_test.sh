#!/usr/bin/env bash
# POST /v1/chat/completions of `anchor-text serve --dlm-model` on a random tiny LLaDA GGUF (q4_0, written by
# `anchor-text diffusion random-model`) with the test BPE tokenizer and a LLaMA-3 chat template next to it: an answer,
# the same answer streamed (one chunk per committed block, ending with [DONE]), the cache extension, and bad requests
# answered 400 naming the field while the server keeps serving. Usage: dlm_chat_serve_test.sh BUILD_DIR
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
build="$(cd "${1:-$root/build}" && pwd)"
source "$here/lib.sh"
work="$build/tests/serve/dlm_chat"
rm -rf "$work" && mkdir -p "$work"
cd "$root"
"$build/anchor-text" diffusion random-model --preset llada-tiny --weights-dtype q4_0 -o "$work/llada-tiny-q4_0.gguf" -s 3
cp tests/golden/text/dlm/tokenizer_bpe/tokenizer.json "$work/"
cat > "$work/tokenizer_config.json" <<'JSON'
{"chat_template": "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"}
JSON
start_server "$work/serve.log" "$build/anchor-text" serve --no-diffusion --dlm-model "$work/llada-tiny-q4_0.gguf"
base="http://127.0.0.1:$PORT"
trap 'kill -9 $SERVER_PID 2>/dev/null || true' EXIT

req='{"messages":[{"role":"user","content":"In the beginning"}],"max_tokens":16,"block_length":8,"steps":8,"seed":1,"stop_at_eos":false'
r=$(curl -sS "$base/v1/chat/completions" -H 'Content-Type: application/json' -d "$req}")
echo "$r" | grep -q '"object":"chat.completion"' || fail "chat completion: $r"
echo "$r" | grep -q '"completion_tokens":16' || fail "usage: $r"
echo "$r" | grep -q '"finish_reason":"length"' || fail "finish_reason: $r"
text=$(echo "$r" | python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["message"]["content"], end="")')
# Streamed: the chunks' content put together is the same answer; the dual cache (one step per block, so the uncached
# result) gives it too.
for extra in '' ',"cache":"dual"'; do
  s=$(curl -sS -N "$base/v1/chat/completions" -H 'Content-Type: application/json' -d "$req,\"stream\":true$extra}")
  [ "$(echo "$s" | grep -v "^$" | tail -n 1)" = "data: [DONE]" ] || fail "stream does not end with [DONE]: $s"
  streamed=$(echo "$s" | python3 -c '
import json, sys
out = ""
for line in sys.stdin:
    if line.startswith("data: {"):
        d = json.loads(line[6:])["choices"][0]["delta"]
        out += d.get("content", "")
print(out, end="")')
  [ "$streamed" = "$text" ] || fail "streamed$extra '$streamed' != '$text'"
  echo "$s" | grep -q '"object":"chat.completion.chunk"' || fail "chunk object: $s"
done
api=$(curl -sS "$base/openapi.json")
echo "$api" | grep -q '/v1/chat/completions' || fail "openapi"

expect_400 '{"messages":[]}' messages /v1/chat/completions
expect_400 '{"messages":"hi"}' messages /v1/chat/completions
expect_400 '{"messages":[{"role":"robot","content":"x"}]}' messages /v1/chat/completions
expect_400 '{"messages":[{"role":"user","content":5}]}' messages /v1/chat/completions
expect_400 '{"messages":[{"role":"user","content":"x"}],"max_tokens":"many"}' max_tokens /v1/chat/completions
expect_400 '{"messages":[{"role":"user","content":"x"}],"max_tokens":16,"block_length":5}' block_length /v1/chat/completions
expect_400 '{"messages":[{"role":"user","content":"x"}],"max_tokens":16,"block_length":8,"steps":3}' steps /v1/chat/completions
expect_400 '{"messages":[{"role":"user","content":"x"}],"cache":"anchor"}' cache /v1/chat/completions
expect_400 '{"messages":[{"role":"user","content":"x"}],"remask":"entropy"}' remask /v1/chat/completions
expect_400 '{"messages":[{"role":"user","content":"x"}],"temperature":9}' temperature /v1/chat/completions
expect_400 '{"messages":[{"role":"user","content":"x"}],"max_tokens":1000}' max_tokens /v1/chat/completions
# Still serving, and the same request gives the same answer (no state left over from the others).
r2=$(curl -sS "$base/v1/chat/completions" -H 'Content-Type: application/json' -d "$req}")
t2=$(echo "$r2" | python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["message"]["content"], end="")')
[ "$t2" = "$text" ] || fail "the repeated request answered '$t2', not '$text'"
stop_server "$SERVER_PID" || fail "server exit status $?"
trap - EXIT
echo "dlm chat serve: ok"
