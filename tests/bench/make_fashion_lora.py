# A random LoRA for the demo model fashion-sd in kohya's layout (lora_unet_<module path with '_'>.lora_down/lora_up/
# alpha), on every Linear of the UNet's attention blocks, rank 4, drawn so that at multiplier 1 it moves the image
# about as much as a trained style LoRA does (features_cache.sh sweeps the multiplier). Not a trained LoRA: the cache
# table measures whether freq stays faithful to the run without cache on a perturbed model, not the LoRA's looks.
# usage (diffusers 0.27.2 venv): python make_fashion_lora.py OUT.safetensors [--rank 4] [--std 0.3] [--seed 0]
import argparse

import torch
from diffusers import UNet2DConditionModel
from safetensors.torch import save_file

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--rank", type=int, default=4)
ap.add_argument("--std", type=float, default=0.3)
ap.add_argument("--seed", type=int, default=0)
a = ap.parse_args()
torch.manual_seed(a.seed)
unet = UNet2DConditionModel.from_pretrained("assets/models/fashion-sd/unet")
tensors = {}
for name, mod in unet.named_modules():
    if isinstance(mod, torch.nn.Linear) and ".attn" in name:
        key = "lora_unet_" + name.replace(".", "_")
        down = torch.randn(a.rank, mod.in_features) / mod.in_features ** 0.5
        up = torch.randn(mod.out_features, a.rank) * a.std / a.rank ** 0.5
        tensors[key + ".lora_down.weight"] = down.contiguous()
        tensors[key + ".lora_up.weight"] = up.contiguous()
        tensors[key + ".alpha"] = torch.tensor(float(a.rank))
save_file(tensors, a.out)
print(f"wrote {a.out}: {len(tensors) // 3} LoRA modules, rank {a.rank}")
