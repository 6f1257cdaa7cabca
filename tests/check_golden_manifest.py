#!/usr/bin/env python3
"""golden_runner and manifest.json: a reference file that differs from its manifest entry FAILs naming it; a README
that differs (prose edited after the manifest was written) is said on stderr and fails nothing.

usage: check_golden_manifest.py GOLDEN_RUNNER"""
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def entry(path: Path, name: str, sha: str = "") -> dict:
    data = path.read_bytes()
    return {"path": name, "bytes": len(data), "sha256": sha or hashlib.sha256(data).hexdigest()}


def run(runner: str, root: Path):
    p = subprocess.run([runner, str(root)], capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout + p.stderr


def main() -> int:
    runner = sys.argv[1]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "notes.json").write_text(json.dumps({"a": 1}))
        (root / "README.md").write_text("# cases\n")
        good = [entry(root / "notes.json", "notes.json"), entry(root / "README.md", "README.md")]
        (root / "manifest.json").write_text(json.dumps({"files": good}))
        rc, out = run(runner, root)
        if rc != 0:
            failures.append(f"all files as listed: exit {rc}\n{out}")
        (root / "README.md").write_text("# cases, edited after the manifest\n")
        rc, out = run(runner, root)
        if rc != 0 or "README.md differs from the manifest" not in out:
            failures.append(f"an edited README: expected exit 0 and a note, got exit {rc}\n{out}")
        (root / "notes.json").write_text(json.dumps({"a": 2}))
        rc, out = run(runner, root)
        if rc == 0 or "sha256 of" not in out or "notes.json" not in out:
            failures.append(f"an edited reference file: expected a FAIL naming it, got exit {rc}\n{out}")
    for f in failures:
        print("FAIL:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
