#!/usr/bin/env python3
"""Per cell and mode of anchor-sd eval-cache reports: full steps per image, speed-up (the report's: off's denoising
time over the mode's), mean / 5th-percentile / worst PSNR (an identical image counts as 99 dB), shares >= 30/35/40 dB."""
import json,sys,math
for path in sys.argv[1:]:
    d=json.load(open(path))
    for c in d['cells']:
        for m in c['modes']:
            p=sorted(99.0 if (x is None or isinstance(x,str)) else min(float(x),99.0) for x in m["psnr_per_image_db"]); n=len(p)
            p=[min(x,99) for x in p]
            p5=p[int(0.05*n)] if n else 0
            mean=sum(p)/n
            print(f"{c['sampler']:9s}{c['steps']:3d} {m['mode'][:70]:70s} full {m['full_steps']/n:5.2f} spd {m['speedup_vs_first']:5.2f} mean {mean:6.2f} p5 {p5:6.2f} min {p[0]:6.2f} >=30 {sum(x>=30 for x in p)/n*100:5.1f} >=35 {sum(x>=35 for x in p)/n*100:5.1f} >=40 {sum(x>=40 for x in p)/n*100:5.1f}")
