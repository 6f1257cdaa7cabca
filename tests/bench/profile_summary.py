#!/usr/bin/env python3
"""Summarise a chrome trace written by `anchor-sd bench --profile FILE`: self time per aten op (ms and %).

Self time = an event's duration minus the durations of the events nested directly inside it on the same thread,
so aten::conv2d -> aten::convolution -> aten::mkldnn_convolution is charged to the innermost op doing the work.
"""
import collections
import json
import sys


def main(path, top=25):
    with open(path) as f:
        text = f.read()
    try:
        events = json.loads(text)
    except json.JSONDecodeError:  # the legacy profiler may leave a trailing comma / unterminated list
        events = json.loads(text.rstrip().rstrip(",") + "]")
    if isinstance(events, dict):
        events = events.get("traceEvents", [])
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    by_thread = collections.defaultdict(list)
    for e in spans:
        by_thread[e.get("tid")].append(e)
    self_t = collections.Counter()
    count = collections.Counter()
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in evs:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                stack[-1]["_child"] = stack[-1].get("_child", 0) + e["dur"]
            stack.append(e)
        for e in evs:
            self_t[e["name"]] += e["dur"] - e.get("_child", 0)
            count[e["name"]] += 1
    total = sum(self_t.values())
    print(f"total self time {total / 1e3:.1f} ms over {len(spans)} events")
    for name, t in self_t.most_common(top):
        print(f"{t / 1e3:10.1f} ms {100 * t / total:6.1f} %  {count[name]:6d}x  {name}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 25)
