#!/usr/bin/env python3
"""Load test of `anchor-sd serve` on loopback: C concurrent clients x N txt2img requests each on the embedded demo
model (bounded count and time). Every request must be answered 200 with one image (none lost, none refused: the queue
holds every client's request), and the report says p50/p99 latency, throughput and the server's RSS growth from after
the warm-up to the end. Usage: load_test.py ANCHOR_SD OUT.txt [--clients 8] [--requests 50] [--steps 2]"""
import argparse, json, os, re, signal, subprocess, sys, tempfile, threading, time, urllib.request

ap = argparse.ArgumentParser()
ap.add_argument("program")
ap.add_argument("out")
ap.add_argument("--clients", type=int, default=8)
ap.add_argument("--requests", type=int, default=50)
ap.add_argument("--steps", type=int, default=2)
ap.add_argument("--cache", default="deepcache:2")
ap.add_argument("--time-limit", type=float, default=240)
a = ap.parse_args()

log_path = os.path.join(tempfile.mkdtemp(prefix="anchor-load-"), "server.log")
env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
log = open(log_path, "w")
srv = subprocess.Popen([a.program, "serve", "--host", "127.0.0.1", "--port", "0", "--queue", str(a.clients + 1),
                        "--no-web"], stdout=log, stderr=log, env=env)
port = None
for _ in range(1200):
    m = re.search(r"listening on http://[^:]+:(\d+)", open(log_path).read())
    if m:
        port = int(m.group(1))
        break
    if srv.poll() is not None:
        sys.exit("server exited:\n" + open(log_path).read())
    time.sleep(0.1)
if port is None:
    sys.exit("server did not start")
base = f"http://127.0.0.1:{port}"


def rss_kib():
    for line in open(f"/proc/{srv.pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return -1


def request(seed):
    body = json.dumps({"prompt": "a dress", "steps": a.steps, "seed": seed, "sampler_name": "DDIM",
                       "cache": a.cache}).encode()
    req = urllib.request.Request(base + "/sdapi/v1/txt2img", data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as r:
        status, reply = r.status, json.loads(r.read())
    return status, len(reply.get("images", [])), time.perf_counter() - t0


for s in range(3):  # warm-up: allocator pools, the first runs' one-time work
    request(s)
rss0 = rss_kib()
lat, errors = [], []
lock = threading.Lock()
stop_at = time.monotonic() + a.time_limit


def client(k):
    for i in range(a.requests):
        if time.monotonic() > stop_at:
            with lock:
                errors.append(f"client {k}: time limit before request {i}")
            return
        try:
            status, n, dt = request(1000 * k + i)
            with lock:
                if status == 200 and n == 1:
                    lat.append(dt)
                else:
                    errors.append(f"client {k} request {i}: HTTP {status}, {n} images")
        except Exception as e:  # a refused or lost request
            with lock:
                errors.append(f"client {k} request {i}: {e}")


t0 = time.perf_counter()
threads = [threading.Thread(target=client, args=(k,)) for k in range(a.clients)]
for t in threads:
    t.start()
for t in threads:
    t.join()
wall = time.perf_counter() - t0
rss1 = rss_kib()
srv.send_signal(signal.SIGTERM)
rc = srv.wait(timeout=60)
lat.sort()
pct = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3 if lat else float("nan")
logged = sum(1 for l in open(log_path) if "POST /sdapi/v1/txt2img 200" in l)
total = a.clients * a.requests
report = (f"command: tests/serve/load_test.py build/anchor-sd OUT --clients {a.clients} --requests {a.requests} "
          f"--steps {a.steps} --cache {a.cache}\n"
          f"anchor-sd serve load test: {a.clients} clients x {a.requests} requests, txt2img {a.steps} steps DDIM "
          f"cache {a.cache}, embedded demo model (32x32), loopback, OMP_NUM_THREADS=1, {os.cpu_count()} CPUs\n"
          f"answered 200: {len(lat)}/{total}; errors: {len(errors)}; request log lines (200): {logged} (3 warm-up)\n"
          f"latency p50 {pct(0.50):.1f} ms, p99 {pct(0.99):.1f} ms, max {lat[-1] * 1e3 if lat else 0:.1f} ms; "
          f"wall {wall:.1f} s, {len(lat) / wall:.1f} requests/s\n"
          f"server RSS after warm-up {rss0 / 1024:.1f} MiB, after the load {rss1 / 1024:.1f} MiB "
          f"(growth {100.0 * (rss1 - rss0) / rss0:.2f} %); server exit after SIGTERM: {rc}\n")
for e in errors[:10]:
    report += "error: " + e + "\n"
open(a.out, "w").write(report)
print(report, end="")
sys.exit(0 if len(lat) == total and not errors and rc == 0 and logged == total + 3 else 1)
