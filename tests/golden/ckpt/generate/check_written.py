#!/usr/bin/python3
"""Checks that real torch reads the archives tests/test_pickle.cpp writes with its own small torch.save writer.

Run after `anchor_tests "[pickle]"`: /usr/bin/python3 tests/golden/ckpt/generate/check_written.py [BUILD_DIR]
It torch.load()s build/test-scratch/pickle_zip64/v0..v3.ckpt (stored/deflated, with and without zip64 records) and
build/test-scratch/pickle_sd/sd15_tiny.ckpt, and compares the latter with the safetensors file it was made from.
"""
import json
import os
import struct
import sys
import types

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", ".."))
BUILD = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build")

# The writer names an unknown class, as a Lightning checkpoint does; stand it in.
for name in ["pytorch_lightning", "pytorch_lightning.callbacks", "pytorch_lightning.callbacks.model_checkpoint"]:
    sys.modules.setdefault(name, types.ModuleType(name))


class ModelCheckpoint:
    pass


sys.modules["pytorch_lightning.callbacks.model_checkpoint"].ModelCheckpoint = ModelCheckpoint

DTYPES = {"F16": torch.float16, "F32": torch.float32, "BF16": torch.bfloat16, "I64": torch.int64}


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        b, e = v["data_offsets"]
        raw = bytearray(data[8 + n + b:8 + n + e])
        out[k] = torch.frombuffer(raw, dtype=DTYPES[v["dtype"]]).reshape(v["shape"]) if raw else torch.zeros(
            v["shape"], dtype=DTYPES[v["dtype"]])
    return out


def main():
    expect = {"a": torch.arange(10, dtype=torch.float32), "b": torch.arange(6).reshape(2, 3),
              "c": torch.ones(3, 1, 2, dtype=torch.float16)}
    for v in range(4):
        ck = torch.load(os.path.join(BUILD, "test-scratch", "pickle_zip64", "v%d.ckpt" % v))
        assert ck["epoch"] == 7 and ck["global_step"] == 70000, ck.keys()
        for k, t in expect.items():
            assert torch.equal(ck["state_dict"][k], t), (v, k)
        print("v%d.ckpt: torch.load reads it" % v)
    sd = torch.load(os.path.join(BUILD, "test-scratch", "pickle_sd", "sd15_tiny.ckpt"))["state_dict"]
    ref = read_safetensors(os.path.join(ROOT, "tests", "golden", "sd", "sd15_tiny_single_file",
                                        "sd15_tiny_single_file.safetensors"))
    assert sd.keys() == ref.keys()
    for k in ref:
        assert sd[k].dtype == ref[k].dtype and torch.equal(sd[k], ref[k]), k
    print("sd15_tiny.ckpt: torch.load gives the %d tensors of the safetensors file" % len(ref))


if __name__ == "__main__":
    main()
