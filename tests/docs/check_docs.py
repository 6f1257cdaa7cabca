#!/usr/bin/env python3
"""Checks the documentation against the tree (a CTest test):

1. README.md routes: at most 250 lines.
2. Every relative link in README.md, docs/*.md and tests/bench/results/README.md resolves to a file or folder of the
   checkout, and a `#fragment` to a heading of the target page (GitHub's slug rule).
3. No code comment carries a date or a measured figure (dB, a speed-up such as "2.5x"/"2.5×", a percentage of a
   rate): those belong in commit messages and tests/bench/results/. Code comments say why and cite the source.

Usage: check_docs.py [ROOT]; prints one line per problem and `N passed, N failed`.
"""
import os
import re
import sys

ROOT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", ".."))
CODE_EXT = (".cpp", ".h", ".hpp", ".cu", ".cuh", ".inc", ".sh", ".py", ".mjs", ".js", ".cmake", ".in")
SKIP_DIRS = {".git", "build", "out", "node_modules", "__pycache__", "golden", "results", "corpus", "crashes", "models"}

problems = {"readme": [], "links": [], "comments": []}


def slug(heading):
    s = heading.strip().lower()
    s = re.sub(r"[`*_~]", "", s)
    s = re.sub(r"[^\w\- ]", "", s, flags=re.UNICODE)
    return s.replace(" ", "-")


def anchors(path):
    out, in_code = set(), False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("```"):
                in_code = not in_code
            elif not in_code and line.startswith("#"):
                out.add(slug(line.lstrip("#")))
    return out


def check_links(md):
    text = open(md, encoding="utf-8").read()
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # links inside code blocks are examples
    for m in re.finditer(r"\[[^\]]*\]\(([^)\s]+)\)", text):
        target = m.group(1)
        if re.match(r"^[a-z]+://|^mailto:", target):
            continue
        path, _, frag = target.partition("#")
        full = os.path.normpath(os.path.join(os.path.dirname(md), path)) if path else md
        rel = os.path.relpath(md, ROOT)
        if not os.path.exists(full):
            problems["links"].append(f"{rel}: link '{target}' -> {os.path.relpath(full, ROOT)} does not exist")
        elif frag and full.endswith(".md") and slug(frag) not in anchors(full):
            problems["links"].append(f"{rel}: link '{target}': no heading '#{frag}' in {os.path.relpath(full, ROOT)}")


DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
# A measured figure: decimal decibels, a decimal speed-up ("2.37x", "1.8×"), or "N× faster/slower". Integer thresholds
# such as ">= 30 dB" are definitions, not measurements; tests/ describe their hand-computed inputs in such numbers.
FIGURE = re.compile(r"\b\d+\.\d+\s?dB\b|\b\d+\.\d+(x|×)(?![\w.])|\b\d+(\.\d+)?\s?(x|×) (faster|slower)\b")


def comment_of(line, ext):
    s = line.strip()
    if ext in (".sh", ".py", ".cmake", ".in") or os.path.basename(ext) == "CMakeLists.txt":
        if s.startswith("#") and not s.startswith("#!"):
            return s
        i = line.find(" # ")
        return line[i:] if i >= 0 else ""
    if s.startswith("//") or s.startswith("*") or s.startswith("/*"):
        return s
    i = line.find("// ")
    return line[i:] if i >= 0 and line.count('"', 0, i) % 2 == 0 else ""


def check_comments():
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith("build")]
        for name in filenames:
            ext = os.path.splitext(name)[1]
            if not (name.endswith(CODE_EXT) or name == "CMakeLists.txt"):
                continue
            path = os.path.join(dirpath, name)
            if os.path.samefile(path, __file__):
                continue
            try:
                lines = open(path, encoding="utf-8").read().splitlines()
            except (UnicodeDecodeError, OSError):
                continue
            for no, line in enumerate(lines, 1):
                c = comment_of(line, "CMakeLists.txt" if name == "CMakeLists.txt" else ext)
                if not c:
                    continue
                in_tests = os.path.relpath(path, ROOT).startswith("tests" + os.sep)
                m = DATE.search(c) or (None if in_tests else FIGURE.search(c))
                if m:
                    problems["comments"].append(f"{os.path.relpath(path, ROOT)}:{no}: comment carries "
                                                f"'{m.group(0)}': {c.strip()[:100]}")


readme = os.path.join(ROOT, "README.md")
n = sum(1 for _ in open(readme, encoding="utf-8"))
if n > 250:
    problems["readme"].append(f"README.md has {n} lines, at most 250 (move depth to docs/)")
pages = [readme, os.path.join(ROOT, "tests", "bench", "results", "README.md")]
docs = os.path.join(ROOT, "docs")
pages += [os.path.join(docs, f) for f in sorted(os.listdir(docs)) if f.endswith(".md")] if os.path.isdir(docs) else []
for p in pages:
    if not os.path.exists(p):
        problems["links"].append(f"{os.path.relpath(p, ROOT)} does not exist")
    else:
        check_links(p)
check_comments()

passed = failed = 0
for check, found in problems.items():
    for line in found:
        print(f"FAIL {check}: {line}")
    if found:
        failed += 1
    else:
        print(f"PASS {check}")
        passed += 1
print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
