"""Writes the sd3_tiny_slg case: diffusers' StableDiffusion3Pipeline with skip-layer guidance (SD 3.5 Medium's
skip_guidance_layers, added in diffusers 0.32) over sd3_tiny_text's models (linked, not copied), without T5.

usage: PYTHONPATH=<diffusers 0.32.2> python make_sd3_tiny_slg.py SD_GOLDEN_DIR   (tests/golden/sd; transformers
4.38.2, torch 1.13 CPU float32, one thread; F.scaled_dot_product_attention as in sd3_tiny)

diffusers' rule, step i of n (0-based): with classifier-free guidance and start * n < i < stop * n, the transformer
runs once more on the positive rows with the listed blocks skipped, and v = v_cfg + (v_text - v_skip) * scale.
"""
import json
import math
import os
import shutil
import sys
import tempfile

import torch
import torch.nn.functional as F


def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    assert attn_mask is None and not is_causal
    s = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return torch.softmax(q @ k.transpose(-1, -2) * s, dim=-1) @ v


F.scaled_dot_product_attention = sdpa
torch.set_num_threads(1)
# diffusers 0.32 names torch 2.1's float8 dtypes at import (its layerwise-casting tables); torch 1.13 has none. They
# are never used here: stand-ins let the import pass.
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if not hasattr(torch, _name):
        setattr(torch, _name, torch.float16)
if not hasattr(torch, "compiler"):  # torch >= 2.1's decorator namespace (progress_bar uses compiler.disable)
    import types

    torch.compiler = types.SimpleNamespace(disable=lambda fn=None, **kw: fn if fn is not None else (lambda f: f))

import transformers  # noqa: E402
from transformers.image_processing_utils import BaseImageProcessor  # noqa: E402

# diffusers 0.32's SD 3 pipeline imports BaseImageProcessor (for its IP-Adapter, unused here) from the top level,
# which transformers 4.38 does not export yet.
transformers.BaseImageProcessor = BaseImageProcessor
import diffusers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "sd3_tiny_t5", "generate"))
from sd3_tiny_run import link, record_run, tiny_pipeline  # noqa: E402

PROMPTS = ["a photo of a cat on a red sofa", "two small dogs running on the beach at sunset"]
NEGATIVE = "blurry, low quality"
STEPS, GUIDANCE, SEED, SIZE = 10, 4.5, 29, 16
SLG = dict(skip_guidance_layers=[1], skip_layer_guidance_scale=2.8, skip_layer_guidance_start=0.01,
           skip_layer_guidance_stop=0.45)  # active at steps 1..4 of 10


def main(root):
    assert diffusers.__version__ >= "0.32", diffusers.__version__
    src, out = os.path.join(root, "sd3_tiny_text"), os.path.join(root, "sd3_tiny_slg")
    tmp = tempfile.mkdtemp()
    pipe = tiny_pipeline(src, os.path.join(root, "vocab", "bpe_simple_vocab_16e6.txt.gz"), tmp)
    g = record_run(pipe, PROMPTS, NEGATIVE, STEPS, GUIDANCE, SEED, SIZE, 256, **SLG)
    os.makedirs(out, exist_ok=True)
    shutil.copy(os.path.join(src, "model_index.json"), os.path.join(out, "model_index.json"))
    link(out, ("transformer", "vae", "scheduler", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"),
         os.path.join("..", "sd3_tiny_text"))
    save_file({k: v.contiguous() for k, v in g.items()}, os.path.join(out, "golden_sd3_text.safetensors"))
    json.dump({"prompts": PROMPTS, "negative_prompt": NEGATIVE, "num_inference_steps": STEPS,
               "guidance_scale": GUIDANCE, "height": SIZE, "width": SIZE, "generator_seed": SEED,
               "initial_latents": f"torch.randn((batch, 16, h/2, w/2), manual_seed({SEED})): the pipeline's first draw",
               "text_encoder_3": None, "max_sequence_length": 256, **SLG,
               "recorded": "input_ids(_2), negative_input_ids(_2), prompt_embeds, negative_prompt_embeds, "
                           "pooled_prompt_embeds, negative_pooled_prompt_embeds, latents.<i> after step i, image"},
              open(os.path.join(out, "golden.json"), "w"), indent=1)
    shutil.rmtree(tmp)
    print({k: tuple(v.shape) for k, v in g.items()})


if __name__ == "__main__":
    main(sys.argv[1])
