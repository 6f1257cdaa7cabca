"""Writes sd3_tiny_single_file_te: a tiny SD 3.5 Medium-style model as ONE original single file WITH its text
encoders (transformer + VAE + CLIP-L + CLIP-G + T5, Stability's names: model.diffusion_model.*, first_stage_model.*,
text_encoders.{clip_l,clip_g,t5xxl}.transformer.*), the run of diffusers' StableDiffusion3Pipeline on the same
models as a folder, and the check that diffusers' own StableDiffusion3Pipeline.from_single_file(file, config=folder)
gives the same image.

usage: PYTHONPATH=<sentencepiece 0.2.0 + protobuf> python make_sd3_tiny_single_file_te.py SD_GOLDEN_DIR
  (SD_GOLDEN_DIR = tests/golden/sd: reads sd3_tiny_text/, t5_tiny/, vocab/; writes sd3_tiny_single_file_te/;
   diffusers 0.31.0, transformers 4.38.2, torch 1.13 CPU, float32, one thread; /tmp/d63 + PYTHONPATH=/tmp/d63b_sp)

The models differ from sd3_tiny_t5's where a single file cannot say what a folder's configs say, so that the
engine's shape-only reading is what is checked:
* CLIP-L: sd3_tiny_text's text_encoder with projection_dim = hidden_size and an identity text_projection (a single
  file has no CLIP-L projection: diffusers puts torch.eye in its place, ComfyUI uses the unprojected pooled output);
  the file stores no text_projection for it.
* CLIP-G: sd3_tiny_text's text_encoder_2 config (gelu) 8 wide with 1 head and projection 8, new random float16-exact
  weights (seed 45): a width other than CLIP-L's, since diffusers' from_single_file picks the CLIP-L tensors for any
  CLIP whose width equals CLIP-L's (its is_clip_sd3_model test compares only the position embedding's width).
* T5: t5_tiny's sizes, relative_attention_max_distance 128 (T5 v1.1's, which shapes cannot show), new random
  float16-exact weights (seed 43); stored in float16 as Stability ships t5xxl_fp16, both shared.weight and its tied
  encoder.embed_tokens.weight (transformers' strict load_state_dict, which diffusers uses without accelerate, needs
  both).
* transformer: sd3_tiny_text's config with pooled_projection_dim 24 (16 + 8), new random weights (seed 44),
  float32 (its pos_embed buffer is a float32 grid).
* VAE: sd3_tiny_text's (float16 as stored there).
The tokenizers are not in a single file: the CLIP ones are the bundled vocabulary (pad <|endoftext|> / "!"), T5's is
t5_tiny's spiece.model, given to the engine as `text_encoders/` (tokenizer_3/: links to t5_tiny's tokenizer files).
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


F.scaled_dot_product_attention = sdpa  # torch 1.13 has none: softmax(q k^T / sqrt(d)) v in float32, as sd3_tiny
torch.set_num_threads(1)

from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline  # noqa: E402
from diffusers.loaders.single_file_utils import (convert_ldm_clip_checkpoint, convert_ldm_vae_checkpoint,  # noqa: E402
                                                 convert_sd3_t5_checkpoint_to_diffusers,
                                                 convert_sd3_transformer_checkpoint_to_diffusers)
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import (CLIPTextModelWithProjection, CLIPTokenizer, T5Config, T5EncoderModel,  # noqa: E402
                          T5TokenizerFast)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "sd3_tiny_t5", "generate"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "sd3_tiny_single_file"))
from sd3_tiny_run import record_run  # noqa: E402
from make_sd3_single_file import to_original  # noqa: E402
from make_sd3_tiny_text import clip_vocab_files  # noqa: E402  (on sd3_tiny_run's path)

PROMPTS = ["a photo of a cat on a red sofa", "two small dogs running on the beach at sunset"]
NEGATIVE = "blurry, low quality"
STEPS, GUIDANCE, SEED, SIZE, MAX_SEQ = 3, 4.5, 29, 16, 64
FILE = "sd3_tiny_te.safetensors"


def f16_exact_random(model, seed, skip=()):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(s in name for s in skip):
                continue
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if "relative_attention_bias" in name else 0.2))
            if name.endswith(("layer_norm.weight", "norm_q.weight", "norm_k.weight", "norm_added_q.weight",
                              "norm_added_k.weight")):
                p.add_(1.0)
            p.copy_(p.half().float())


def vae_to_ldm(sd, levels):
    """diffusers AutoencoderKL names -> LDM's Encoder / Decoder (first_stage_model.*), the inverse of diffusers'
    convert_ldm_vae_checkpoint; the mid attention's linears become [C, C, 1, 1] convolutions."""
    out = {}
    for k, v in sd.items():
        n = k
        for part, ldm in (("encoder", "down"), ("decoder", "up")):
            if n.startswith(f"{part}.{ldm}_blocks."):
                rest = n[len(f"{part}.{ldm}_blocks."):]
                i, rest = rest.split(".", 1)
                i = int(i) if part == "encoder" else levels - 1 - int(i)
                rest = rest.replace("resnets.", "block.").replace("downsamplers.0.", "downsample.") \
                    .replace("upsamplers.0.", "upsample.").replace("conv_shortcut", "nin_shortcut")
                n = f"{part}.{ldm}.{i}.{rest}"
        n = n.replace("mid_block.resnets.0.", "mid.block_1.").replace("mid_block.resnets.1.", "mid.block_2.")
        n = n.replace("mid_block.resnets.", "mid.block_").replace("conv_shortcut", "nin_shortcut")
        for d, o in (("group_norm", "norm"), ("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "proj_out")):
            n = n.replace(f"mid_block.attentions.0.{d}.", f"mid.attn_1.{o}.")
        n = n.replace("conv_norm_out", "norm_out")
        if ".mid.attn_1." in "." + n and n.endswith("weight") and v.dim() == 2:
            v = v[:, :, None, None]
        out["first_stage_model." + n] = v.clone().contiguous()
    return out


def main(root):
    out = os.path.join(root, "sd3_tiny_single_file_te")
    src = os.path.join(root, "sd3_tiny_text")
    tmp = tempfile.mkdtemp()

    clip_l0 = CLIPTextModelWithProjection.from_pretrained(os.path.join(src, "text_encoder"), torch_dtype=torch.float32)
    lcfg = clip_l0.config
    lcfg.projection_dim = lcfg.hidden_size
    clip_l = CLIPTextModelWithProjection(lcfg).eval()
    lsd = clip_l0.state_dict()
    lsd["text_projection.weight"] = torch.eye(lcfg.hidden_size)
    clip_l.load_state_dict(lsd)
    gcfg = CLIPTextModelWithProjection.config_class.from_pretrained(os.path.join(src, "text_encoder_2"))
    gcfg.hidden_size, gcfg.num_attention_heads, gcfg.projection_dim = 8, 1, 8
    clip_g = CLIPTextModelWithProjection(gcfg).eval()
    f16_exact_random(clip_g, 45)

    tcfg = T5Config.from_pretrained(os.path.join(root, "t5_tiny"))
    tcfg.relative_attention_max_distance = 128
    t5 = T5EncoderModel(tcfg).eval()
    f16_exact_random(t5, 43)
    t5_tok = T5TokenizerFast.from_pretrained(os.path.join(root, "t5_tiny"))

    xcfg = {k: v for k, v in json.load(open(os.path.join(src, "transformer", "config.json"))).items()
            if not k.startswith("_")}
    xcfg["pooled_projection_dim"] = clip_l.config.hidden_size + clip_g.config.projection_dim
    xcfg["joint_attention_dim"] = t5.config.d_model
    transformer = SD3Transformer2DModel(**xcfg).eval()
    f16_exact_random(transformer, 44)
    vae = AutoencoderKL.from_pretrained(os.path.join(src, "vae"), torch_dtype=torch.float32).eval()
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(os.path.join(src, "scheduler"))

    clip_vocab_files(os.path.join(root, "vocab", "bpe_simple_vocab_16e6.txt.gz"), tmp)
    tok = CLIPTokenizer(os.path.join(tmp, "vocab.json"), os.path.join(tmp, "merges.txt"),
                        pad_token="<|endoftext|>", model_max_length=77)
    tok_2 = CLIPTokenizer(os.path.join(tmp, "vocab.json"), os.path.join(tmp, "merges.txt"), pad_token="!",
                          model_max_length=77)
    pipe = StableDiffusion3Pipeline(transformer=transformer, vae=vae, scheduler=scheduler, text_encoder=clip_l,
                                    text_encoder_2=clip_g, text_encoder_3=t5, tokenizer=tok, tokenizer_2=tok_2,
                                    tokenizer_3=t5_tok)
    g = record_run(pipe, PROMPTS, NEGATIVE, STEPS, GUIDANCE, SEED, SIZE, MAX_SEQ)

    # The single file.
    sf = to_original(transformer.state_dict(), xcfg["num_layers"])
    levels = len(vae.config.block_out_channels)
    vsd = {k: v.half() for k, v in vae.state_dict().items()}  # float16 as sd3_tiny_text stores it (lossless)
    sf.update(vae_to_ldm(vsd, levels))
    for k, v in clip_l.state_dict().items():
        if k != "text_projection.weight" and "position_ids" not in k:
            sf["text_encoders.clip_l.transformer." + k] = v.half().contiguous()
    for k, v in clip_g.state_dict().items():
        if "position_ids" not in k:
            sf["text_encoders.clip_g.transformer." + k] = v.half().contiguous()
    for k, v in t5.state_dict().items():
        sf["text_encoders.t5xxl.transformer." + k] = v.half().contiguous().clone()
    for k, v in sf.items():  # every stored value is the model's own (float16-exact weights)
        assert v.dtype == torch.float32 or k.startswith(("first_stage_model.", "text_encoders.")), k
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, FILE)
    save_file(sf, path)

    # diffusers' converters give every model's weights back, bit for bit, nothing left over.
    file = load_file(path)
    back = convert_sd3_transformer_checkpoint_to_diffusers({k: v for k, v in file.items()
                                                            if k.startswith("model.diffusion_model.")})
    tsd = transformer.state_dict()
    assert set(back) == set(tsd), set(back) ^ set(tsd)
    assert all(torch.equal(back[k], tsd[k]) for k in tsd)
    vback = convert_ldm_vae_checkpoint({k: v for k, v in file.items() if k.startswith("first_stage_model.")},
                                       dict(vae.config))
    assert set(vback) == set(vsd), set(vback) ^ set(vsd)
    assert all(torch.equal(vback[k].reshape(vsd[k].shape), vsd[k]) for k in vsd)
    for prefix, model, extra in (("text_encoders.clip_l.transformer.", clip_l, {"text_projection.weight"}),
                                 ("text_encoders.clip_g.transformer.", clip_g, set())):
        cback = convert_ldm_clip_checkpoint(file, prefix)
        msd = {k: v for k, v in model.state_dict().items() if "position_ids" not in k}
        assert set(cback) | extra == set(msd), set(cback) ^ set(msd)
        assert all(torch.equal(cback[k].float(), msd[k]) for k in cback)
    t5back = convert_sd3_t5_checkpoint_to_diffusers(file)
    assert set(t5back) == set(t5.state_dict())
    assert all(torch.equal(t5back[k].float(), v) for k, v in t5.state_dict().items())

    # diffusers' own single-file loading of the whole pipeline (configs and tokenizers from the folder, as
    # from_single_file(config=...) takes them) gives the same run.
    folder = os.path.join(tmp, "folder")
    pipe.save_pretrained(folder)
    pipe_sf = StableDiffusion3Pipeline.from_single_file(path, config=folder, local_files_only=True,
                                                        torch_dtype=torch.float32)
    g_sf = record_run(pipe_sf, PROMPTS, NEGATIVE, STEPS, GUIDANCE, SEED, SIZE, MAX_SEQ)
    for k in g:
        assert torch.equal(g[k], g_sf[k]), (k, (g[k].float() - g_sf[k].float()).abs().max())

    te = os.path.join(out, "text_encoders", "tokenizer_3")  # t5_tiny's tokenizer files (links), not its goldens
    os.makedirs(te, exist_ok=True)
    for f in ("spiece.model", "tokenizer_config.json", "special_tokens_map.json"):
        if not os.path.lexists(os.path.join(te, f)):
            os.symlink(os.path.join("..", "..", "..", "t5_tiny", f), os.path.join(te, f))
    save_file({k: v.contiguous() for k, v in g.items()}, os.path.join(out, "golden_sd3_text.safetensors"))
    json.dump({"single_file": FILE, "text_encoders": "text_encoders",
               "prompts": PROMPTS, "negative_prompt": NEGATIVE, "num_inference_steps": STEPS,
               "guidance_scale": GUIDANCE, "height": SIZE, "width": SIZE, "generator_seed": SEED,
               "initial_latents": f"torch.randn((batch, 16, h/2, w/2), manual_seed({SEED})): the pipeline's first draw",
               "text_encoder_3": "T5EncoderModel", "max_sequence_length": MAX_SEQ,
               "recorded": "input_ids(_2, _3), negative_input_ids(_2, _3), prompt_embeds, negative_prompt_embeds, "
                           "pooled_prompt_embeds, negative_pooled_prompt_embeds, latents.<i> after step i, image",
               "verified": "diffusers 0.31.0 StableDiffusion3Pipeline.from_single_file(config=the folder) gives "
                           "every recorded tensor bit-identically; convert_sd3_transformer_checkpoint_to_diffusers, "
                           "convert_ldm_vae_checkpoint, convert_ldm_clip_checkpoint and "
                           "convert_sd3_t5_checkpoint_to_diffusers map every tensor back exactly"},
              open(os.path.join(out, "golden.json"), "w"), indent=1)
    shutil.rmtree(tmp)
    print(len(sf), "tensors;", {k: tuple(v.shape) for k, v in g.items()})


if __name__ == "__main__":
    main(sys.argv[1])
