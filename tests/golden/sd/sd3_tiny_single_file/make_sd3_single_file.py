"""Writes sd3_tiny_single_file.safetensors: the tiny SD 3.5 Medium-style transformer of sd3_tiny (diffusers layout)
in the original Stability single-file layout (model.diffusion_model.joint_blocks.N.{x_block,context_block}...), and
checks it with diffusers' own single-file converter (convert_sd3_transformer_checkpoint_to_diffusers, diffusers
0.31.0): every converted tensor must equal the diffusers-layout tensor bit for bit, and no tensor may be left over.

usage: python make_sd3_single_file.py SD3_TINY_DIR OUT_DIR   (SD3_TINY_DIR: ../shared/golden/sd/sd3_tiny)
"""
import json
import os
import shutil
import sys

import torch
from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers
from safetensors.torch import load_file, save_file

VARIANT = "sd35m"


def to_original(sd, num_layers):
    out = {}
    P = "model.diffusion_model."

    def put(name, t):
        out[P + name] = t.clone().contiguous()

    def lin(d, o):
        for s in ("weight", "bias"):
            if f"{d}.{s}" in sd:
                put(f"{o}.{s}", sd[f"{d}.{s}"])

    def unswap(d, o):  # diffusers keeps (scale, shift); the original (shift, scale)
        for s in ("weight", "bias"):
            scale, shift = sd[f"{d}.{s}"].chunk(2, dim=0)
            put(f"{o}.{s}", torch.cat([shift, scale], dim=0))

    def fuse(d, names, o):
        for s in ("weight", "bias"):
            put(f"{o}.qkv.{s}", torch.cat([sd[f"{d}.{n}.{s}"] for n in names], dim=0))

    put("pos_embed", sd["pos_embed.pos_embed"])
    lin("pos_embed.proj", "x_embedder.proj")
    lin("time_text_embed.timestep_embedder.linear_1", "t_embedder.mlp.0")
    lin("time_text_embed.timestep_embedder.linear_2", "t_embedder.mlp.2")
    lin("time_text_embed.text_embedder.linear_1", "y_embedder.mlp.0")
    lin("time_text_embed.text_embedder.linear_2", "y_embedder.mlp.2")
    lin("context_embedder", "context_embedder")
    lin("proj_out", "final_layer.linear")
    unswap("norm_out.linear", "final_layer.adaLN_modulation.1")
    for i in range(num_layers):
        d, x, c = f"transformer_blocks.{i}", f"joint_blocks.{i}.x_block", f"joint_blocks.{i}.context_block"
        fuse(f"{d}.attn", ["to_q", "to_k", "to_v"], f"{x}.attn")
        fuse(f"{d}.attn", ["add_q_proj", "add_k_proj", "add_v_proj"], f"{c}.attn")
        lin(f"{d}.attn.norm_q", f"{x}.attn.ln_q")
        lin(f"{d}.attn.norm_k", f"{x}.attn.ln_k")
        lin(f"{d}.attn.norm_added_q", f"{c}.attn.ln_q")
        lin(f"{d}.attn.norm_added_k", f"{c}.attn.ln_k")
        lin(f"{d}.attn.to_out.0", f"{x}.attn.proj")
        lin(f"{d}.attn.to_add_out", f"{c}.attn.proj")
        if f"{d}.attn2.to_q.weight" in sd:
            fuse(f"{d}.attn2", ["to_q", "to_k", "to_v"], f"{x}.attn2")
            lin(f"{d}.attn2.norm_q", f"{x}.attn2.ln_q")
            lin(f"{d}.attn2.norm_k", f"{x}.attn2.ln_k")
            lin(f"{d}.attn2.to_out.0", f"{x}.attn2.proj")
        lin(f"{d}.norm1.linear", f"{x}.adaLN_modulation.1")
        if i == num_layers - 1:
            unswap(f"{d}.norm1_context.linear", f"{c}.adaLN_modulation.1")
        else:
            lin(f"{d}.norm1_context.linear", f"{c}.adaLN_modulation.1")
        lin(f"{d}.ff.net.0.proj", f"{x}.mlp.fc1")
        lin(f"{d}.ff.net.2", f"{x}.mlp.fc2")
        lin(f"{d}.ff_context.net.0.proj", f"{c}.mlp.fc1")
        lin(f"{d}.ff_context.net.2", f"{c}.mlp.fc2")
    return out


def main(src, out_dir):
    case = json.load(open(os.path.join(src, "config.json")))
    folder = case["variants"][VARIANT]["folder"]
    cfg = json.load(open(os.path.join(src, folder, "config.json")))
    sd = load_file(os.path.join(src, folder, "diffusion_pytorch_model.safetensors"))
    original = to_original(sd, cfg["num_layers"])
    back = convert_sd3_transformer_checkpoint_to_diffusers(dict(original))
    assert set(back) == set(sd), (set(back) ^ set(sd))
    for k in sd:
        assert torch.equal(back[k], sd[k]), k
    os.makedirs(out_dir, exist_ok=True)
    save_file(original, os.path.join(out_dir, "sd3_tiny_single_file.safetensors"))
    shutil.copyfile(os.path.join(src, f"golden_transformer_{VARIANT}.safetensors"),
                    os.path.join(out_dir, "golden_transformer.safetensors"))
    json.dump({
        "source": f"sd3_tiny/{folder} (diffusers {case['diffusers']}), variant {VARIANT}",
        "layout": "original Stability single file, transformer only (model.diffusion_model.*), float32",
        "verified": "diffusers 0.31.0 convert_sd3_transformer_checkpoint_to_diffusers maps every tensor back "
                    "bit-identically, none left over",
        "golden": "golden_transformer.safetensors = sd3_tiny's golden_transformer_" + VARIANT +
                  ".safetensors (the same weights): inputs, out and every block's outputs",
        "transformer_config": cfg,
    }, open(os.path.join(out_dir, "config.json"), "w"), indent=1)
    print(f"{len(original)} tensors, verified against diffusers' converter")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
