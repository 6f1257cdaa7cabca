#!/usr/bin/env python3
"""A random-weight GPT-2-small GGUF for llama.cpp's llama-bench (tests/bench/peers.sh).

GPT-2-small's shapes (12 layers x 768, 12 heads, 3072 MLP, 1024 positions, 50257 tokens) with N(0, 0.02) weights and
the real GPT-2 BPE vocabulary (assets/vocab/gpt2), written with llama.cpp's own gguf-py (pass its folder) in the
tensor names llama.cpp's gpt2 architecture loads. Decode speed does not depend on the values, only on the shapes and
the weight type: f32, f16, q8_0 or q4_0.

usage: make_gpt2_gguf.py --gguf-py LLAMA_CPP/gguf-py --vocab assets/vocab/gpt2 --out F.gguf [--type f32|f16|q8_0|q4_0]
"""
import argparse
import json
import os
import sys

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf-py", required=True)
    ap.add_argument("--vocab", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--type", default="f32", choices=["f32", "f16", "q8_0", "q4_0"])
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if os.path.exists(a.out):
        sys.exit(f"error: {a.out} exists (not overwritten)")
    sys.path.insert(0, a.gguf_py)
    try:  # gguf-py imports sentencepiece for SentencePiece vocabularies; GPT-2's BPE does not need it
        import sentencepiece  # noqa: F401
    except ImportError:
        import types
        sys.modules["sentencepiece"] = types.ModuleType("sentencepiece")
        sys.modules["sentencepiece"].SentencePieceProcessor = None
    import gguf

    with open(os.path.join(a.vocab, "encoder.json")) as f:
        enc = json.load(f)
    tokens = [t for t, _ in sorted(enc.items(), key=lambda kv: kv[1])]
    with open(os.path.join(a.vocab, "vocab.bpe"), encoding="utf-8") as f:
        merges = [l.rstrip("\n") for l in f if l.strip() and not l.startswith("#version")]
    n_vocab, n_embd, n_layer, n_head, n_ff, n_ctx = len(tokens), 768, 12, 12, 3072, 1024

    w = gguf.GGUFWriter(a.out + ".tmp", "gpt2")
    w.add_name("random-gpt2-small")
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_layer_norm_eps(1e-5)
    w.add_file_type({"f32": 0, "f16": 1, "q8_0": 7, "q4_0": 2}[a.type])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([1] * n_vocab)
    w.add_token_merges(merges)
    w.add_bos_token_id(50256)
    w.add_eos_token_id(50256)

    rng = np.random.default_rng(a.seed)

    def mat(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)

    def put(name, arr, quantize=True):
        # norms, biases and embeddings as llama.cpp's converter keeps them: 1-D tensors in f32
        if arr.ndim == 1 or not quantize or a.type == "f32":
            w.add_tensor(name, arr.astype(np.float32))
        elif a.type == "f16":
            w.add_tensor(name, arr.astype(np.float16))
        else:
            qt = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}[a.type]
            q = gguf.quants.quantize(arr, qt)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qt)

    put("token_embd.weight", mat(n_vocab, n_embd))
    put("position_embd.weight", mat(n_ctx, n_embd), quantize=False)
    for i in range(n_layer):
        put(f"blk.{i}.attn_norm.weight", np.ones(n_embd, np.float32))
        put(f"blk.{i}.attn_norm.bias", np.zeros(n_embd, np.float32))
        put(f"blk.{i}.attn_qkv.weight", mat(3 * n_embd, n_embd))
        put(f"blk.{i}.attn_qkv.bias", np.zeros(3 * n_embd, np.float32))
        put(f"blk.{i}.attn_output.weight", mat(n_embd, n_embd))
        put(f"blk.{i}.attn_output.bias", np.zeros(n_embd, np.float32))
        put(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, np.float32))
        put(f"blk.{i}.ffn_norm.bias", np.zeros(n_embd, np.float32))
        put(f"blk.{i}.ffn_up.weight", mat(n_ff, n_embd))
        put(f"blk.{i}.ffn_up.bias", np.zeros(n_ff, np.float32))
        put(f"blk.{i}.ffn_down.weight", mat(n_embd, n_ff))
        put(f"blk.{i}.ffn_down.bias", np.zeros(n_embd, np.float32))
    put("output_norm.weight", np.ones(n_embd, np.float32))
    put("output_norm.bias", np.zeros(n_embd, np.float32))
    put("output.weight", mat(n_vocab, n_embd))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(a.out + ".tmp", a.out)
    print(f"wrote {a.out} ({a.type})")


if __name__ == "__main__":
    main()
