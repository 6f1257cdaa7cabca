#!/usr/bin/env python3
"""Golden cases of the published masked-diffusion LM families (DiffuGPT, LLaDA, Dream) on tiny random configs.

References (float32, one thread):
- forward: Hugging Face transformers' own decoders with the causal mask removed, which is what each family's code
  does: DiffuGPT (HKUNLP/DiffuLLaMA model.py) fills GPT-2's `attn.bias` with True; LLaDA's modelling code is LLaMA's
  block (RMSNorm, SwiGLU, RoPE) with `is_causal=False`; Dream's is Qwen2's (q/k/v biases) with full attention. Each
  forward is checked here against an independent plain-torch forward written from the configs (assert below).
- samplers: written from the published samplers (DiffuGPT generate_samples, LLaDA generate.py, Dream's
  diffusion_generate restated from its generation_utils.py: see dream_sample), with every random draw recorded in the
  case so the C++ side replays the same draws.

- GGUF: each LLaDA / Dream case also as model-f32.gguf and model-q8_0.gguf under llama.cpp's tensor and metadata names
  (gguf-py's tables; LLaDA's q/k rows interleaved as llama.cpp's converter stores them), with the logits of each
  file's weights through the same reference decoder.

Run: OMP_NUM_THREADS=1 PYTHONPATH=<dir holding only gguf-py's `gguf` package> /tmp/d63/bin/python \
       tests/golden/text/dlm/generate/generate_dlm.py          (transformers 4.38, torch 1.13, gguf-py 0.19)
"""
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import transformers
import transformers.models.qwen2.modeling_qwen2 as qwen2_mod
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

torch.set_num_threads(1)
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
FINFO_MIN = torch.finfo(torch.float32).min


def randomize(model, seed, std=0.25):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))


# ---- independent plain-torch forwards (cross-check of the transformers references) ----------------------------------

def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, theta):  # x [B, H, L, d], rotate-half
    L, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
    f = torch.outer(torch.arange(L).float(), inv)
    emb = torch.cat([f, f], -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * emb.cos() + torch.cat([-x2, x1], -1) * emb.sin()


def llama_like_forward(sd, cfg, ids):
    H, KV, D = cfg["heads"], cfg["kv_heads"], cfg["hidden"]
    d = D // H
    x = sd["embed"][ids]
    B, L, _ = x.shape
    for i in range(cfg["layers"]):
        p = lambda n: sd[f"l{i}.{n}"]
        h = rms(x, p("in_norm"), cfg["eps"])
        q = h @ p("q").T + (p("qb") if f"l{i}.qb" in sd else 0)
        k = h @ p("k").T + (p("kb") if f"l{i}.kb" in sd else 0)
        v = h @ p("v").T + (p("vb") if f"l{i}.vb" in sd else 0)
        q = q.view(B, L, H, d).transpose(1, 2)
        k = k.view(B, L, KV, d).transpose(1, 2).repeat_interleave(H // KV, 1)
        v = v.view(B, L, KV, d).transpose(1, 2).repeat_interleave(H // KV, 1)
        q, k = rope(q, cfg["theta"]), rope(k, cfg["theta"])
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), -1) @ v
        x = x + a.transpose(1, 2).reshape(B, L, D) @ p("o").T
        h = rms(x, p("post_norm"), cfg["eps"])
        x = x + (F.silu(h @ p("gate").T) * (h @ p("up").T)) @ p("down").T
    return rms(x, sd["norm"], cfg["eps"]) @ sd["head"].T


def gpt2_forward(sd, n_head, eps, ids):
    x = sd["wte.weight"][ids] + sd["wpe.weight"][: ids.shape[1]]
    B, L, C = x.shape
    d = C // n_head
    i = 0
    while f"h.{i}.ln_1.weight" in sd:
        g = lambda n: sd[f"h.{i}.{n}"]
        h = F.layer_norm(x, (C,), g("ln_1.weight"), g("ln_1.bias"), eps)
        qkv = h @ g("attn.c_attn.weight") + g("attn.c_attn.bias")
        q, k, v = [t.view(B, L, n_head, d).transpose(1, 2) for t in qkv.split(C, -1)]
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), -1) @ v
        x = x + a.transpose(1, 2).reshape(B, L, C) @ g("attn.c_proj.weight") + g("attn.c_proj.bias")
        h = F.layer_norm(x, (C,), g("ln_2.weight"), g("ln_2.bias"), eps)
        f = F.gelu(h @ g("mlp.c_fc.weight") + g("mlp.c_fc.bias"), approximate="tanh")
        x = x + f @ g("mlp.c_proj.weight") + g("mlp.c_proj.bias")
        i += 1
    x = F.layer_norm(x, (C,), sd["ln_f.weight"], sd["ln_f.bias"], eps)
    return x @ sd["wte.weight"].T


