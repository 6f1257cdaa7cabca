#!/usr/bin/env python3
"""An SDXL ControlNet against diffusers 0.27.2 (issue: ControlNet for SD 1.x/2.x and SDXL): ControlNetModel.from_unet
on the tiny SDXL UNet of tests/golden/sd/sdxl_tiny (text_time added conditioning: the pooled text embedding and the
six size/crop numbers reach the ControlNet's time embedding as they reach the UNet's), every parameter randomized,
then its residuals and the UNet with them, float32 on the CPU, one thread.

usage: /tmp/d27/bin/python gen_controlnet_sdxl.py   (writes the case next to this folder)

Case layout (read by tests/golden_runner/check_controlnet.cpp, "component"): controlnet/ (config + weights),
config.json, golden_controlnet.safetensors with the inputs (sample, timesteps, encoder_hidden_states, text_embeds,
time_ids, controlnet_cond), down_block_res_samples.<i>, mid_block_res_sample, unet_out_plain, unet_out_with_control.
"""
import json
from pathlib import Path

import torch
from diffusers import ControlNetModel, UNet2DConditionModel
from safetensors.torch import save_file

here = Path(__file__).resolve().parent
case = here.parent
unet_dir = case.parent / "sdxl_tiny" / "unet"
torch.set_num_threads(1)


def randomize(model, seed):
    # N(0, 0.05) for every parameter, norm weights around 1, values exact in float16 (as the other tiny cases).
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            v = torch.randn(p.shape, generator=g) * 0.05
            if "norm" in name and name.endswith("weight"):
                v = v + 1.0
            p.copy_(v.half().float())


def main():
    unet = UNet2DConditionModel.from_pretrained(unet_dir).eval()
    cn = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(8, 16)).eval()
    randomize(cn, 7101)
    cn.save_pretrained(case / "controlnet", safe_serialization=True)
    cfg_u = unet.config
    pooled = cfg_u.projection_class_embeddings_input_dim - 6 * cfg_u.addition_time_embed_dim
    torch.manual_seed(0)
    sample = torch.randn((2, 4, 8, 8), generator=torch.Generator().manual_seed(404))
    timesteps = torch.tensor([801, 101])
    ctx = torch.randn((2, 77, cfg_u.cross_attention_dim), generator=torch.Generator().manual_seed(405))
    text_embeds = torch.randn((2, pooled), generator=torch.Generator().manual_seed(406))
    time_ids = torch.tensor([[16.0, 16.0, 0.0, 0.0, 16.0, 16.0], [24.0, 16.0, 4.0, 0.0, 16.0, 16.0]])
    cond = torch.rand((2, 3, 16, 16), generator=torch.Generator().manual_seed(407))
    added = {"text_embeds": text_embeds, "time_ids": time_ids}
    scale = 0.7
    out = {"sample": sample, "timesteps": timesteps.to(torch.int64), "encoder_hidden_states": ctx,
           "text_embeds": text_embeds, "time_ids": time_ids, "controlnet_cond": cond}
    with torch.no_grad():
        down, mid = cn(sample, timesteps, encoder_hidden_states=ctx, controlnet_cond=cond, conditioning_scale=scale,
                       added_cond_kwargs=added, return_dict=False)
        for i, d in enumerate(down):
            out[f"down_block_res_samples.{i}"] = d
        out["mid_block_res_sample"] = mid
        out["unet_out_plain"] = unet(sample, timesteps, encoder_hidden_states=ctx, added_cond_kwargs=added).sample
        out["unet_out_with_control"] = unet(sample, timesteps, encoder_hidden_states=ctx, added_cond_kwargs=added,
                                            down_block_additional_residuals=down,
                                            mid_block_additional_residual=mid).sample
    save_file({k: v.contiguous() for k, v in out.items()}, str(case / "golden_controlnet.safetensors"))
    config = {
        "diffusers": "0.27.2",
        "unet_config": "../sdxl_tiny/unet/config.json",
        "controlnet_config": "controlnet/config.json",
        "init": "ControlNetModel.from_unet(tests/golden/sd/sdxl_tiny/unet, conditioning_embedding_out_channels=(8, 16)), "
                "every parameter N(0, 0.05) (norm weights + 1), float16-exact, seed 7101",
        "component": {
            "timesteps": [801, 101],
            "conditioning_scale": scale,
            "guess_mode": False,
            "sample": "randn((2,4,8,8), seed 404)",
            "encoder_hidden_states": "randn((2,77,48), seed 405)",
            "text_embeds": f"randn((2,{pooled}), seed 406)",
            "time_ids": "[[16,16,0,0,16,16],[24,16,4,0,16,16]]",
            "controlnet_cond": "torch.rand((2,3,16,16), generator seed 407) in [0,1]",
        },
    }
    (case / "config.json").write_text(json.dumps(config, indent=1) + "\n")


if __name__ == "__main__":
    main()
