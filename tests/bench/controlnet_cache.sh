#!/bin/bash
# PSNR of deepcache:3 and freq against off on fashion-sd, with and without a random ControlNet (DDIM 20 steps, cfg 5).
out=${OUT:-/tmp/controlnet_cache}; mkdir -p $out; cd "$(dirname "$0")/../.."
for prompt in "a photo of a t-shirt" "a sneaker" "a picture of a dress" "a bag"; do
  for seed in 1 2; do
    tag=$(echo "$prompt" | tr ' ' '_')_$seed
    for cn in no yes; do
      extra=(); [ $cn = yes ] && extra=(--control-net /tmp/fashion_cn --control-image /tmp/fashion_edges.png)
      build/anchor-sd -p "$prompt" -s $seed --steps 20 --sampler ddim --cfg-scale 5 -W 32 -H 32 --threads 1 \
        --compare off,deepcache:3,freq -o $out/${tag}_$cn.png --overwrite "${extra[@]}" >/dev/null 2>&1 || echo FAIL $tag $cn
      python3 -c "
import json,sys; r=json.load(open('$out/${tag}_${cn}_report.json'))
print('$cn', '$tag', ' '.join('%s=%s/%.2fx/%s' % (m['mode'], (round(m['psnr_vs_first_db'],2) if m['psnr_vs_first_db'] is not None else 'inf'), m['speedup_vs_first'], m['full_steps']) for m in r['modes'][1:]))"
    done
  done
done
