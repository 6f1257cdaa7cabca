#!/usr/bin/env python3
"""Every Catch2 TEST_CASE name must survive catch_discover_tests: a name with an unbalanced '[' or ']' ends CMake's
bracket argument early, and the discovery then registers a few mangled tests instead of all of them, silently (ctest
once listed 70 of 411). A name starting with '-' is taken by the test binary as an option when ctest runs it by name,
so that test fails. Usage: check_test_names.py REPO_ROOT; exit 1 naming each bad name."""
import pathlib
import re
import sys

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
name_rx = re.compile(r'TEST_CASE\(\s*"((?:[^"\\]|\\.)*)"')
bad = []
for f in sorted((root / "tests").rglob("*.cpp")):
    for m in name_rx.finditer(f.read_text(errors="replace")):
        name, depth = m.group(1), 0
        for ch in name:
            depth += {"[": 1, "]": -1}.get(ch, 0)
            if depth < 0:
                break
        line = f.read_text(errors="replace")[: m.start()].count("\n") + 1
        if depth != 0:
            bad.append(f"{f.relative_to(root)}:{line}: unbalanced brackets in test name \"{name}\"")
        if name.startswith("-"):
            bad.append(f"{f.relative_to(root)}:{line}: test name starts with '-' (read as an option): \"{name}\"")
for b in bad:
    print(b)
print(f"{'FAIL' if bad else 'PASS'} test names: {len(bad)} bad")
sys.exit(1 if bad else 0)
