#!/usr/bin/env python3
"""Pools `anchor-sd eval-cache` reports of the same modes run on disjoint seeds.

    tests/bench/pool_eval_reports.py OUT1/cache_eval.json OUT2/cache_eval.json ...

Per cell (sampler, steps) and cache mode: every image's PSNR together (mean, worst, share >= 30 dB), full steps per
image, the speed-up as the first mode's summed denoising time over the mode's, and the verdict against DeepCache at
the same speed-up computed as anchor-sd's against_deepcache() does (its frontier in each measure, linear between the
two configurations that bracket the speed-up). A mode counts only where every report holding the cell measured it,
so each row pools the same images; a cell without DeepCache in every report gets no verdict.
"""
import json
import sys


def frontier(points):
    """(speed-up, value) points no other is at least as fast and as good as; of two alike, the later one stays."""
    pts = sorted(points, key=lambda a: a[0])
    return [a for i, a in enumerate(pts)
            if not any(j != i and b[0] >= a[0] and b[1] >= a[1] and (b[0] > a[0] or b[1] > a[1] or j > i)
                       for j, b in enumerate(pts))]


def curve_at(fr, s):
    if s <= fr[0][0]:
        return fr[0][1]
    for a, b in zip(fr, fr[1:]):
        if s <= b[0]:
            return a[1] + (s - a[0]) / (b[0] - a[0]) * (b[1] - a[1])
    return fr[-1][1]


def pool(paths):
    cells, present = {}, {}
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        for c in report["cells"]:
            key = (c["sampler"], c["steps"])
            present.setdefault(key, []).append({m["mode"] for m in c["modes"]})
            first = c["modes"][0]["wall_s"]
            for m in c["modes"]:
                d = cells.setdefault(key, {}).setdefault(m["mode"], {"psnr": [], "wall": 0.0, "first": 0.0, "full": 0.0})
                d["psnr"] += [float(x) for x in m["psnr_per_image_db"]]
                d["wall"] += m["wall_s"]
                d["first"] += first
                d["full"] += m["full_steps"]
    for key, sets in present.items():
        common = set.intersection(*sets)
        cells[key] = {name: d for name, d in cells[key].items() if name in common}
    return cells


def main(paths):
    if not paths:
        sys.exit("usage: pool_eval_reports.py REPORT.json [REPORT.json ...]")
    print("%-9s %5s %6s %8s %9s %9s %7s %-28s %s" % ("sampler", "steps", "full", "speed-up", "PSNR mean", "min",
                                                     ">=30dB", "vs DeepCache (mean, worst)", "images  mode"))
    for (sampler, steps), modes in sorted(pool(paths).items()):
        stats = {}
        for name, d in modes.items():
            v = d["psnr"]
            finite = [x for x in v if x != float("inf")]
            stats[name] = (d["first"] / d["wall"], sum(finite) / len(finite) if finite else float("inf"), min(v),
                           sum(x >= 30 for x in v) / len(v), d["full"] / len(v), len(v))
        dc = [s for name, s in stats.items() if name.startswith("deepcache:")]
        for name, (s, mean, worst, share, full, n) in stats.items():
            if name.startswith("deepcache:") or name == "off":
                continue
            verdict = "-"
            if dc:
                speeds = sorted(a[0] for a in dc)
                dm = curve_at(frontier([(a[0], a[1]) for a in dc]), s)
                dw = curve_at(frontier([(a[0], a[2]) for a in dc]), s)
                beats = mean > dm and worst > dw
                verdict = ("open" if s < speeds[0] else "beats") if beats else ("open" if s > speeds[-1] else "loses")
                verdict += " (%+.1f, %+.1f)" % (mean - dm, worst - dw)
            print("%-9s %5d %6.2f %7.2fx %9.2f %9.2f %6.1f%% %-28s %6d  %s" % (
                sampler, steps, full, s, mean, worst, 100 * share, verdict, n, name))


if __name__ == "__main__":
    main(sys.argv[1:])
