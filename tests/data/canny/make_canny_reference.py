# Reference edges for --control-preprocess canny: Debian's python3-opencv 4.6 (the OpenCV the C++ build links),
# cv2.Canny(img, low, high) on an RGB uint8 image exactly as sd-webui-controlnet's canny annotator calls it.
# Writes input.png (a 40x56 RGB test pattern: shapes, a gradient, seeded noise) and edges_<low>_<high>.png.
# Run: /usr/bin/python3 tests/data/canny/make_canny_reference.py tests/data/canny
import sys
import cv2
import numpy as np

out = sys.argv[1]
rng = np.random.default_rng(61)
img = np.zeros((40, 56, 3), np.uint8)
img[:, :, 0] = np.linspace(0, 255, 56, dtype=np.uint8)[None, :]
cv2.rectangle(img, (5, 6), (22, 30), (200, 40, 90), -1)
cv2.circle(img, (40, 20), 10, (30, 220, 120), -1)
cv2.line(img, (0, 38), (55, 2), (250, 250, 250), 2)
img = np.clip(img.astype(np.int16) + rng.integers(-12, 13, img.shape), 0, 255).astype(np.uint8)
cv2.imwrite(out + '/input.png', cv2.cvtColor(img, cv2.COLOR_RGB2BGR))
for lo, hi in [(100, 200), (50, 120)]:
    cv2.imwrite(f'{out}/edges_{lo}_{hi}.png', cv2.Canny(img, lo, hi))
