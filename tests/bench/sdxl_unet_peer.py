#!/usr/bin/env python3
"""SDXL base UNet, one CFG step (batch 2) on CPU with current diffusers, random weights (speed only): the
diffusers-torch2 row of tests/bench/peers.sh's SDXL 1024x1024 comparison (issue: CPU speed against the peers).

usage: sdxl_unet_peer.py [--size 1024] [--reps 2] [--threads 2] [--precision f32|bf16]
Prints 'torch_sdxl_unet_step_s <size> <t>' per timed call, after one untimed warm-up call.

The config is SDXL base 1.0's UNet (stabilityai/stable-diffusion-xl-base-1.0, unet/config.json), written out here so
that nothing is downloaded: three levels [320, 640, 1280], transformer depths [0, 2, 10], cross-attention 2048, the
pooled text embedding (1280) and the six size/crop conditioning numbers through `text_time` added conditioning.
The inputs follow StableDiffusionXLPipeline's shapes: latents [2, 4, size/8, size/8], prompt embeddings [2, 77, 2048],
text_embeds [2, 1280], time_ids [2, 6].
"""
import argparse
import time

import torch
from diffusers import UNet2DConditionModel

SDXL_BASE_UNET = dict(
    sample_size=128, in_channels=4, out_channels=4, center_input_sample=False, flip_sin_to_cos=True, freq_shift=0,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    block_out_channels=(320, 640, 1280), layers_per_block=2, downsample_padding=1, mid_block_scale_factor=1,
    act_fn="silu", norm_num_groups=32, norm_eps=1e-5, cross_attention_dim=2048,
    transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), use_linear_projection=True,
    addition_embed_type="text_time", addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816,
)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", choices=["f32", "bf16"], default="f32")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if a.precision == "bf16" else torch.float32
    s = a.size // 8
    with torch.inference_mode():
        unet = UNet2DConditionModel(**SDXL_BASE_UNET).eval().to(dtype)
        x = torch.randn(2, 4, s, s, dtype=dtype)
        t = torch.tensor([999, 999])
        ctx = torch.randn(2, 77, 2048, dtype=dtype)
        added = {"text_embeds": torch.randn(2, 1280, dtype=dtype),
                 "time_ids": torch.tensor([[a.size, a.size, 0, 0, a.size, a.size]] * 2, dtype=dtype)}
        unet(x, t, encoder_hidden_states=ctx, added_cond_kwargs=added)  # warm-up
        for _ in range(a.reps):
            t0 = time.perf_counter()
            unet(x, t, encoder_hidden_states=ctx, added_cond_kwargs=added)
            print(f"torch_sdxl_unet_step_s {a.size} {time.perf_counter() - t0:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
