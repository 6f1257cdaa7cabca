"""Writes the sd3_lora_tiny case: LoRAs on SD 3 / 3.5 (MMDiT) as diffusers + PEFT run them, on sd3_tiny_text's models
(the SD 3.5 Medium-style tiny transformer: QK RMSNorm, MMDiT-X blocks 0 and 1; read from ../sd3_tiny_text, not
copied).

usage: /tmp/dl3/bin/python make_sd3_lora_tiny.py SD_GOLDEN_DIR   (tests/golden/sd; diffusers 0.32.2, peft 0.10.0,
transformers 4.38.2 on torch 1.13 CPU float32, one thread; F.scaled_dot_product_attention as in sd3_tiny)

What it writes (every number the checker uses is in golden.json):
* lora_peft.safetensors: a random LoRA (non-zero A and B) made by PEFT's LoraConfig on the transformer (every joint
  block's attention incl. attn2, both MLPs, both adaLN modulations, norm_out, proj_out, context_embedder, the patch
  embedding's convolution) and on both CLIP encoders, in diffusers' SD 3 file names (`transformer.` /
  `text_encoder.` / `text_encoder_2.` + module + `.lora_A.weight` / `.lora_B.weight`), with the LoraConfig in the
  header as current diffusers writes it (`lora_adapter_metadata`: lora_alpha != r, an alpha_pattern entry). The
  references are PEFT's own forward (base + scale * m * B(A(x)), m through diffusers' `joint_attention_kwargs
  {"scale": m}` / encode_prompt's lora_scale).
* lora_peft_nometa.safetensors: the same tensors without the header; loaded by diffusers 0.32.2's own
  `load_lora_weights` (no alpha: alpha = rank), reference at multiplier 1.
* lora_kohya.safetensors: the transformer part of the same LoRA in kohya/sd-scripts' SD 3 names (Stability's
  single-file modules, `lora_unet_joint_blocks_N_x_block_attn_qkv` fused over q, k, v with a block-diagonal up,
  (shift, scale) rows of the last context block's and the final layer's modulation, alphas of several kinds). Its
  reference is merged the way sd-scripts / ComfyUI merge it: into the single-file weights (to_original of
  ../../sd3_tiny_single_file, checked there against diffusers' converter), W += m * alpha / rank * up @ down, then
  diffusers' convert_sd3_transformer_checkpoint_to_diffusers and SD3Transformer2DModel's forward. The generator
  asserts that this merge equals to_original of the PEFT deltas merged in diffusers' layout.
* golden_sd3_lora.safetensors: the transformer's inputs (batch 2), its output without LoRA and with each LoRA at
  each multiplier, and a StableDiffusion3Pipeline run with lora_peft at a multiplier (ids, prompt embeddings, the
  latents after every step, the image) for teacher-forced and free-running checks.
Tolerances: every output is also computed in float64; golden.json holds the float32-float64 distance measured and
the tolerances derived from it (x 20, at least 1e-5).
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
# diffusers 0.32 names torch 2.1's float8 dtypes at import and uses torch.compiler's decorator; torch 1.13 has neither
# (never on the computed path).
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if not hasattr(torch, _name):
        setattr(torch, _name, torch.float16)
if not hasattr(torch, "compiler"):
    import types

    torch.compiler = types.SimpleNamespace(disable=lambda fn=None, **kw: fn if fn is not None else (lambda f: f))

import transformers  # noqa: E402
from transformers.image_processing_utils import BaseImageProcessor  # noqa: E402

transformers.BaseImageProcessor = BaseImageProcessor
import diffusers  # noqa: E402
from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline  # noqa: E402
from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers  # noqa: E402
from peft import LoraConfig, get_peft_model_state_dict  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "sd3_tiny_t5", "generate"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "sd3_tiny_single_file"))
from sd3_tiny_run import tiny_pipeline, token_ids  # noqa: E402
from make_sd3_single_file import to_original  # noqa: E402

SEED = 63
RANK, ALPHA = 4, 8.0  # transformer: scale alpha / r = 2
ALPHA_PATTERN = {"proj_out": 2.0}  # scale 0.5 for proj_out
TE_RANK, TE_ALPHA = 2, 3.0
TRANSFORMER_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                       "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "norm1.linear",
                       "norm1_context.linear", "norm_out.linear", "proj_out", "context_embedder", "pos_embed.proj"]
TE_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
MULTIPLIERS = [1.0, 0.6]
PIPE = dict(prompts=["a photo of a cat on a red sofa", "two small dogs running on the beach at sunset"],
            negative_prompt="blurry, low quality", num_inference_steps=8, guidance_scale=4.5, height=16, width=16,
            generator_seed=41, max_sequence_length=256, multiplier=0.7)


def randomize_lora(module, gen, std):
    for n, p in module.named_parameters():
        if "lora_" in n:
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def transformer_inputs(cfg, gen, dtype=torch.float32):
    b, s = 2, 4  # 8x8 latents: a 4x4 patch grid
    return dict(hidden_states=torch.randn((b, cfg["in_channels"], 2 * s, 2 * s), generator=gen),
                encoder_hidden_states=torch.randn((b, 12, cfg["joint_attention_dim"]), generator=gen),
                pooled_projections=torch.randn((b, cfg["pooled_projection_dim"]), generator=gen),
                timestep=torch.tensor([700.0, 125.0]))


def run_transformer(model, inputs, scale, dtype=torch.float32):
    model = model.to(dtype)
    kw = {k: v.to(dtype) for k, v in inputs.items()}
    with torch.no_grad():
        out = model(**kw, joint_attention_kwargs={"scale": scale} if scale is not None else None).sample
    model.to(torch.float32)
    return out


# kohya/sd-scripts' SD 3 modules: Stability's single-file name of each diffusers LoRA module, the modules fused into
# one (q, k, v of a qkv), and the modulations stored as (shift, scale).
def kohya_groups(num_layers, dual):
    g = {"x_embedder.proj": ["pos_embed.proj"], "context_embedder": ["context_embedder"],
         "final_layer.linear": ["proj_out"], "final_layer.adaLN_modulation.1": ["norm_out.linear"]}
    swapped = {"final_layer.adaLN_modulation.1"}
    for i in range(num_layers):
        d, x, c = f"transformer_blocks.{i}", f"joint_blocks.{i}.x_block", f"joint_blocks.{i}.context_block"
        g[f"{x}.attn.qkv"] = [f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v"]
        g[f"{c}.attn.qkv"] = [f"{d}.attn.add_q_proj", f"{d}.attn.add_k_proj", f"{d}.attn.add_v_proj"]
        g[f"{x}.attn.proj"] = [f"{d}.attn.to_out.0"]
        if i < num_layers - 1:
            g[f"{c}.attn.proj"] = [f"{d}.attn.to_add_out"]
            g[f"{c}.mlp.fc1"] = [f"{d}.ff_context.net.0.proj"]
            g[f"{c}.mlp.fc2"] = [f"{d}.ff_context.net.2"]
        if i in dual:
            g[f"{x}.attn2.qkv"] = [f"{d}.attn2.to_q", f"{d}.attn2.to_k", f"{d}.attn2.to_v"]
            g[f"{x}.attn2.proj"] = [f"{d}.attn2.to_out.0"]
        g[f"{x}.adaLN_modulation.1"] = [f"{d}.norm1.linear"]
        g[f"{c}.adaLN_modulation.1"] = [f"{d}.norm1_context.linear"]
        if i == num_layers - 1:
            swapped.add(f"{c}.adaLN_modulation.1")
        g[f"{x}.mlp.fc1"] = [f"{d}.ff.net.0.proj"]
        g[f"{x}.mlp.fc2"] = [f"{d}.ff.net.2"]
    return g, swapped


def swap_halves(t):
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def peft_scale(module):
    return next((a for k, a in ALPHA_PATTERN.items() if module == k or module.endswith("." + k)), ALPHA) / RANK


def to_kohya(peft_sd, num_layers, dual):
    """The transformer LoRA in kohya names: {lora_unet_<orig>.lora_down.weight, .lora_up.weight, .alpha}; the delta
    of each kohya module, alpha / rank * up @ down, is the PEFT modules' scale * B @ A in the original rows."""
    groups, swapped = kohya_groups(num_layers, dual)
    out, kinds = {}, []
    for i, (orig, mods) in enumerate(sorted(groups.items())):
        A = [peft_sd[f"{m}.lora_A.weight"] for m in mods]
        B = [peft_sd[f"{m}.lora_B.weight"] for m in mods]
        s = [peft_scale(m) for m in mods]
        assert len(set(s)) == 1
        s = s[0]
        key = "lora_unet_" + orig.replace(".", "_")
        if len(mods) > 1:  # fused qkv: down stacks the A's, up is block-diagonal
            down = torch.cat(A, 0)
            up = torch.block_diag(*[b.flatten(1) for b in B])
            out[key + ".alpha"] = torch.tensor(s * down.shape[0])
            kinds.append("fused")
        else:
            down, up = A[0], B[0]
            if orig in swapped:
                up = swap_halves(up)
            if i % 3 == 0:  # alpha folded into up, none stored (alpha = rank)
                up = up * s
                kinds.append("no alpha")
            elif i % 3 == 1:  # up x 2, alpha halved
                up = up * 2
                out[key + ".alpha"] = torch.tensor(s * RANK / 2)
                kinds.append("alpha")
            else:
                out[key + ".alpha"] = torch.tensor(s * RANK)
                kinds.append("alpha")
        out[key + ".lora_down.weight"] = down.contiguous()
        out[key + ".lora_up.weight"] = up.contiguous()
    return out


