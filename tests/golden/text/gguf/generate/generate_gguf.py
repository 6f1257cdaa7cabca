#!/usr/bin/env python3
"""A small GGUF written by llama.cpp's own Python package (gguf-py, PyPI `gguf`) and the values it dequantises to.

Tensors of every type the reader supports (f32, f16, bf16, q8_0, q4_0), quantised by gguf-py's reference
quantizers; metadata of every value type; a non-default alignment. The expected float32 tensors are gguf-py's
dequantize() of the stored bytes, and the originals are kept to measure the quantisation error.

Run: /tmp/d64/bin/python tests/golden/text/gguf/generate/generate_gguf.py   (pip install gguf numpy safetensors)
"""
import importlib.metadata
import json
import os

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q
from gguf import quants
from safetensors.numpy import save_file

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def main():
    rng = np.random.default_rng(7)
    path = os.path.join(OUT, "small.gguf")
    w = gguf.GGUFWriter(path, "llada")
    w.data_alignment = 64  # not the default 32, written as general.alignment
    w.add_uint32("general.alignment", 64)
    w.add_uint32("llada.block_count", 2)
    w.add_float32("llada.rope.freq_base", 500000.0)
    w.add_string("general.name", "tiny gguf")
    w.add_bool("test.flag", True)
    w.add_int64("test.i64", -5)
    w.add_float64("test.f64", 0.125)
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "<|mask|>"])
    w.add_array("test.ints", [1, -2, 3])
    expected, originals, info = {}, {}, {}
    specs = [("w_f32", Q.F32, (3, 64)), ("w_f16", Q.F16, (3, 64)), ("w_bf16", Q.BF16, (3, 64)),
             ("w_q8_0", Q.Q8_0, (4, 64)), ("w_q4_0", Q.Q4_0, (4, 96)), ("v_q8_0", Q.Q8_0, (32,)),
             ("w3_f32", Q.F32, (2, 3, 32))]
    for name, qt, shape in specs:
        x = rng.standard_normal(shape).astype(np.float32) * 0.7
        x.flat[0] = 0.0  # an exact zero (and, for q4_0, an all-equal nibble pattern nowhere)
        if qt == Q.F32:
            w.add_tensor(name, x)
            deq = x
        elif qt == Q.F16:
            w.add_tensor(name, x.astype(np.float16))
            deq = x.astype(np.float16).astype(np.float32)
        else:
            q = quants.quantize(x, qt)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qt)
            deq = quants.dequantize(q, qt).astype(np.float32).reshape(shape)
        expected[name] = np.ascontiguousarray(deq)
        originals[name] = x
        info[name] = {"type": qt.name.lower(), "shape": list(shape)}
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    save_file({**{"dequantized." + k: v for k, v in expected.items()}, **{"original." + k: v for k, v in originals.items()}},
              os.path.join(OUT, "gguf_case.safetensors"))
    case = {"file": "small.gguf", "version": 3, "alignment": 64, "tensors": info,
            "metadata": {"general.architecture": "llada", "general.alignment": 64, "llada.block_count": 2,
                         "llada.rope.freq_base": 500000.0, "general.name": "tiny gguf", "test.flag": True,
                         "test.i64": -5, "test.f64": 0.125, "tokenizer.ggml.tokens": ["a", "b", "<|mask|>"],
                         "test.ints": [1, -2, 3]},
            # |dequantized - original| <= this x max|original| per tensor: q4_0's step is max|block| / 8.
            "quantization_rel_error": {"f32": 0.0, "f16": 1e-3, "bf16": 8e-3, "q8_0": 1e-2, "q4_0": 0.13},
            "reference": "gguf-py " + importlib.metadata.version("gguf")}
    with open(os.path.join(OUT, "gguf_case.json"), "w") as f:
        json.dump(case, f, indent=1)
    print("wrote", path, os.path.getsize(path), "bytes")


if __name__ == "__main__":
    main()
