#!/usr/bin/env bash
# Two anchor-sd serve replicas behind nginx with assets/deploy/nginx-anchor-sd.conf (ports replaced by free ones):
# requests are spread over both and all succeed, and stopping one replica (SIGTERM: it drains) while requests are in
# flight loses none (nginx retries them on the other). Exit 77 (skip) without nginx.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
build="$(cd "${1:-$root/build}" && pwd)"
source "$here/lib.sh"
nginx_bin=$(command -v nginx || echo /usr/sbin/nginx)
[ -x "$nginx_bin" ] || { echo "SKIP: nginx not installed (apt-get install nginx)"; exit 77; }
work="$build/tests/serve/nginx"
rm -rf "$work"; mkdir -p "$work/nginx_tmp"
cd "$root"
start_server "$work/replica1.log" "$build/anchor-sd" serve --no-web; pid1=$SERVER_PID; port1=$PORT
start_server "$work/replica2.log" "$build/anchor-sd" serve --no-web; pid2=$SERVER_PID; port2=$PORT
front=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
sed -e "s/127.0.0.1:7861/127.0.0.1:$port1/; s/127.0.0.1:7862/127.0.0.1:$port2/; s/127.0.0.1:7860/127.0.0.1:$front/" \
  "$root/assets/deploy/nginx-anchor-sd.conf" > "$work/nginx.conf"
[ "$(id -u)" = 0 ] && sed -i '1i user root;' "$work/nginx.conf"
"$nginx_bin" -p "$work" -c "$work/nginx.conf" -g 'daemon off;' 2>"$work/nginx.log" &
nginx_pid=$!
trap 'kill -9 $pid1 $pid2 2>/dev/null || true; kill $nginx_pid 2>/dev/null || true' EXIT
for _ in $(seq 1 100); do curl -s -o /dev/null "http://127.0.0.1:$front/health" && break; sleep 0.1; done

req() { # seed -> "HTTP_CODE UPSTREAM"
  curl -sS -o /dev/null -w '%{http_code} %header{x-upstream}\n' "http://127.0.0.1:$front/sdapi/v1/txt2img" \
    -H 'Content-Type: application/json' -d "{\"prompt\":\"a coat\",\"steps\":${2:-2},\"seed\":$1,\"sampler_name\":\"DDIM\"}"
}
: > "$work/spread.txt"
for s in $(seq 1 8); do req "$s" >> "$work/spread.txt"; done
[ "$(grep -c '^200 ' "$work/spread.txt")" = 8 ] || fail "not all 200: $(cat "$work/spread.txt")"
n1=$(grep -c "POST /sdapi/v1/txt2img 200" "$work/replica1.log" || true)
n2=$(grep -c "POST /sdapi/v1/txt2img 200" "$work/replica2.log" || true)
[ "$n1" -ge 2 ] && [ "$n2" -ge 2 ] || fail "requests not spread: replica1 $n1, replica2 $n2"
echo "spread: replica1 $n1, replica2 $n2 of 8"

# 12 requests in flight from 4 clients; replica 1 gets SIGTERM in the middle.
: > "$work/failover.txt"
for c in 1 2 3 4; do (for s in 1 2 3; do req "$((100 * c + s))" 12 >> "$work/failover.txt"; done) & done
sleep 1
kill -TERM "$pid1"
wait_clients() { for j in $(jobs -p); do [ "$j" = "$nginx_pid" ] || [ "$j" = "$pid1" ] || [ "$j" = "$pid2" ] || wait "$j"; done; }
wait_clients
rc1=0; wait "$pid1" || rc1=$?
[ "$rc1" = 0 ] || fail "replica 1 did not drain and exit 0 (rc $rc1)"
ok=$(grep -c '^200 ' "$work/failover.txt" || true)
[ "$ok" = 12 ] || fail "lost requests while replica 1 stopped: $(cat "$work/failover.txt")"
after=$(grep -c "POST /sdapi/v1/txt2img 200" "$work/replica2.log")
echo "failover: 12/12 answered 200; replica 2 served $((after - n2)) of them, replica 1 drained and exited 0"
stop_server "$pid2" || fail "replica 2 did not exit 0"
kill "$nginx_pid" 2>/dev/null || true
trap - EXIT
echo "nginx: ok"