def kohya_merged_original(original, kohya, m, dtype):
    """sd-scripts / ComfyUI's merge into the single-file weights."""
    w = {k: v.to(dtype).clone() for k, v in original.items()}
    for k in kohya:
        if not k.endswith(".lora_down.weight"):
            continue
        stem = k[: -len(".lora_down.weight")]
        down, up = kohya[k].to(dtype), kohya[stem + ".lora_up.weight"].to(dtype)
        rank = down.shape[0]
        alpha = kohya[stem + ".alpha"].item() if stem + ".alpha" in kohya else rank
        name = None
        for n in w:
            if n.endswith(".weight") and "lora_unet_" + n[len("model.diffusion_model."):-7].replace(".", "_") == stem:
                name = n
        assert name is not None, stem
        delta = (up.flatten(1) @ down.flatten(1)).reshape(w[name].shape)
        w[name] += m * alpha / rank * delta
    return w


def transformer_from_original(cfg, original, dtype):
    sd = convert_sd3_transformer_checkpoint_to_diffusers({k: v.to(torch.float32) for k, v in original.items()})
    model = SD3Transformer2DModel.from_config(cfg)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("pos_embed.pos_embed" == k for k in missing), (missing, unexpected)
    if dtype != torch.float32:  # convert_* works in float32; load the float64 merge exactly
        model = model.to(dtype)
        sd64 = convert_sd3_transformer_checkpoint_to_diffusers(dict(original))
        model.load_state_dict({k: v.to(dtype) for k, v in sd64.items()}, strict=False)
    return model.eval()