# ---- samplers --------------------------------------------------------------------------------------------------------

def top_p_filter(logits, p):
    """Nucleus filter as DiffuGPT's / Dream's top_p_logits: keep the smallest prefix of the sorted vocabulary whose
    probability reaches p (the first token always), the rest at float32's lowest."""
    s, idx = torch.sort(logits, descending=True)
    cum = torch.cumsum(F.softmax(s, -1), -1)
    remove = cum > p
    remove[..., 1:] = remove[..., :-1].clone()
    remove[..., 0] = False
    mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, idx, remove)
    return logits.masked_fill(mask, FINFO_MIN)


def top_k_filter(logits, k):
    kth = torch.topk(logits, k)[0][..., -1, None]
    return logits.masked_fill(logits < kth, FINFO_MIN)


class Draws:
    """Uniform draws in call order, kept for the case (the C++ sampler replays them)."""

    def __init__(self, seed):
        self.g = torch.Generator().manual_seed(seed)
        self.tensors = []

    def uniform(self, shape, dtype=torch.float32):
        u = torch.rand(shape, generator=self.g, dtype=torch.float64).to(dtype)
        u = u.clamp_min(torch.finfo(dtype).tiny)  # log(0) never drawn
        self.tensors.append(u)
        return u


def diffugpt_sample(logits_fn, x, src_mask, mask_id, steps, temp, top_p, draws, gaps):
    """DiffuGPT generate_samples (shift=True): every non-source position starts as [MASK]; at step t (T-1 .. 1) each
    still-maskable position takes its current x0 proposal with probability 1/(t+1); proposals are drawn from
    softmax(top_p(logits / temp)) (here by Gumbel-max over recorded uniforms) and shifted right by one position."""
    maskable = ~src_mask
    xt = x.masked_fill(maskable, mask_id)

    def propose(xt, maskable):
        logits = logits_fn(xt)
        scores = torch.log_softmax(top_p_filter(logits / temp, top_p), -1)
        u = draws.uniform(scores.shape)
        noisy = scores - torch.log(-torch.log(u))
        top2 = noisy.topk(2, -1)[0]
        gaps.append((top2[..., 0] - top2[..., 1]).min().item())
        x0 = noisy.argmax(-1)
        x0 = torch.cat([x[:, :1], x0[:, :-1]], 1)  # the shift: position i takes the prediction made at i - 1
        return xt.masked_scatter(maskable, x0[maskable])

    x0 = propose(xt, maskable)
    for t in range(steps - 1, 0, -1):
        u = draws.uniform(x0.shape)
        gaps.append((u - 1.0 / (t + 1)).abs().min().item())
        move = maskable & (u < 1.0 / (t + 1))
        xt = xt.clone()
        xt[move] = x0[move]
        maskable = maskable & ~move
        x0 = propose(xt, maskable)
    return x0


