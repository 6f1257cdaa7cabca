"""Runs assets/models/fashion-mmdit through diffusers' own StableDiffusion3Pipeline (0.31, float32, one thread) and
compares the image with anchor-sd's PNG of the same prompt, seed, steps and guidance: evidence that the folder is a
diffusers SD 3 pipeline our engine runs as diffusers does (4-channel VAE with shift_factor, patch size 1, no T5).

usage: python unet/train/check_fashion_mmdit.py MODEL PNG PROMPT SEED STEPS CFG
(the tokenizers get CLIP's vocab.json / merges.txt from the BPE file, which the committed folder leaves out)
"""
import os
import shutil
import sys
import tempfile
import zlib

import numpy as np
import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The trainer's module installs its softmax attention in place of torch 2's F.scaled_dot_product_attention (with
# ZERO_COPIES at 1: the plain formula) before diffusers is imported.
from train_fashion_mmdit import bpe_vocab_files  # noqa: E402
from diffusers import StableDiffusion3Pipeline  # noqa: E402
from transformers import CLIPTokenizer  # noqa: E402


def main(model, png, prompt, seed, steps, cfg):
    tmp = tempfile.mkdtemp()
    bpe_vocab_files("/work/shared/golden/sd/vocab/bpe_simple_vocab_16e6.txt.gz", tmp)
    toks = [CLIPTokenizer(os.path.join(tmp, "vocab.json"), os.path.join(tmp, "merges.txt"), pad_token=p,
                          model_max_length=77) for p in ("<|endoftext|>", "!")]
    pipe = StableDiffusion3Pipeline.from_pretrained(model, tokenizer=toks[0], tokenizer_2=toks[1], text_encoder_3=None,
                                                    tokenizer_3=None,
                                                    torch_dtype=torch.float32)
    with torch.no_grad():
        img = pipe(prompt, num_inference_steps=steps, guidance_scale=cfg, height=32, width=32,
                   generator=torch.Generator().manual_seed(seed), output_type="np").images[0]
    ref = np.round(img * 255).astype(np.int64)
    raw = open(png, "rb").read()
    # minimal PNG reader for the engine's 8-bit RGB, filter-type-0..4 scanlines
    pos, idat, w, h = 8, b"", 0, 0
    while pos < len(raw):
        n = int.from_bytes(raw[pos:pos + 4], "big")
        typ = raw[pos + 4:pos + 8]
        data = raw[pos + 8:pos + 8 + n]
        if typ == b"IHDR":
            w, h = int.from_bytes(data[:4], "big"), int.from_bytes(data[4:8], "big")
        elif typ == b"IDAT":
            idat += data
        pos += 12 + n
    dec = zlib.decompress(idat)
    stride = w * 3
    out = np.zeros((h, stride), dtype=np.int64)
    prev = np.zeros(stride, dtype=np.int64)
    for y in range(h):
        f = dec[y * (stride + 1)]
        line = np.frombuffer(dec[y * (stride + 1) + 1:(y + 1) * (stride + 1)], dtype=np.uint8).astype(np.int64)
        cur = np.zeros(stride, dtype=np.int64)
        for x in range(stride):
            a = cur[x - 3] if x >= 3 else 0
            b = prev[x]
            c = prev[x - 3] if x >= 3 else 0
            if f == 0:
                p = 0
            elif f == 1:
                p = a
            elif f == 2:
                p = b
            elif f == 3:
                p = (a + b) // 2
            else:
                pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
                p = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
            cur[x] = (line[x] + p) & 255
        out[y] = cur
        prev = cur
    ours = out.reshape(h, w, 3)
    d = np.abs(ours - ref)
    print(f"diffusers vs anchor-sd: max |diff| {d.max()} levels, mean {d.mean():.4f}, equal {np.mean(d == 0) * 100:.1f} %")
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]))
