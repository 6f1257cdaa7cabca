#!/usr/bin/env python3
"""The diffusers peer of `anchor-sd bench --gemm bf16 --weights-dtype bf16`: SD 1.5's UNet (one CFG step, batch 2)
and VAE decode with random weights, the whole model cast to --dtype (PyTorch's own bfloat16 CPU path: oneDNN's bf16
convolutions and matmuls where the CPU has AVX512-BF16). Speed only. Run as tests/bench/peers.sh does (PYTHONPATH
with diffusers v0.27.2 and ../shared/peers for make_random_sd15's configs).

Prints 'unet_step_s SIZE SECONDS' per repeat, and 'vae_decode_s SIZE SECONDS' with --vae.
"""
import argparse
import time

import torch
from diffusers import AutoencoderKL, UNet2DConditionModel

import make_random_sd15 as shapes

ap = argparse.ArgumentParser()
ap.add_argument("--size", type=int, default=256)
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--dtype", choices=["f32", "bf16"], default="bf16")
ap.add_argument("--vae", action="store_true")
args = ap.parse_args()
dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
torch.set_num_threads(args.threads)
torch.manual_seed(0)
side = args.size // 8


def timed(label, fn):
    fn()  # warm-up
    for _ in range(args.reps):
        start = time.perf_counter()
        fn()
        print(f"{label} {args.size} {time.perf_counter() - start:.3f}", flush=True)


with torch.no_grad():
    unet = UNet2DConditionModel(**shapes.UNET_CONFIG).eval().to(dtype)
    sample = torch.randn(2, 4, side, side, dtype=dtype)
    context = torch.randn(2, 77, 768, dtype=dtype)
    timestep = torch.tensor([999, 999])
    timed("unet_step_s", lambda: unet(sample, timestep, encoder_hidden_states=context))
    if args.vae:
        del unet
        vae = AutoencoderKL(**shapes.VAE_CONFIG).eval().to(dtype)
        latent = torch.randn(1, 4, side, side, dtype=dtype)
        timed("vae_decode_s", lambda: vae.decode(latent))