def record_pipeline(pipe, m, dtype=torch.float32):
    """The pipeline run; with dtype float64 the transformer and VAE run in it (the CLIP encoders' causal mask does not
    take float64 in transformers 4.38: their float32 embeddings are passed in, as float64)."""
    P = PIPE
    g = {}
    for name, t in (("input_ids", pipe.tokenizer), ("input_ids_2", pipe.tokenizer_2)):
        g[name] = token_ids(t, P["prompts"], 77)
        g["negative_" + name] = token_ids(t, [P["negative_prompt"]] * len(P["prompts"]), 77)
    with torch.no_grad():
        pe, npe, pp, npp = pipe.encode_prompt(P["prompts"], None, None, negative_prompt=P["negative_prompt"],
                                              do_classifier_free_guidance=True,
                                              max_sequence_length=P["max_sequence_length"], lora_scale=m)
    g.update(prompt_embeds=pe, negative_prompt_embeds=npe, pooled_prompt_embeds=pp, negative_pooled_prompt_embeds=npp)

    def on_step(p, i, t, kw):
        g[f"latents.{i}"] = kw["latents"].clone()
        return {}

    f = pipe.vae_scale_factor
    g["initial_latents"] = torch.randn((len(P["prompts"]), 16, P["height"] // f, P["width"] // f),
                                       generator=torch.Generator().manual_seed(P["generator_seed"]))
    embeds = {}
    if dtype != torch.float32:
        embeds = dict(prompt_embeds=pe.to(dtype), negative_prompt_embeds=npe.to(dtype),
                      pooled_prompt_embeds=pp.to(dtype), negative_pooled_prompt_embeds=npp.to(dtype))
    with torch.no_grad():
        g["image"] = pipe(None if embeds else P["prompts"], negative_prompt=None if embeds else P["negative_prompt"],
                          **embeds, num_inference_steps=P["num_inference_steps"], guidance_scale=P["guidance_scale"],
                          height=P["height"], width=P["width"],
                          generator=torch.Generator().manual_seed(P["generator_seed"]), output_type="pt",
                          max_sequence_length=P["max_sequence_length"], joint_attention_kwargs={"scale": m},
                          callback_on_step_end=on_step, latents=g["initial_latents"].to(dtype)).images
    return g


def tol(measured):
    return max(1e-5, 20 * measured)


def main(root):
    assert diffusers.__version__ == "0.32.2", diffusers.__version__
    src, out = os.path.join(root, "sd3_tiny_text"), os.path.join(root, "sd3_lora_tiny")
    os.makedirs(out, exist_ok=True)
    tmp = tempfile.mkdtemp()
    bpe = os.path.join(root, "vocab", "bpe_simple_vocab_16e6.txt.gz")
    cfg = dict(SD3Transformer2DModel.load_config(os.path.join(src, "transformer")))
    gen = torch.Generator().manual_seed(SEED)
    inputs = transformer_inputs(cfg, gen)
    g = {f"inputs.{k}": v for k, v in inputs.items()}
    meas = {}

    # The LoRA: PEFT adapters on the transformer and both CLIP encoders, random A and B.
    pipe = tiny_pipeline(src, bpe, tmp)
    base_sd = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    g["base.out"] = run_transformer(pipe.transformer, inputs, None)
    tcfg = LoraConfig(r=RANK, lora_alpha=ALPHA, alpha_pattern=ALPHA_PATTERN, target_modules=TRANSFORMER_TARGETS,
                      init_lora_weights=False)
    def te_config():
        return LoraConfig(r=TE_RANK, lora_alpha=TE_ALPHA, target_modules=TE_TARGETS, init_lora_weights=False)

    te_cfg = te_config()
    pipe.transformer.add_adapter(tcfg)
    pipe.text_encoder.add_adapter(te_cfg)
    pipe.text_encoder_2.add_adapter(te_config())
    randomize_lora(pipe.transformer, gen, 0.1)
    randomize_lora(pipe.text_encoder, gen, 0.2)
    randomize_lora(pipe.text_encoder_2, gen, 0.2)
    layers = {"transformer": get_peft_model_state_dict(pipe.transformer),
              "text_encoder": get_peft_model_state_dict(pipe.text_encoder),
              "text_encoder_2": get_peft_model_state_dict(pipe.text_encoder_2)}
    StableDiffusion3Pipeline.save_lora_weights(tmp, transformer_lora_layers=layers["transformer"],
                                               text_encoder_lora_layers=layers["text_encoder"],
                                               text_encoder_2_lora_layers=layers["text_encoder_2"],
                                               weight_name="lora.safetensors")
    tensors = load_file(os.path.join(tmp, "lora.safetensors"))
    assert all(k.split(".")[0] in layers for k in tensors), sorted(tensors)[:4]
    # current diffusers' header: {"<component>.<LoraConfig field>": value} under lora_adapter_metadata
    meta = {}
    for comp, c in (("transformer", tcfg), ("text_encoder", te_cfg), ("text_encoder_2", te_cfg)):
        d = c.to_dict()
        for k in ("r", "lora_alpha", "alpha_pattern", "rank_pattern", "use_rslora", "use_dora", "target_modules",
                  "lora_dropout", "bias", "init_lora_weights"):
            v = d.get(k)
            meta[f"{comp}.{k}"] = sorted(v) if isinstance(v, set) else v
    save_file(tensors, os.path.join(out, "lora_peft.safetensors"),
              metadata={"format": "pt", "lora_adapter_metadata": json.dumps(meta, indent=2, sort_keys=True)})
    save_file(tensors, os.path.join(out, "lora_peft_nometa.safetensors"), metadata={"format": "pt"})

    # PEFT's forward at each multiplier, float32 and float64.
    recs = []  # (tensor, lora, multiplier)
    for m in MULTIPLIERS:
        recs.append((f"peft.x{m:g}.out", "peft", m))
        g[f"peft.x{m:g}.out"] = run_transformer(pipe.transformer, inputs, m)
        o64 = run_transformer(pipe.transformer, inputs, m, torch.float64)
        meas[f"peft.x{m:g}.out"] = (g[f"peft.x{m:g}.out"].double() - o64).abs().max().item()

    # kohya: the same transformer LoRA in sd-scripts' SD 3 names, merged into the single-file weights.
    num_layers, dual = cfg["num_layers"], set(cfg.get("dual_attention_layers") or [])
    peft_t = {k[len("transformer."):]: v for k, v in tensors.items() if k.startswith("transformer.")}
    kohya = to_kohya(peft_t, num_layers, dual)
    save_file(kohya, os.path.join(out, "lora_kohya.safetensors"), metadata={"format": "pt", "ss_network_module":
                                                                             "networks.lora_sd3"})
    original = to_original(base_sd, num_layers)
    # the kohya merge equals the PEFT deltas merged in diffusers' layout, then to_original
    merged_d = {k: v.double().clone() for k, v in base_sd.items()}
    for k in peft_t:
        if k.endswith(".lora_A.weight"):
            mod = k[: -len(".lora_A.weight")]
            a, b = peft_t[k].double(), peft_t[mod + ".lora_B.weight"].double()
            w = merged_d[mod + ".weight"]
            w += peft_scale(mod) * (b.flatten(1) @ a.flatten(1)).reshape(w.shape)
    via_d = to_original(merged_d, num_layers)
    via_k = kohya_merged_original(original, kohya, 1.0, torch.float64)
    assert set(via_d) == set(via_k)
    agree = max((via_d[k] - via_k[k]).abs().max().item() for k in via_d)
    assert agree < 1e-12, agree
    for m in MULTIPLIERS:
        recs.append((f"kohya.x{m:g}.out", "kohya", m))
        model = transformer_from_original(cfg, kohya_merged_original(original, kohya, m, torch.float32), torch.float32)
        g[f"kohya.x{m:g}.out"] = run_transformer(model, inputs, None)
        m64 = transformer_from_original(cfg, kohya_merged_original(original, kohya, m, torch.float64), torch.float64)
        o64 = run_transformer(m64, inputs, None, torch.float64)
        meas[f"kohya.x{m:g}.out"] = (g[f"kohya.x{m:g}.out"].double() - o64).abs().max().item()

    # The pipeline with the PEFT LoRA at PIPE's multiplier.
    gp = record_pipeline(pipe, PIPE["multiplier"])
    g.update({f"pipeline.{k}": v for k, v in gp.items()})
    last = f"latents.{PIPE['num_inference_steps'] - 1}"
    pipe.transformer.to(torch.float64)
    pipe.vae.to(torch.float64)
    g64 = record_pipeline(pipe, PIPE["multiplier"], torch.float64)
    pipe.transformer.to(torch.float32)
    pipe.vae.to(torch.float32)
    pipe_meas = {"latents.0": (gp["latents.0"].double() - g64["latents.0"]).abs().max().item(),
                 "final_latents_rel": ((gp[last].double() - g64[last]).abs().max() / g64[last].abs().max()).item(),
                 "image": (gp["image"].double() - g64["image"]).abs().max().item()}

    # diffusers 0.32.2's own loader on the file without a header: alpha = rank.
    pipe2 = tiny_pipeline(src, bpe, tmp)
    pipe2.load_lora_weights(os.path.join(out, "lora_peft_nometa.safetensors"))
    recs.append(("peft_nometa.x1.out", "peft_nometa", 1.0))
    g["peft_nometa.x1.out"] = run_transformer(pipe2.transformer, inputs, 1.0)
    o64 = run_transformer(pipe2.transformer, inputs, 1.0, torch.float64)
    meas["peft_nometa.x1.out"] = (g["peft_nometa.x1.out"].double() - o64).abs().max().item()

    save_file({k: v.contiguous() for k, v in g.items()}, os.path.join(out, "golden_sd3_lora.safetensors"))
    base = g["base.out"]
    outputs = []
    for name, lora, mult in recs:
        outputs.append({"tensor": name, "lora": lora, "multiplier": mult,
                        "f32_vs_f64_max_abs": meas[name], "atol": tol(meas[name]), "rtol": 1e-4,
                        "vs_base_max_abs": (g[name] - base).abs().max().item()})
    P = dict(PIPE)
    P.update(lora="peft", f32_vs_f64=pipe_meas, atol=tol(pipe_meas["latents.0"]), rtol=1e-4,
             free_running_latents_rel=max(1e-4, 20 * pipe_meas["final_latents_rel"]),
             free_running_image_atol=max(1e-4, 20 * pipe_meas["image"]),
             recorded="pipeline.{input_ids(_2), negative_input_ids(_2), prompt_embeds, negative_prompt_embeds, "
                      "pooled_prompt_embeds, negative_pooled_prompt_embeds, initial_latents, latents.<i> after step "
                      "i, image}")
    json.dump({
        "models": "../sd3_tiny_text",
        "generator": f"diffusers {diffusers.__version__}, peft 0.10.0, transformers {transformers.__version__}, "
                     f"torch {torch.__version__}, float32, one thread",
        "loras": {
            "peft": {"file": "lora_peft.safetensors", "format": "peft",
                     "scale": f"transformer lora_alpha / r = {ALPHA:g} / {RANK} (proj_out {ALPHA_PATTERN['proj_out']:g} / "
                              f"{RANK}); text encoders {TE_ALPHA:g} / {TE_RANK}, from the header's lora_adapter_metadata"},
            "peft_nometa": {"file": "lora_peft_nometa.safetensors", "format": "peft",
                            "scale": "alpha = rank (no header; diffusers' load_lora_weights)"},
            "kohya": {"file": "lora_kohya.safetensors", "format": "kohya",
                      "scale": "the stored .alpha / rank, rank where none"},
        },
        "transformer": {"inputs": ["inputs.hidden_states", "inputs.encoder_hidden_states",
                                   "inputs.pooled_projections", "inputs.timestep"],
                        "base": "base.out", "outputs": outputs},
        "pipeline": P,
    }, open(os.path.join(out, "golden.json"), "w"), indent=1)
    shutil.rmtree(tmp)
    print(json.dumps(outputs, indent=1))
    print({k: tuple(v.shape) for k, v in g.items() if not k.startswith("pipeline.latents")})


if __name__ == "__main__":
    main(sys.argv[1])
