"""Writes torch_float8.json: the value of every byte as torch's float8_e4m3fn and float8_e5m2 (the dtypes of
safetensors' F8_E4M3 / F8_E5M2), as float32, NaN as null; tests/test_sd3_single_file_te.cpp checks the engine's
decoding table against it.

usage: python make_float8_table.py OUT.json   (torch >= 2.1, e.g. /opt/anchor-torch2/bin/python)
"""
import json
import math
import sys

import torch

bytes_ = torch.arange(256, dtype=torch.uint8)
out = {"torch_version": torch.__version__}
for name, dt in (("F8_E4M3", torch.float8_e4m3fn), ("F8_E5M2", torch.float8_e5m2)):
    vals = bytes_.view(dt).to(torch.float32).tolist()
    out[name] = [None if math.isnan(v) else (("inf" if v > 0 else "-inf") if math.isinf(v) else v) for v in vals]
json.dump(out, open(sys.argv[1], "w"), indent=0)
