"""Summarises an eval-cache report of the DiT grid: per mode the full steps per image, the full-step speed-up
(steps / full: the proxy for the speed-up on a noisy machine), the cost-weighted speed-up steps / (full + reuse x
c) with c = the mode's reuse-step time over its full-step time in the same run (freq and fbcache run the first block
at a reuse step, teacache and taylorseer no block), the eval's wall speed-up, PSNR mean / worst / 5th
percentile / share >= 30 dB; then each kind's frontier and, for every freq point, the other kinds' mean and worst PSNR
at the same full-step speed-up (linear between the two points of their frontier that bracket it).

usage: python3 summarize.py grid/cache_eval.json
"""
import json
import math
import sys


def num(v):
    return float("inf") if v == "inf" else float(v)


def main(path):
    rep = json.load(open(path))
    cell = rep["cells"][0]
    steps, runs = cell["steps"], cell["runs"]
    rows = []
    for m in cell["modes"]:
        full = m["full_steps"] / runs
        ps = sorted(num(v) for v in m["psnr_per_image_db"])
        p5 = ps[max(0, math.ceil(0.05 * len(ps)) - 1)]
        c = m["reuse_step_ms"] / m["full_step_ms"] if m["reuse_step_ms"] > 0 else 0.0
        rows.append(dict(mode=m["mode"], kind=m["mode"].split(":")[0], full=full, proxy=steps / full,
                         cost=steps / (full + (steps - full) * c),
                         wall=m["speedup_vs_first"], mean=num(m["psnr_db"]), worst=num(m["psnr_min_db"]), p5=p5,
                         share=m["share_psnr_30db"], adh=m["classifier_adherence"]))
    print(f"{'mode':28s} {'full/img':>8s} {'steps/full':>10s} {'cost x':>7s} {'wall x':>7s} {'mean dB':>8s} {'worst':>7s} "
          f"{'p5':>7s} {'>=30dB':>7s} {'adherence':>9s}")
    for r in rows:
        print(f"{r['mode']:28s} {r['full']:8.2f} {r['proxy']:9.2f}x {r['cost']:6.2f}x {r['wall']:6.2f}x {r['mean']:8.2f} "
              f"{r['worst']:7.2f} {r['p5']:7.2f} {100 * r['share']:6.1f}% {100 * r['adh']:8.1f}%")

    def frontier(kind, key, x):
        pts = sorted((r[x], r[key]) for r in rows if r["kind"] == kind and math.isfinite(r[key]))
        return [p for p in pts if not any(q[0] >= p[0] and q[1] > p[1] for q in pts if q != p)]

    def at(pts, s):
        if not pts:
            return None
        if s <= pts[0][0]:
            return pts[0][1]
        for (a, va), (b, vb) in zip(pts, pts[1:]):
            if s <= b:
                return va + (s - a) / (b - a) * (vb - va)
        return None  # faster than every point of that kind: not in the grid

    for x, what in (("proxy", "full-step"), ("cost", "cost-weighted")):
        print(f"\nfreq against the others at the same {what} speed-up, mean/worst dB (their frontier, linear "
              "between points; - = none of that kind is that fast)")
        for r in rows:
            if r["kind"] != "freq":
                continue
            parts = []
            for k in ("fbcache", "teacache", "taylorseer"):
                m, w = at(frontier(k, "mean", x), r[x]), at(frontier(k, "worst", x), r[x])
                parts.append(f"{k} " + ("-" if m is None else f"{m:.2f}/{w:.2f}"))
            print(f"{r['mode']:16s} {r[x]:5.2f}x freq {r['mean']:.2f}/{r['worst']:.2f}  vs  " + ", ".join(parts))


if __name__ == "__main__":
    main(sys.argv[1])
