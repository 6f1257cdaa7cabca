# The reference of the golden case controlnet_fashion: diffusers 0.27.2 reads the ControlNet that `anchor-sd
# train-controlnet` wrote (assets/models/fashion-sd/controlnet-canny, a diffusers ControlNetModel folder) and computes
# its residuals, and the demo UNet without and with them, on one input: the control images are the Canny edges of
# two Fashion-MNIST test images, as in training. Run from anywhere with the diffusers 0.27.2 venv (float32, one thread):
#   /tmp/d27/bin/python tests/golden/sd/controlnet_fashion/generate/make_controlnet_fashion.py
import gzip
import json
from pathlib import Path

import cv2
import numpy as np
import torch
from diffusers import ControlNetModel, UNet2DConditionModel
from safetensors.torch import save_file

torch.set_num_threads(1)
case = Path(__file__).resolve().parent.parent
root = case.parents[3]  # case = <root>/tests/golden/sd/controlnet_fashion
cn_dir = root / "assets/models/fashion-sd/controlnet-canny"
unet_dir = root / "assets/models/fashion-sd/unet"
cn = ControlNetModel.from_pretrained(cn_dir, torch_dtype=torch.float32).eval()
unet = UNet2DConditionModel.from_pretrained(unet_dir, torch_dtype=torch.float32).eval()


def gen(seed):
    return torch.Generator("cpu").manual_seed(seed)


raw = gzip.open("/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz").read()
images = np.frombuffer(raw, np.uint8, offset=16).reshape(-1, 28, 28)[:2]
edges = [cv2.Canny(np.repeat(np.pad(im, 2)[:, :, None], 3, 2), 100, 200) for im in images]
cond = torch.from_numpy(np.stack([np.repeat(e[None], 3, 0) for e in edges])).float() / 255.0  # [2, 3, 32, 32]
sample = torch.randn((2, 4, 8, 8), generator=gen(8401))
ehs = torch.randn((2, 77, 64), generator=gen(8402))
timesteps = torch.tensor([801, 101])
scale = 1.0
with torch.no_grad():
    down, mid = cn(sample, timesteps, encoder_hidden_states=ehs, controlnet_cond=cond, conditioning_scale=scale,
                   guess_mode=False, return_dict=False)
    plain = unet(sample, timesteps, encoder_hidden_states=ehs).sample
    with_control = unet(sample, timesteps, encoder_hidden_states=ehs, down_block_additional_residuals=down,
                        mid_block_additional_residual=mid).sample
out = {"sample": sample, "timesteps": timesteps, "encoder_hidden_states": ehs, "controlnet_cond": cond,
       "mid_block_res_sample": mid.contiguous(), "unet_out_plain": plain, "unet_out_with_control": with_control}
for k, d in enumerate(down):
    out[f"down_block_res_samples.{k}"] = d.contiguous()
save_file(out, str(case / "golden_controlnet.safetensors"))
config = {
    "diffusers": "0.27.2",
    "unet_config": "../../../../assets/models/fashion-sd/unet/config.json",
    "controlnet_config": "../../../../assets/models/fashion-sd/controlnet-canny/config.json",
    "init": "the trained ControlNet of assets/models/fashion-sd/controlnet-canny (anchor-sd train-controlnet) and the "
            "demo UNet, read by diffusers' from_pretrained with torch_dtype float32",
    "component": {
        "timesteps": timesteps.tolist(),
        "conditioning_scale": scale,
        "guess_mode": False,
        "sample": "randn((2,4,8,8), seed 8401)",
        "encoder_hidden_states": "randn((2,77,64), seed 8402)",
        "controlnet_cond": "cv2.Canny(100, 200) of Fashion-MNIST test images 0 and 1 (padded to 32x32, RGB) / 255",
    },
}
(case / "config.json").write_text(json.dumps(config, indent=1) + "\n")
print("down residuals", len(down), "max |mid|", float(mid.abs().max()), "max |with - plain|",
      float((with_control - plain).abs().max()))
