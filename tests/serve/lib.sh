# Shared by the serve test scripts: start a server on a free loopback port, wait for its startup line, stop it.
# start_server LOG PROGRAM ARGS...: sets SERVER_PID and PORT.
start_server() {
  local log="$1"; shift
  OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE "$@" --host 127.0.0.1 --port 0 >"$log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 1200); do
    PORT=$(sed -n 's/.*listening on http:\/\/[^:]*:\([0-9]*\).*/\1/p' "$log" | head -1)
    [ -n "$PORT" ] && return 0
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "server exited before listening:"; cat "$log"; return 1; }
    sleep 0.1
  done
  echo "server did not listen within 120 s"; cat "$log"; return 1
}
# stop_server PID: SIGTERM (a drain), then the exit status.
stop_server() {
  kill -TERM "$1" 2>/dev/null || true
  local rc=0
  wait "$1" || rc=$?
  return $rc
}
fail() { echo "FAIL: $*"; exit 1; }
# expect_400 BODY FIELD PATH: POST BODY to $base$PATH answers 400 whose one-line JSON names FIELD as its param.
expect_400() {
  local body="$1" field="$2" out code
  out=$(curl -sS -w '\n%{http_code}' "$base$3" -H 'Content-Type: application/json' -d "$body")
  code=$(echo "$out" | tail -1)
  [ "$code" = 400 ] || fail "$body: HTTP $code: $out"
  echo "$out" | head -1 | grep -q "\"param\":\"$field\"" || fail "$body: no param $field: $out"
}
