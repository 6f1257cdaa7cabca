"""What the SD 3 pipeline generators share (make_sd3_tiny_t5.py, ../../sd3_tiny_slg/generate/make_sd3_tiny_slg.py):
sd3_tiny_text's models as a StableDiffusion3Pipeline, one recorded __call__, links instead of copies. Import it after
the caller's torch / diffusers set-up (the attention stand-in, one thread)."""
import os
import sys

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from transformers import CLIPTextModelWithProjection, CLIPTokenizer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "sd3_tiny_text"))
from make_sd3_tiny_text import clip_vocab_files  # noqa: E402  (the CLIP BPE files of the bundled vocabulary)


def tiny_pipeline(src, bpe, tmp, text_encoder_3=None, tokenizer_3=None):
    """sd3_tiny_text's transformer, VAE, scheduler and CLIP encoders (float32), its tokenizers from `bpe`."""
    clip_vocab_files(bpe, tmp)
    tok = CLIPTokenizer(os.path.join(tmp, "vocab.json"), os.path.join(tmp, "merges.txt"),
                        pad_token="<|endoftext|>", model_max_length=77)
    tok_2 = CLIPTokenizer(os.path.join(tmp, "vocab.json"), os.path.join(tmp, "merges.txt"), pad_token="!",
                          model_max_length=77)
    return StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel.from_pretrained(os.path.join(src, "transformer")),
        vae=AutoencoderKL.from_pretrained(os.path.join(src, "vae"), torch_dtype=torch.float32),
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(os.path.join(src, "scheduler")),
        text_encoder=CLIPTextModelWithProjection.from_pretrained(os.path.join(src, "text_encoder"),
                                                                 torch_dtype=torch.float32),
        text_encoder_2=CLIPTextModelWithProjection.from_pretrained(os.path.join(src, "text_encoder_2"),
                                                                   torch_dtype=torch.float32),
        tokenizer=tok, tokenizer_2=tok_2, text_encoder_3=text_encoder_3, tokenizer_3=tokenizer_3)


def token_ids(tok, prompts, length):
    """SD 3's encode_prompt call of each tokenizer: padding to max_length, truncation, special tokens."""
    return tok(prompts, padding="max_length", max_length=length, truncation=True, add_special_tokens=True,
               return_tensors="pt").input_ids


def record_run(pipe, prompts, negative, steps, guidance, seed, size, max_seq, **call_kw):
    """The ids, prompt embeddings, initial latents, latents after each step and image of one __call__."""
    g = {}
    toks = [("input_ids", pipe.tokenizer, 77), ("input_ids_2", pipe.tokenizer_2, 77)]
    if pipe.tokenizer_3 is not None:
        toks.append(("input_ids_3", pipe.tokenizer_3, max_seq))
    for name, t, length in toks:
        g[name] = token_ids(t, prompts, length)
        g["negative_" + name] = token_ids(t, [negative] * len(prompts), length)
    with torch.no_grad():
        pe, npe, pp, npp = pipe.encode_prompt(prompts, None, None, negative_prompt=negative,
                                              do_classifier_free_guidance=True, max_sequence_length=max_seq)
    g.update(prompt_embeds=pe, negative_prompt_embeds=npe, pooled_prompt_embeds=pp, negative_pooled_prompt_embeds=npp)

    def on_step(p, i, t, kw):
        g[f"latents.{i}"] = kw["latents"].clone()
        return {}

    g["initial_latents"] = torch.randn((len(prompts), 16, size // 2, size // 2),
                                       generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        g["image"] = pipe(prompts, negative_prompt=negative, num_inference_steps=steps, guidance_scale=guidance,
                          height=size, width=size, generator=torch.Generator().manual_seed(seed), output_type="pt",
                          max_sequence_length=max_seq, callback_on_step_end=on_step, **call_kw).images
    return g


def link(out, names, target):
    """out/<name> -> <target>/<name> (relative links: the case folder links its neighbour's models)."""
    for sub in names:
        if not os.path.lexists(os.path.join(out, sub)):
            os.symlink(os.path.join(target, sub), os.path.join(out, sub))
