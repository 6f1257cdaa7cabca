"""Writes the sd3_tiny_img2img case: diffusers' StableDiffusion3Img2ImgPipeline over sd3_tiny_text's models (linked,
not copied), without T5, from a 16 x 16 init image this script draws.

usage: python make_sd3_tiny_img2img.py SD_GOLDEN_DIR   (tests/golden/sd; diffusers 0.31.0, transformers 4.38.2,
torch 1.13 CPU float32, one thread; F.scaled_dot_product_attention as in sd3_tiny)

What it pins down: get_timesteps' float rule (t_start = int(steps - steps * strength): 10 steps at strength 0.55 run
6, where SD 1.x's int(steps * strength) would run 5), the generator's two draws (the VAE posterior's sample, then the
noise), the (z - shift_factor) * scaling_factor latents tiled to the batch, and scale_noise at the first loop step:
sigma * noise + (1 - sigma) * latents.
"""
import json
import math
import os
import shutil
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F


def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    assert attn_mask is None and not is_causal
    s = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return torch.softmax(q @ k.transpose(-1, -2) * s, dim=-1) @ v


F.scaled_dot_product_attention = sdpa
torch.set_num_threads(1)

from diffusers import StableDiffusion3Img2ImgPipeline  # noqa: E402
from PIL import Image  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "sd3_tiny_t5", "generate"))
from sd3_tiny_run import link, tiny_pipeline  # noqa: E402

PROMPTS = ["a photo of a cat on a red sofa", "two small dogs running on the beach at sunset"]
NEGATIVE = "blurry, low quality"
STEPS, GUIDANCE, SEED, STRENGTH = 10, 4.5, 31, 0.55


def init_image():
    """A smooth colour gradient with noise, 16 x 16 RGB (what the VAE encodes)."""
    rng = np.random.RandomState(5)
    y, x = np.mgrid[0:16, 0:16].astype(np.float64)
    img = np.stack([x * 15, y * 15, (x + y) * 7.5], -1) + rng.normal(0, 20, (16, 16, 3))
    return Image.fromarray(np.clip(np.round(img), 0, 255).astype(np.uint8), "RGB")


def main(root):
    src, out = os.path.join(root, "sd3_tiny_text"), os.path.join(root, "sd3_tiny_img2img")
    tmp = tempfile.mkdtemp()
    pipe = StableDiffusion3Img2ImgPipeline(
        **tiny_pipeline(src, os.path.join(root, "vocab", "bpe_simple_vocab_16e6.txt.gz"), tmp).components)
    os.makedirs(out, exist_ok=True)
    image = init_image()
    image.save(os.path.join(out, "init.png"))
    g = {"init_pixels": torch.from_numpy(np.asarray(image).copy())}

    scale_noise = pipe.scheduler.scale_noise

    def recording_scale_noise(sample, timestep, noise=None):
        g["image_latents"], g["noise"], g["latent_timestep"] = sample.clone(), noise.clone(), timestep.clone()
        out_ = scale_noise(sample, timestep, noise)
        g["noised_latents"] = out_.clone()
        return out_

    pipe.scheduler.scale_noise = recording_scale_noise

    def on_step(p, i, t, kw):
        g[f"latents.{i}"] = kw["latents"].clone()
        return {}

    with torch.no_grad():
        g["image"] = pipe(PROMPTS, image=image, strength=STRENGTH, negative_prompt=NEGATIVE,
                          num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                          generator=torch.Generator().manual_seed(SEED), output_type="pt",
                          callback_on_step_end=on_step).images
    g["timesteps"] = pipe.scheduler.timesteps.clone()
    shutil.copy(os.path.join(src, "model_index.json"), os.path.join(out, "model_index.json"))
    mi = json.load(open(os.path.join(out, "model_index.json")))
    mi["_class_name"] = "StableDiffusion3Img2ImgPipeline"
    json.dump(mi, open(os.path.join(out, "model_index.json"), "w"), indent=2)
    link(out, ("transformer", "vae", "scheduler", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"),
         os.path.join("..", "sd3_tiny_text"))
    save_file({k: v.contiguous() for k, v in g.items()}, os.path.join(out, "golden_sd3_img2img.safetensors"))
    loop = sum(1 for k in g if k.startswith("latents."))
    json.dump({"prompts": PROMPTS, "negative_prompt": NEGATIVE, "num_inference_steps": STEPS,
               "guidance_scale": GUIDANCE, "strength": STRENGTH, "generator_seed": SEED, "init_image": "init.png",
               "loop_steps": loop, "text_encoder_3": None, "max_sequence_length": 256,
               "recorded": "init_pixels (uint8 [16, 16, 3]), image_latents ((z - shift) * scaling, tiled), noise, "
                           "latent_timestep, noised_latents (scale_noise), latents.<i> after loop step i, timesteps "
                           "(the whole schedule), image"},
              open(os.path.join(out, "golden.json"), "w"), indent=1)
    shutil.rmtree(tmp)
    print({k: tuple(v.shape) for k, v in g.items()}, loop)


if __name__ == "__main__":
    main(sys.argv[1])
