#!/usr/bin/env python3
"""Property-based fuzz of both servers against their own OpenAPI descriptions (GET /openapi.json), with PyPI's
schemathesis, on loopback only.

Each server runs on the embedded demo models with small request bounds so a generated job is short; schemathesis
sends a fixed budget of generated requests to every operation (one at a time, fixed seed) and this script asserts:
  - no reply is a 5xx (schemathesis' not_a_server_error check) and none takes longer than the request deadline;
  - GET /health answers within HEALTH_DEADLINE_S throughout (polled from another thread);
  - the server's RSS is flat: after the first third of the run it grows by at most RSS_SLACK_MB.

schemathesis lives in a virtual environment outside the checkout (ANCHOR_PY, default /opt/anchor-py); when it is not
there the script installs it, and exits 77 (CTest's skip) with a message only when PyPI cannot be reached.

usage: openapi_fuzz.py BUILD_DIR SOURCE_DIR [--examples N]
"""
import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ANCHOR_PY = os.environ.get("ANCHOR_PY", "/opt/anchor-py")
HEALTH_DEADLINE_S = 1.0
REQUEST_DEADLINE_S = 60
RSS_SLACK_MB = 64
SKIP = 77


def schemathesis_bin():
    exe = os.path.join(ANCHOR_PY, "bin", "schemathesis")
    if os.path.exists(exe):
        return exe
    print(f"openapi_fuzz: installing schemathesis into {ANCHOR_PY}", flush=True)
    try:
        if not os.path.exists(os.path.join(ANCHOR_PY, "bin", "pip")):
            subprocess.run([sys.executable, "-m", "venv", ANCHOR_PY], check=True)
        r = subprocess.run([os.path.join(ANCHOR_PY, "bin", "pip"), "install", "-q", "schemathesis"],
                           capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as e:
        print(f"openapi_fuzz: SKIP: cannot install schemathesis ({e})")
        sys.exit(SKIP)
    if r.returncode != 0 or not os.path.exists(exe):
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["?"]
        print(f"openapi_fuzz: SKIP: PyPI unreachable, schemathesis not installed ({tail[0]})")
        sys.exit(SKIP)
    return exe


def rss_mb(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


class Server:
    def __init__(self, argv, name):
        self.log = tempfile.NamedTemporaryFile(prefix=f"fuzz_{name}_", suffix=".log", delete=False)
        env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.name = name
        t0 = time.time()
        while time.time() - t0 < 180:
            m = re.search(r"listening on http://[^:]+:(\d+)", open(self.log.name).read())
            if m:
                self.url = f"http://127.0.0.1:{m.group(1)}"
                return
            if self.proc.poll() is not None:
                raise SystemExit(f"openapi_fuzz: {name} exited before listening:\n" + open(self.log.name).read())
            time.sleep(0.1)
        raise SystemExit(f"openapi_fuzz: {name} did not listen in 180 s")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


class Watch(threading.Thread):
    """Polls /health and the RSS while the fuzz runs."""

    def __init__(self, server):
        super().__init__(daemon=True)
        self.server, self.stop_flag = server, threading.Event()
        self.health_worst, self.health_failures, self.rss = 0.0, [], []

    def run(self):
        while not self.stop_flag.is_set():
            t0 = time.time()
            try:
                with urllib.request.urlopen(self.server.url + "/health", timeout=10) as r:
                    ok = r.status == 200
            except Exception as e:  # noqa: BLE001 - any failure is reported
                ok, r = False, e
            dt = time.time() - t0
            self.health_worst = max(self.health_worst, dt)
            if not ok or dt > HEALTH_DEADLINE_S:
                self.health_failures.append(f"/health: {'%.2f' % dt}s ({r})")
            self.rss.append((time.time(), rss_mb(self.server.proc.pid)))
            self.stop_flag.wait(0.25)


def fuzz(exe, server, examples, seed):
    watch = Watch(server)
    watch.start()
    cmd = [exe, "run", server.url + "/openapi.json", "--checks", "not_a_server_error", "--max-examples",
           str(examples), "--seed", str(seed), "--workers", "1", "--request-timeout", str(REQUEST_DEADLINE_S),
           "--generation-database", "none", "--no-color", "--phases", "examples,coverage,fuzzing", "--url", server.url]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, NO_PROXY="127.0.0.1"))
    watch.stop_flag.set()
    watch.join()
    problems = []
    if r.returncode != 0:
        problems.append(f"schemathesis exit {r.returncode}:\n{r.stdout[-6000:]}\n{r.stderr[-2000:]}")
    problems += watch.health_failures[:5]
    rss = [m for _, m in watch.rss if m is not None]
    if len(rss) >= 6:
        base = max(rss[: len(rss) // 3])
        if max(rss) - base > RSS_SLACK_MB:
            problems.append(f"RSS grew from {base:.0f} MB to {max(rss):.0f} MB")
    summary = (f"{server.name}: {time.time() - t0:.0f}s, /health worst {watch.health_worst:.2f}s, "
               f"RSS {min(rss or [0]):.0f}-{max(rss or [0]):.0f} MB")
    print(summary, flush=True)
    if os.environ.get("FUZZ_VERBOSE"):
        print(r.stdout)
    last = [ln for ln in r.stdout.splitlines() if ln.strip()][-3:]
    print("  " + "\n  ".join(last), flush=True)
    return problems


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("source")
    ap.add_argument("--examples", type=int, default=8)
    ap.add_argument("--seed", type=int, default=56)
    ap.add_argument("--only", choices=["sd", "text"])
    a = ap.parse_args()
    exe = schemathesis_bin()
    os.chdir(a.source)
    servers = []
    if a.only in (None, "sd"):
        servers.append(([os.path.join(a.build, "anchor-sd"), "serve", "--port", "0", "--no-web", "--queue", "2",
                         "--max-steps", "2", "--max-pixels", "4096", "--max-images", "2", "--max-modes", "2"], "sd"))
    if a.only in (None, "text"):
        servers.append(([os.path.join(a.build, "anchor-text"), "serve", "--port", "0", "--queue", "2", "--max-tokens",
                         "8", "--max-prompt", "256", "--max-length", "48", "--max-steps", "4"], "text"))
    problems = []
    for argv, name in servers:
        s = Server(argv, name)
        try:
            problems += [f"{name}: {p}" for p in fuzz(exe, s, a.examples, a.seed)]
        finally:
            rc = s.stop()
            if rc != 0:
                problems.append(f"{name}: exit {rc} after SIGTERM; log {s.log.name}")
    if problems:
        print("FAIL\n" + "\n".join(problems))
        return 1
    print("ok: no 5xx, no reply past the deadline, /health answering, RSS flat")
    return 0


if __name__ == "__main__":
    sys.exit(main())