def llada_sample(logits_fn, prompt, mask_id, steps, gen_length, block_length, temperature, remasking, draws, gaps):
    """LLaDA generate.py (cfg_scale 0): semi-autoregressive blocks; per block steps/num_blocks steps; each step
    transfers the get_num_transfer_tokens count of the block's masks with the highest confidence (softmax probability
    of the Gumbel-max token, or a uniform draw for 'random'); positions after the block are never transferred."""
    P = prompt.shape[1]
    x = torch.full((1, P + gen_length), mask_id, dtype=torch.long)
    x[:, :P] = prompt
    nb = gen_length // block_length
    spb = steps // nb
    for b in range(nb):
        lo, hi = P + b * block_length, P + (b + 1) * block_length
        n_mask = int((x[:, lo:hi] == mask_id).sum())
        counts = [n_mask // spb + (1 if i < n_mask % spb else 0) for i in range(spb)]
        for i in range(spb):
            mask_index = x == mask_id
            logits = logits_fn(x)
            if temperature == 0:
                noisy = logits
            else:
                l64 = logits.to(torch.float64)
                noise = draws.uniform(l64.shape, torch.float64)
                noisy = l64.exp() / (-torch.log(noise)) ** temperature
            top2 = noisy.topk(2, -1)[0]
            gaps.append(((top2[..., 0] - top2[..., 1]) / top2[..., 0].abs().clamp_min(1e-30))[mask_index].min().item())
            x0 = noisy.argmax(-1)
            if remasking == "low_confidence":
                x0_p = torch.gather(F.softmax(logits, -1), -1, x0.unsqueeze(-1)).squeeze(-1)
            else:
                x0_p = draws.uniform(x0.shape)
            x0_p[:, hi:] = -math.inf
            x0 = torch.where(mask_index, x0, x)
            conf = torch.where(mask_index, x0_p.to(torch.float64), torch.tensor(-math.inf, dtype=torch.float64))
            k = counts[i]
            vals, sel = torch.topk(conf[0], k=k + 1 if k + 1 <= conf.shape[1] else k)
            if k + 1 <= conf.shape[1] and vals[k] > -math.inf:
                gaps.append((vals[k - 1] - vals[k]).item() if k > 0 else 1.0)
            x[0, sel[:k]] = x0[0, sel[:k]]
    return x


def dream_sample(logits_fn, prompt, mask_id, gen_length, steps, eps, temperature, top_p, top_k, alg, alg_temp, draws,
                 gaps):
    """Dream's diffusion_generate, restated step for step from `DreamGenerationMixin._sample` and `sample_tokens` in
    the Hub repository Dream-org/Dream-v0-Instruct-7B, generation_utils.py (read as vendored unchanged in
    ZHZisZZ/dllm at 81c80162c35bc308ac46faae13d3af5731f29ad5, dllm/pipelines/dream/models/generation_utils.py), for
    one unpadded prompt (its attention_mask has no zero: attention "full", tok_idx None, positions 0..L-1).

    The answer is padded with [MASK] to max_length; each step reads the logits shifted right by one (the logits at
    i - 1 predict token i) at every position equal to [MASK] (prompt positions included) and, on the time grid
    linspace(1, eps, steps + 1) in float32:
    - origin: each mask draws torch.rand < 1 - s/t (1 at the last step); the drawn ones take sample_tokens' token;
    - maskgit_plus / topk_margin / entropy: confidence = probability of the sampled token / top1 - top2 /
      sum p log(p + 1e-10); int(masks * (1 - s/t)) positions (all masks at the last step) are committed, the top-k
      confidences (alg_temp None or 0) or torch.multinomial(softmax(confidence / alg_temp), n) without replacement.
    Random draws are recorded as uniforms u, in the reference's call order:
    - dists.Categorical(probs).sample() is torch.multinomial(probs / probs.sum(-1), 1, True), which torch computes
      (since 2.1; Dream pins torch 2.5.1) as argmax(p / q) with q ~ Exp(1); here q = -log(u);
    - torch.multinomial without replacement is topk(p / q, n), the same q;
    - torch.rand is u itself (drawn here as float64 rounded to float32, never 0).
    sample_tokens' fallback to the arg max when Categorical refuses its probs (validate_args: a row, after
    Categorical's own normalisation, not summing to 1 within 1e-6) is not restated: float32 rows pass that check."""
    x = F.pad(prompt, (0, gen_length), value=mask_id)
    timesteps = torch.linspace(1, eps, steps + 1)

    def sample_tokens(logits, margin_confidence=False, neg_entropy=False):
        if temperature > 0:
            logits = logits / temperature
        if top_p is not None and top_p < 1:
            logits = top_p_filter(logits, top_p)
        if top_k is not None:
            logits = top_k_filter(logits, top_k)
        probs = torch.softmax(logits, dim=-1)
        if temperature > 0:
            q = -torch.log(draws.uniform(probs.shape))
            ratio = (probs / probs.sum(-1, keepdim=True)) / q
            x0 = ratio.argmax(-1)
            confidence = torch.gather(probs, -1, x0.unsqueeze(-1)).squeeze(-1)
            top2 = torch.log(ratio).topk(2, -1)[0]  # relative margin of the draw
        else:
            confidence, x0 = probs.max(dim=-1)
            top2 = probs.topk(2, -1)[0]
        gaps.append((top2[:, 0] - top2[:, 1]).min().item() if top2.shape[0] else 1.0)
        if margin_confidence:
            sorted_probs, _ = torch.sort(probs, dim=-1, descending=True)
            confidence = sorted_probs[:, 0] - sorted_probs[:, 1]
        if neg_entropy:
            confidence = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
        return confidence, x0

    for i in range(steps):
        mask_index = x == mask_id
        logits = logits_fn(x)
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        mask_logits = logits[mask_index]
        t = timesteps[i]
        s = timesteps[i + 1]
        if alg == "origin":
            p_transfer = 1 - s / t if i < steps - 1 else 1
            x0 = torch.zeros_like(x[mask_index], dtype=torch.long) + mask_id
            u = draws.uniform(x0.shape)
            transfer_index_t_s = u < p_transfer
            gaps.append((u - p_transfer).abs().min().item() if i < steps - 1 and u.numel() else 1.0)
            _, x0[transfer_index_t_s] = sample_tokens(mask_logits[transfer_index_t_s])
            x[mask_index] = x0.clone()
        else:
            if alg == "maskgit_plus":
                confidence, x0 = sample_tokens(mask_logits)
            elif alg == "topk_margin":
                confidence, x0 = sample_tokens(mask_logits, margin_confidence=True)
            elif alg == "entropy":
                confidence, x0 = sample_tokens(mask_logits, neg_entropy=True)
            else:
                raise RuntimeError(f"Unknown alg: {alg}")
            num_mask_token = mask_index.sum() / mask_index.shape[0]
            number_transfer_tokens = int(num_mask_token * (1 - s / t)) if i < steps - 1 else int(num_mask_token)
            full_confidence = torch.full_like(x, -torch.inf, dtype=logits.dtype)
            full_confidence[mask_index] = confidence
            if number_transfer_tokens > 0:
                n = number_transfer_tokens
                if alg_temp is None or alg_temp == 0:
                    scores = full_confidence
                else:
                    full_confidence = F.softmax(full_confidence / alg_temp, dim=-1)
                    scores = full_confidence / -torch.log(draws.uniform(full_confidence.shape))
                _, transfer_index = torch.topk(scores, n)
                # Margin between the last committed and the first left position (not part of the reference).
                vals = torch.topk(scores[0], min(n + 1, scores.shape[1]))[0]
                if alg_temp is None or alg_temp == 0:
                    if n < vals.shape[0] and vals[n] > -math.inf:
                        gaps.append((vals[n - 1] - vals[n]).item())
                elif n < vals.shape[0] and vals[n] > 0:
                    gaps.append((torch.log(vals[n - 1]) - torch.log(vals[n])).item())  # relative, as the draw
                x_ = torch.zeros_like(x, dtype=torch.long) + mask_id
                x_[mask_index] = x0.clone()
                row_indices = torch.arange(x.size(0)).unsqueeze(1).expand_as(transfer_index)
                x[row_indices, transfer_index] = x_[row_indices, transfer_index]
    return x


# ---- GGUF (llama.cpp's names, as its convert_hf_to_gguf.py writes LLaDA / Dream) ------------------------------------

GGUF_NAMES = [("model.embed_tokens.weight", "token_embd.weight"), ("model.norm.weight", "output_norm.weight"),
              ("lm_head.weight", "output.weight")]
GGUF_LAYER = [("input_layernorm", "attn_norm"), ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"),
              ("self_attn.v_proj", "attn_v"), ("self_attn.o_proj", "attn_output"),
              ("post_attention_layernorm", "ffn_norm"), ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
              ("mlp.down_proj", "ffn_down")]


def gguf_name(n):
    for hf, g in GGUF_NAMES:
        if n == hf:
            return g
    parts = n.split(".")  # model.layers.I.<module...>.weight|bias
    i, rest, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
    for hf, g in GGUF_LAYER:
        if rest == hf:
            return f"blk.{i}.{g}.{kind}"
    raise KeyError(n)


def interleave_rows(w, n_head):
    """LLaDA's GGUF stores q/k rows for ggml's adjacent-pair rotary: per head, row (half, i) moves to (i, half)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_variants(folder, arch, m, meta, ids_rows, tensors):
    """Writes model-f32.gguf and model-q8_0.gguf (2-D weights whose rows are multiples of 32 as q8_0, the rest f32)
    and the logits of each file's weights through the same reference decoder (the q8_0 file's dequantised by
    gguf-py); returns the case entries."""
    import copy
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf import quants
    entries = []
    for variant in ["f32", "q8_0"]:
        fname = f"model-{variant}.gguf"
        w = gguf.GGUFWriter(os.path.join(folder, fname), arch)
        w.add_context_length(meta["ctx"])
        w.add_embedding_length(meta["hidden"])
        w.add_block_count(meta["layers"])
        w.add_feed_forward_length(meta["ffn"])
        w.add_head_count(meta["heads"])
        w.add_head_count_kv(meta["kv_heads"])
        w.add_rope_freq_base(meta["theta"])
        w.add_layer_norm_rms_eps(meta["eps"])
        w.add_vocab_size(meta["vocab"])
        w.add_mask_token_id(meta["mask"])
        w.add_eos_token_id(meta["eos"])
        w.add_causal_attention(False)
        if arch == "llada":
            w.add_diffusion_shift_logits(False)
        mq = copy.deepcopy(m)
        sd = mq.state_dict()
        with torch.no_grad():
            for n, t in sd.items():
                if "rotary_emb" in n:
                    continue
                x = t.detach().numpy().astype(np.float32)
                quant = variant == "q8_0" and x.ndim == 2 and x.shape[1] % 32 == 0
                if quant:
                    deq = quants.dequantize(quants.quantize(x, Q.Q8_0), Q.Q8_0).reshape(x.shape)
                    t.copy_(torch.from_numpy(np.ascontiguousarray(deq)))
                stored = x
                if arch == "llada" and (".q_proj." in n or ".k_proj." in n):
                    stored = interleave_rows(x, meta["heads"] if ".q_proj." in n else meta["kv_heads"])
                if quant:
                    q = quants.quantize(np.ascontiguousarray(stored), Q.Q8_0)
                    w.add_tensor(gguf_name(n), q, raw_shape=q.shape, raw_dtype=Q.Q8_0)
                else:
                    w.add_tensor(gguf_name(n), np.ascontiguousarray(stored))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        mq.eval()
        for k, ids in enumerate(ids_rows):
            tensors[f"gguf_{variant}.forward{k}.logits"] = mq(torch.tensor([ids])).logits.detach()
        entries.append({"file": fname, "logits_prefix": f"gguf_{variant}.", "logits_atol": 1e-4, "logits_rtol": 1e-4})
    return entries


# ---- cases -----------------------------------------------------------------------------------------------------------

def write_case(folder, config, weights, case, tensors):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=1, sort_keys=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(folder, "model.safetensors"))
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, "dlm_case.safetensors"))
    with open(os.path.join(folder, "dlm_case.json"), "w") as f:
        json.dump(case, f, indent=1)
    print("wrote", folder, "min gap", case.get("min_decision_gap"))


def check_gap(gaps, what, need=1e-4):
    g = min(gaps) if gaps else 1.0
    if g < need:
        raise SystemExit(f"{what}: a decision is within {g:.3g} of a tie; change the seed")
    return g


def forward_tensors(fn, id_rows):
    out = {}
    for n, ids in enumerate(id_rows):
        t = torch.tensor([ids])
        out[f"forward{n}.input_ids"] = t
        out[f"forward{n}.logits"] = fn(t)
    return out


def gen_diffugpt():
    V0, MASK = 100, 100  # the base vocabulary, then [MASK]; the table padded to a multiple of 2 as DiffuGPT resizes
    cfg = GPT2Config(vocab_size=102, n_positions=64, n_embd=32, n_layer=2, n_head=4, activation_function="gelu_new",
                     resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    m = GPT2LMHeadModel(cfg).eval()
    randomize(m, 11)
    for blk in m.transformer.h:
        blk.attn.bias.fill_(True)  # DiffuGPT: remove the causal mask
    sd = {k.replace("transformer.", ""): v for k, v in m.state_dict().items() if not k.endswith(".attn.bias") and "masked_bias" not in k}
    with torch.no_grad():
        fn = lambda ids: m(ids).logits
        ids = [[5, 17, MASK, 3, MASK, MASK, 40, 2, MASK, 99, 1, MASK], [MASK] * 9]
        tensors = forward_tensors(fn, ids)
        for k in [k for k in tensors if k.endswith("logits")]:
            alt = gpt2_forward(sd, 4, cfg.layer_norm_epsilon, tensors[k.replace("logits", "input_ids")])
            assert torch.allclose(alt, tensors[k], atol=1e-4), "GPT-2 reference and plain forward disagree"
        gens = []
        for gi, (L, src, steps, temp, top_p, seed) in enumerate([(16, [50, 7, 8, 9], 6, 0.95, 0.9, 3),
                                                                   (12, [], 4, 1.0, 1.0, 5)]):
            x = torch.tensor([src + [0] * (L - len(src))])
            src_mask = torch.tensor([[True] * len(src) + [False] * (L - len(src))])
            draws, gaps = Draws(seed), []
            x0 = diffugpt_sample(fn, x, src_mask, MASK, steps, temp, top_p, draws, gaps)
            g = check_gap(gaps, f"diffugpt gen {gi}")
            tensors[f"generate{gi}.input_ids"] = x
            tensors[f"generate{gi}.src_mask"] = src_mask.to(torch.int64)
            tensors[f"generate{gi}.output_ids"] = x0
            for j, u in enumerate(draws.tensors):
                tensors[f"generate{gi}.draw{j}"] = u
            gens.append({"name": f"generate{gi}", "sampler": "diffugpt", "steps": steps, "logits_temp": temp,
                         "top_p": top_p, "shift": True, "draws": len(draws.tensors), "min_decision_gap": g})
    weights = {"embed_tokens.weight": sd["wte.weight"], "lm_head.weight": sd["wte.weight"].clone()}
    weights.update({"denoise_model." + k: v for k, v in sd.items() if k != "wte.weight" and k != "lm_head.weight"})
    config = cfg.to_dict()
    config = {k: v for k, v in config.items() if not k.startswith("_") and k not in ("transformers_version",)}
    config["architectures"] = ["GPT2LMHeadModel"]
    case = {"family": "diffugpt", "mask_token_id": MASK, "shift": True, "logits_atol": 1e-4, "logits_rtol": 1e-4,
            "forward": [{"name": f"forward{n}"} for n in range(2)], "generate": gens,
            "reference": "transformers GPT2LMHeadModel, attn.bias filled with True (HKUNLP/DiffuLLaMA model.py)",
            "min_decision_gap": min(gg["min_decision_gap"] for gg in gens)}
    write_case(os.path.join(OUT, "diffugpt_tiny"), config, weights, case, tensors)


def llama_plain(m, layers, qkv_bias):
    sd = m.state_dict()
    out = {"embed": sd["model.embed_tokens.weight"], "norm": sd["model.norm.weight"], "head": sd["lm_head.weight"]}
    for i in range(layers):
        p = f"model.layers.{i}."
        for ours, theirs in [("in_norm", "input_layernorm.weight"), ("post_norm", "post_attention_layernorm.weight"),
                             ("q", "self_attn.q_proj.weight"), ("k", "self_attn.k_proj.weight"),
                             ("v", "self_attn.v_proj.weight"), ("o", "self_attn.o_proj.weight"),
                             ("gate", "mlp.gate_proj.weight"), ("up", "mlp.up_proj.weight"),
                             ("down", "mlp.down_proj.weight")]:
            out[f"l{i}.{ours}"] = sd[p + theirs]
        if qkv_bias:
            for b in "qkv":
                out[f"l{i}.{b}b"] = sd[p + f"self_attn.{b}_proj.bias"]
    return out


def gen_llada():
    V, MASK, EOS = 96, 90, 91
    L_, H, KV, D, FF, theta, eps = 2, 4, 2, 32, 48, 500000.0, 1e-5
    cfg = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=FF, num_hidden_layers=L_, num_attention_heads=H,
                      num_key_value_heads=KV, rms_norm_eps=eps, rope_theta=theta, max_position_embeddings=64,
                      tie_word_embeddings=False, attention_bias=False, attn_implementation="eager")
    m = LlamaForCausalLM(cfg).eval()
    randomize(m, 21)
    m.model._update_causal_mask = lambda *a, **k: None  # LLaDA: no causal mask
    plain = llama_plain(m, L_, False)
    pc = {"heads": H, "kv_heads": KV, "hidden": D, "layers": L_, "eps": eps, "theta": theta}
    with torch.no_grad():
        fn = lambda ids: m(ids).logits
        ids = [[1, 5, 17, MASK, 3, MASK, MASK, 40, 2, MASK, 89, EOS], [MASK] * 10]
        tensors = forward_tensors(fn, ids)
        for k in [k for k in tensors if k.endswith("logits")]:
            alt = llama_like_forward(plain, pc, tensors[k.replace("logits", "input_ids")])
            assert torch.allclose(alt, tensors[k], atol=1e-4), "LLaMA reference and plain forward disagree"
        gens = []
        for gi, (prompt, gl, bl, steps, temp, rm, seed) in enumerate([([1, 7, 8, 9], 16, 8, 8, 0.0, "low_confidence", 1),
                                                                     ([1, 30], 12, 4, 6, 0.7, "low_confidence", 2),
                                                                     ([1, 31, 2], 8, 8, 4, 0.0, "random", 3)]):
            draws, gaps = Draws(seed), []
            p = torch.tensor([prompt])
            out = llada_sample(fn, p, MASK, steps, gl, bl, temp, rm, draws, gaps)
            g = check_gap(gaps, f"llada gen {gi}")
            tensors[f"generate{gi}.prompt_ids"] = p
            tensors[f"generate{gi}.output_ids"] = out
            for j, u in enumerate(draws.tensors):
                tensors[f"generate{gi}.draw{j}"] = u
            gens.append({"name": f"generate{gi}", "sampler": "llada", "steps": steps, "gen_length": gl,
                         "block_length": bl, "temperature": temp, "remasking": rm, "draws": len(draws.tensors),
                         "min_decision_gap": g})
    # LLaDA's checkpoint names (LLaDAModelLM: model.transformer.*) and config keys.
    sd = m.state_dict()
    w = {"model.transformer.wte.weight": sd["model.embed_tokens.weight"],
         "model.transformer.ln_f.weight": sd["model.norm.weight"],
         "model.transformer.ff_out.weight": sd["lm_head.weight"]}
    for i in range(L_):
        p, q = f"model.layers.{i}.", f"model.transformer.blocks.{i}."
        for theirs, ours in [("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ff_norm"),
                             ("self_attn.q_proj", "q_proj"), ("self_attn.k_proj", "k_proj"),
                             ("self_attn.v_proj", "v_proj"), ("self_attn.o_proj", "attn_out"),
                             ("mlp.gate_proj", "ff_proj"), ("mlp.up_proj", "up_proj"), ("mlp.down_proj", "ff_out")]:
            w[q + ours + ".weight"] = sd[p + theirs + ".weight"]
    gguf_entries = gguf_variants(os.path.join(OUT, "llada_tiny"), "llada", m,
                                 {"ctx": 64, "hidden": D, "layers": L_, "ffn": FF, "heads": H, "kv_heads": KV,
                                  "theta": theta, "eps": eps, "vocab": V, "mask": MASK, "eos": EOS}, ids, tensors)
    config = {"architectures": ["LLaDAModelLM"], "model_type": "llada", "d_model": D, "n_heads": H, "n_kv_heads": KV,
              "n_layers": L_, "mlp_hidden_size": FF, "mlp_ratio": 4, "vocab_size": V, "embedding_size": V,
              "rope_theta": theta, "rms_norm_eps": eps, "max_sequence_length": 64, "weight_tying": False,
              "include_bias": False, "include_qkv_bias": False, "mask_token_id": MASK, "eos_token_id": EOS,
              "pad_token_id": EOS, "block_type": "llama", "activation_type": "silu", "layer_norm_type": "rms",
              "input_emb_norm": False, "scale_logits": False, "rope": True, "alibi": False, "block_group_size": 1}
    case = {"family": "llada", "mask_token_id": MASK, "shift": False, "logits_atol": 1e-4, "logits_rtol": 1e-4,
            "forward": [{"name": f"forward{n}"} for n in range(2)], "generate": gens,
            "gguf": gguf_entries,
            "reference": "transformers LlamaForCausalLM without the causal mask, renamed to LLaDA's checkpoint names; "
                         "sampler after ML-GSAI/LLaDA generate.py",
            "min_decision_gap": min(gg["min_decision_gap"] for gg in gens)}
    write_case(os.path.join(OUT, "llada_tiny"), config, w, case, tensors)


def gen_dream():
    V, MASK, EOS = 96, 93, 92
    L_, H, KV, D, FF, theta, eps = 2, 4, 2, 32, 48, 1000000.0, 1e-6
    cfg = Qwen2Config(vocab_size=V, hidden_size=D, intermediate_size=FF, num_hidden_layers=L_, num_attention_heads=H,
                      num_key_value_heads=KV, rms_norm_eps=eps, rope_theta=theta, max_position_embeddings=64,
                      tie_word_embeddings=False, attn_implementation="eager")
    m = Qwen2ForCausalLM(cfg).eval()
    randomize(m, 31)
    qwen2_mod._prepare_4d_causal_attention_mask = lambda *a, **k: None  # Dream: full attention
    plain = llama_plain(m, L_, True)
    pc = {"heads": H, "kv_heads": KV, "hidden": D, "layers": L_, "eps": eps, "theta": theta}
    with torch.no_grad():
        fn = lambda ids: m(ids).logits
        ids = [[5, 17, MASK, 3, MASK, MASK, 40, 2, MASK, 89, EOS], [MASK] * 7]
        tensors = forward_tensors(fn, ids)
        for k in [k for k in tensors if k.endswith("logits")]:
            alt = llama_like_forward(plain, pc, tensors[k.replace("logits", "input_ids")])
            assert torch.allclose(alt, tensors[k], atol=1e-4), "Qwen2 reference and plain forward disagree"
        gens = []
        for gi, (prompt, gl, steps, temp, top_p, top_k, alg, alg_temp, seed) in enumerate(
                [([4, 7, 8, 9], 12, 6, 0.0, None, None, "entropy", 0.0, 1),
                 ([4, 30], 10, 5, 0.0, 0.95, None, "maskgit_plus", 0.0, 2),
                 ([4, 31, 2], 8, 4, 0.0, None, 20, "topk_margin", 0.0, 3),
                 ([4, 11], 8, 4, 0.8, 0.9, None, "origin", 0.0, 4),
                 ([4, 12], 8, 4, 0.5, None, None, "entropy", 0.0, 5),
                 ([4, 13, 6], 10, 5, 0.0, None, None, "maskgit_plus", 0.5, 6),
                 ([4, 14], 12, 4, 0.7, 0.95, None, "entropy", 0.2, 7),
                 ([4, 15], 8, 4, 0.6, None, 30, "topk_margin", 1.0, 8)]):
            draws, gaps = Draws(seed), []
            p = torch.tensor([prompt])
            out = dream_sample(fn, p, MASK, gl, steps, 1e-3, temp, top_p, top_k, alg, alg_temp, draws, gaps)
            g = check_gap(gaps, f"dream gen {gi}", 1e-5)
            tensors[f"generate{gi}.prompt_ids"] = p
            tensors[f"generate{gi}.output_ids"] = out
            for j, u in enumerate(draws.tensors):
                tensors[f"generate{gi}.draw{j}"] = u
            e = {"name": f"generate{gi}", "sampler": "dream", "steps": steps, "gen_length": gl, "eps": 1e-3,
                 "temperature": temp, "alg": alg, "alg_temp": alg_temp, "draws": len(draws.tensors), "min_decision_gap": g}
            if top_p is not None:
                e["top_p"] = top_p
            if top_k is not None:
                e["top_k"] = top_k
            gens.append(e)
    gguf_entries = gguf_variants(os.path.join(OUT, "dream_tiny"), "dream", m,
                                 {"ctx": 64, "hidden": D, "layers": L_, "ffn": FF, "heads": H, "kv_heads": KV,
                                  "theta": theta, "eps": eps, "vocab": V, "mask": MASK, "eos": EOS}, ids, tensors)
    w = {k: v for k, v in m.state_dict().items() if "rotary_emb" not in k}
    config = {"architectures": ["DreamModel"], "model_type": "Dream", "hidden_size": D, "intermediate_size": FF,
              "num_hidden_layers": L_, "num_attention_heads": H, "num_key_value_heads": KV, "rms_norm_eps": eps,
              "rope_theta": theta, "vocab_size": V, "tie_word_embeddings": False, "mask_token_id": MASK,
              "pad_token_id": EOS, "bos_token_id": EOS, "eos_token_id": EOS, "max_position_embeddings": 64,
              "hidden_act": "silu"}
    case = {"family": "dream", "mask_token_id": MASK, "shift": True, "logits_atol": 1e-4, "logits_rtol": 1e-4,
            "forward": [{"name": f"forward{n}"} for n in range(2)], "generate": gens,
            "gguf": gguf_entries,
            "reference": "transformers Qwen2ForCausalLM without the causal mask (Dream's names); sampler restating "
                         "DreamGenerationMixin._sample (Dream-org/Dream-v0-Instruct-7B generation_utils.py)",
            "min_decision_gap": min(gg["min_decision_gap"] for gg in gens)}
    write_case(os.path.join(OUT, "dream_tiny"), config, w, case, tensors)


def gen_tokenizer():
    """A tiny byte-level BPE in the LLaMA-3 / Qwen2 tokenizer.json layout (Split regex + ByteLevel, added special
    tokens), trained here; the cases are the `tokenizers` library's own encodings and decodings."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    pat = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
           r"\s*[\r\n]+|\s+(?!\S)|\s+")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pat), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = ["<|startoftext|>", "<|endoftext|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    corpus = ["In the beginning God created the heaven and the earth.",
              "And the earth was without form, and void; and darkness was upon the face of the deep.",
              "It's 2025: we'll test 12345 numbers, don't we? Yes -- we DO!",
              "Caf\u00e9 na\u00efve \u4e2d\u6587 \u00fcber  spaces\n\nnew lines\ttabs"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=420, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder = os.path.join(OUT, "tokenizer_bpe")
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    texts = ["In the beginning God created the heaven and the earth.",
             "<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nWhat's 1234567 + 89?<|eot_id|>"
             "<|start_header_id|>assistant<|end_header_id|>\n\n",
             "  leading spaces, trailing spaces   ", "Caf\u00e9 \u4e2d\u6587!!\n\n\nX", "I'LL SHOUT 'Re'",
             "unseen words: zyxwv qq", "tabs\tand\r\nCRLF"]
    cases = []
    for t in texts:
        ids = tok.encode(t).ids
        cases.append({"text": t, "ids": ids, "decoded_skip_special": tok.decode(ids, skip_special_tokens=True)})
    with open(os.path.join(folder, "dlm_tokenizer_cases.json"), "w") as f:
        json.dump({"tokenizer": "tokenizer.json", "reference": "tokenizers " + __import__("tokenizers").__version__,
                   "cases": cases}, f, indent=1, ensure_ascii=False)
    print("wrote", folder)


if __name__ == "__main__":
    print("transformers", transformers.__version__, "torch", torch.__version__)
    which = sys.argv[1:] or ["diffugpt", "llada", "dream", "tokenizer"]
    for name in which:
        globals()["gen_" + name]()
