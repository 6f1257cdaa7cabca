#!/usr/bin/env bash
# The compare page at / in headless chromium (tests/serve/browser_page.mjs) against anchor-sd serve on the embedded
# demo model; the screenshot goes to BUILD_DIR/tests/serve/compare_page.png. Exit 77 (skip) without chromium or node.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
build="$(cd "${1:-$root/build}" && pwd)"
source "$here/lib.sh"
command -v chromium >/dev/null || { echo "SKIP: chromium not installed (apt-get install chromium)"; exit 77; }
command -v node >/dev/null || { echo "SKIP: node not installed"; exit 77; }
work="$build/tests/serve"
mkdir -p "$work"
cd "$root"
start_server "$work/browser_serve.log" "$build/anchor-sd" serve
trap 'kill -9 $SERVER_PID 2>/dev/null || true' EXIT
node --experimental-websocket --no-warnings "$here/browser_page.mjs" "http://127.0.0.1:$PORT" "$work/compare_page.png"
stop_server "$SERVER_PID" || fail "the server did not exit 0 after SIGTERM"
# The log is whole once the server is gone (a request's line is written after its reply).
grep -q 'GET / 200' "$work/browser_serve.log" || fail "the page was not served"
grep -q 'POST /anchor/v1/compare 200' "$work/browser_serve.log" || fail "no compare request"
trap - EXIT
