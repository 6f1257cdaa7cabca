"""Writes the sd3_tiny_text case: a diffusers StableDiffusion3Pipeline folder with two tiny random CLIP text encoders
with projections (CLIP-L's and OpenCLIP bigG's roles), no T5 (text_encoder_3 None: diffusers puts zeros in its
place), the SD 3.5 Medium-style transformer and the VAE of sd3_tiny, and the real StableDiffusion3Pipeline.__call__
from prompt strings: token ids, prompt / pooled embeddings (positive and negative), latents after every step, image.

usage: python make_sd3_tiny_text.py SD3_TINY_DIR OUT_DIR   (diffusers 0.31.0, transformers 4.38.2, torch 1.13)
torch 1.13 has no F.scaled_dot_product_attention: softmax(q k^T / sqrt(d)) v in float32 stands in for it, as in
sd3_tiny; one thread.
"""
import gzip
import html
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
torch.set_num_threads(1)  # as every golden here: a thread count changes the float32 rounding of reductions

from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from safetensors.torch import save_file
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer

PROMPTS = ["a photo of a cat on a red sofa", "two small dogs running on the beach at sunset"]
NEGATIVE = "blurry, low quality"
STEPS, GUIDANCE, SEED, SIZE = 4, 4.5, 21, 16


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) + \
        list(range(ord("\u00ae"), ord("\u00ff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def clip_vocab_files(bpe_gz, out):
    """vocab.json / merges.txt of the openai CLIP BPE file (its vocabulary order: bytes, bytes</w>, merges, specials)."""
    merges = gzip.open(bpe_gz).read().decode("utf-8").split("\n")[1:49152 - 256 - 2 + 1]
    vocab = list(bytes_to_unicode().values())
    vocab = vocab + [v + "</w>" for v in vocab]
    vocab += ["".join(m.split()) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    json.dump({t: i for i, t in enumerate(vocab)}, open(os.path.join(out, "vocab.json"), "w"))
    open(os.path.join(out, "merges.txt"), "w").write("#version: 0.2\n" + "\n".join(merges) + "\n")


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
            if "layer_norm" in name and name.endswith("weight"):
                p.add_(1.0)
            p.copy_(p.half().float())


def text_encoder(hidden, proj, act, seed):
    cfg = CLIPTextConfig(vocab_size=49408, hidden_size=hidden, intermediate_size=37, num_hidden_layers=3,
                         num_attention_heads=2, max_position_embeddings=77, projection_dim=proj, hidden_act=act,
                         bos_token_id=0, eos_token_id=2, pad_token_id=1)
    m = CLIPTextModelWithProjection(cfg).eval()
    randomize(m, seed)
    return m


def main(src, out):
    bpe = os.path.join(src, "..", "vocab", "bpe_simple_vocab_16e6.txt.gz")
    tmp = tempfile.mkdtemp()
    clip_vocab_files(bpe, tmp)
    tok = CLIPTokenizer(os.path.join(tmp, "vocab.json"), os.path.join(tmp, "merges.txt"), pad_token="<|endoftext|>", model_max_length=77)
    tok_2 = CLIPTokenizer(os.path.join(tmp, "vocab.json"), os.path.join(tmp, "merges.txt"), pad_token="!", model_max_length=77)
    case = json.load(open(os.path.join(src, "config.json")))
    transformer = SD3Transformer2DModel.from_pretrained(os.path.join(src, case["pipeline"]["transformer"].split("/")[0]))
    vae = AutoencoderKL.from_pretrained(os.path.join(src, "vae"))
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(os.path.join(src, "scheduler"))
    # Widths: pooled = projection_dim + projection_dim_2 = pooled_projection_dim; hidden + hidden_2 <= joint dim.
    te = text_encoder(16, 8, "quick_gelu", 31)
    te_2 = text_encoder(16, 16, "gelu", 32)
    assert 8 + 16 == transformer.config.pooled_projection_dim
    pipe = StableDiffusion3Pipeline(transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=te,
                                    tokenizer=tok, text_encoder_2=te_2, tokenizer_2=tok_2, text_encoder_3=None,
                                    tokenizer_3=None)
    g = {}
    for name, t in (("input_ids", tok), ("input_ids_2", tok_2)):
        g[name] = t(PROMPTS, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
        g["negative_" + name] = t([NEGATIVE] * len(PROMPTS), padding="max_length", max_length=77, truncation=True,
                                  return_tensors="pt").input_ids
    with torch.no_grad():
        pe, npe, pp, npp = pipe.encode_prompt(PROMPTS, None, None, negative_prompt=NEGATIVE,
                                              do_classifier_free_guidance=True)
    g.update(prompt_embeds=pe, negative_prompt_embeds=npe, pooled_prompt_embeds=pp, negative_pooled_prompt_embeds=npp)

    def on_step(p, i, t, kw):
        g[f"latents.{i}"] = kw["latents"].clone()
        return {}

    gen = torch.Generator().manual_seed(SEED)
    g["initial_latents"] = torch.randn((len(PROMPTS), 16, SIZE // 2, SIZE // 2), generator=torch.Generator().manual_seed(SEED))
    with torch.no_grad():
        image = pipe(PROMPTS, negative_prompt=NEGATIVE, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                     height=SIZE, width=SIZE, generator=gen, output_type="pt", callback_on_step_end=on_step).images
    g["image"] = image
    os.makedirs(out, exist_ok=True)
    # Every weight is float16-exact (randomize / sd_common): float16 files are lossless and half the bytes. Not the
    # transformer: its pos_embed buffer is the float32 sine-cosine grid.
    for m in (pipe.text_encoder, pipe.text_encoder_2, pipe.vae):
        m.to(torch.float16)
    pipe.save_pretrained(out, safe_serialization=True)
    for t in ("tokenizer", "tokenizer_2"):  # the bundled CLIP vocabulary stands in for vocab.json / merges.txt
        for f in ("vocab.json", "merges.txt"):
            os.remove(os.path.join(out, t, f))
    save_file({k: v.contiguous() for k, v in g.items()}, os.path.join(out, "golden_sd3_text.safetensors"))
    json.dump({"prompts": PROMPTS, "negative_prompt": NEGATIVE, "num_inference_steps": STEPS,
               "guidance_scale": GUIDANCE, "height": SIZE, "width": SIZE, "generator_seed": SEED,
               "initial_latents": f"torch.randn((batch, 16, h/2, w/2), manual_seed({SEED})): the pipeline's first draw",
               "text_encoder_3": None, "max_sequence_length": 256,
               "recorded": "input_ids(_2), negative_input_ids(_2), prompt_embeds, negative_prompt_embeds, "
                           "pooled_prompt_embeds, negative_pooled_prompt_embeds, latents.<i> after step i, image"},
              open(os.path.join(out, "golden.json"), "w"), indent=1)
    shutil.rmtree(tmp)
    print({k: tuple(v.shape) for k, v in g.items()})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
