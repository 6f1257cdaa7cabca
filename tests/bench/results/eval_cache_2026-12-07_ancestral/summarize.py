#!/usr/bin/env python3
"""Per cell and mode of anchor-sd eval-cache reports (cache_eval.json): full steps per image, the full-step speed
proxy (steps / full steps per image), the eval's wall-time speed-up, mean PSNR (identical images left out, as the
eval's table), 5th-percentile and worst image (identical = 99 dB there), shares >= 30 / 35 / 40 dB.
Several reports of the same cell and mode (e.g. one per seed) are pooled: summarize.py A.json B.json ..."""
import json, sys
from collections import OrderedDict

pool = OrderedDict()
for path in sys.argv[1:]:
    d = json.load(open(path))
    for c in d['cells']:
        for m in c['modes']:
            k = (c['sampler'], c['steps'], m['mode'])
            e = pool.setdefault(k, {'psnr': [], 'full': 0.0, 'spd': []})
            e['psnr'] += [float('inf') if (x is None or isinstance(x, str)) else float(x) for x in m['psnr_per_image_db']]
            e['full'] += m['full_steps']
            e['spd'].append(m['speedup_vs_first'])
for (sampler, steps, mode), e in pool.items():
    p = sorted(min(x, 99.0) for x in e['psnr'])
    n = len(p)
    finite = [x for x in e['psnr'] if x != float('inf')]
    mean = sum(finite) / len(finite) if finite else float('inf')
    full = e['full'] / n
    print(f"{sampler:9s}{steps:3d} {mode[:64]:64s} n {n:3d} full {full:5.2f} proxy {steps / full:4.2f}x "
          f"wall {sum(e['spd']) / len(e['spd']):4.2f}x mean {mean:6.2f} p5 {p[int(0.05 * n)]:6.2f} min {p[0]:6.2f} "
          f">=30 {sum(x >= 30 for x in p) / n * 100:5.1f} >=35 {sum(x >= 35 for x in p) / n * 100:5.1f} "
          f">=40 {sum(x >= 40 for x in p) / n * 100:5.1f}")
