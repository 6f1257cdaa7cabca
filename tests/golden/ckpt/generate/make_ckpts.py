#!/usr/bin/python3
"""Writes the torch.save test checkpoints of tests/golden/ckpt (read by tests/test_pickle.cpp).

Run with Debian's python3-torch (1.13): /usr/bin/python3 tests/golden/ckpt/generate/make_ckpts.py
The values are deterministic (arange-based), so the C++ test knows every expected tensor without reading a second file.
Modules that are not installed here (pytorch_lightning, numpy) are stood in for by fake modules registered in
sys.modules, so that pickle writes the same global names a real Lightning checkpoint holds.
"""
import collections
import os
import sys
import types

import torch

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def fake_module(name):
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        n = ".".join(parts[:i])
        if n not in sys.modules:
            sys.modules[n] = types.ModuleType(n)
    return sys.modules[name]


# pytorch_lightning.callbacks.model_checkpoint.ModelCheckpoint: a plain object (NEWOBJ + BUILD of its __dict__).
mc = fake_module("pytorch_lightning.callbacks.model_checkpoint")


class ModelCheckpoint:
    pass


ModelCheckpoint.__module__ = mc.__name__
mc.ModelCheckpoint = ModelCheckpoint

# numpy.core.multiarray.scalar(dtype, bytes) and numpy.dtype, as a real numpy float64 scalar pickles.
ma = fake_module("numpy.core.multiarray")
npm = sys.modules["numpy"]


def scalar(*args):
    raise RuntimeError("never called")


scalar.__module__ = ma.__name__
ma.scalar = scalar


class dtype:
    def __init__(self, name):
        self.name = name

    def __reduce__(self):
        return (dtype, (self.name, False, True), (3, "<", None, None, None, -1, -1, 0))


dtype.__module__ = "numpy"
npm.dtype = dtype


class Float64:
    def __reduce__(self):
        return (scalar, (dtype("f8"), b"\x00\x00\x00\x00\x00\x00\xf8\x3f"))


class Hostile:
    """What a malicious checkpoint holds: calling os.system when unpickled."""

    def __reduce__(self):
        return (os.system, ("touch /tmp/anchorcache_pickle_pwned",))


def basic_state_dict():
    sd = collections.OrderedDict()
    sd["f32"] = torch.arange(6, dtype=torch.float32).reshape(2, 3) / 4
    sd["f16"] = (torch.arange(4, dtype=torch.float32) - 1.5).to(torch.float16)
    sd["bf16"] = (torch.arange(4, dtype=torch.float32) * 0.5).to(torch.bfloat16).reshape(2, 2)
    sd["i64"] = torch.tensor([-3, 0, 2**40], dtype=torch.int64)
    sd["i32"] = torch.tensor([7, -7], dtype=torch.int32)
    sd["u8"] = torch.tensor([0, 255], dtype=torch.uint8)
    sd["b"] = torch.tensor([True, False, True])
    sd["f64_scalar"] = torch.tensor(2.5, dtype=torch.float64)
    sd["empty"] = torch.zeros(0, 3)
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    sd["base"] = base
    sd["base_t"] = base.t()  # non-contiguous view sharing base's storage
    long = torch.arange(10, dtype=torch.float32)
    sd["slice"] = long[2:7]  # offset view of a storage no other entry covers
    sd["strided"] = long[1::3]  # offset + stride 3
    sd["param"] = torch.nn.Parameter(torch.full((2,), 0.25))
    sd._metadata = collections.OrderedDict({"": {"version": 1}})  # as nn.Module.state_dict() sets it
    return sd


def main():
    torch.save(basic_state_dict(), os.path.join(OUT, "basic.pt"))
    torch.save(basic_state_dict(), os.path.join(OUT, "protocol4.pt"), pickle_protocol=4)
    torch.save(basic_state_dict(), os.path.join(OUT, "legacy.pt"), _use_new_zipfile_serialization=False)

    cb = ModelCheckpoint()
    cb.monitor = None
    cb.best_model_score = torch.tensor(0.5)
    cb.dirpath = "/tmp/run"
    lightning = {
        "epoch": 3,
        "global_step": 1234,
        "pytorch-lightning_version": "1.9.0",
        "state_dict": collections.OrderedDict(
            [("model.w", torch.arange(4, dtype=torch.float16).reshape(2, 2)), ("model.b", torch.ones(2))]),
        "callbacks": {"ModelCheckpoint{'monitor': None}": cb, "raw": {"best_k_models": {}}},
        "optimizer_states": [{"state": {0: {"exp_avg": torch.zeros(2, 2)}},
                              "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.999), "params": [0, 1]}]}],
        "lr_schedulers": [],
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 4}}}},
        "hparams": {"np_scalar": Float64(), "a_set": {1, 2}, "frozen": frozenset([3]), "bytes": b"abc",
                    "big": 2**70, "neg": -(2**62), "float": 1.5, "tuple": (1, "a", None, True)},
    }
    torch.save(lightning, os.path.join(OUT, "lightning.ckpt"))

    torch.save({"state_dict": {"w": torch.ones(1)}, "payload": Hostile()}, os.path.join(OUT, "hostile_os_system.pt"))


if __name__ == "__main__":
    main()
