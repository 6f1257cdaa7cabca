#!/usr/bin/env python3
"""Continue a run folder of `anchor-text diffusion train` on a PyTorch device (a GPU machine's own torch).

Why a second trainer: the GPU machine has PyTorch 2.x and CUDA but not the Debian packages the C++ build links
(cpp-httplib, PCRE2, ...). This script reads and writes the C++ trainer's run folder (text/train/mdlm_train.cpp):

  config.json, model.safetensors (float32, + the int64 `vocab_ids` buffer), train_state.safetensors (AdamW moments
  "m.<name>", "v.<name>", metadata step / adam_t), train_tokens.bin (uint16 LE GPT-2 ids), train_log.txt

and continues the same run: the per-step CPU generator seeded with seed * 1000003 + step + 1 draws the same windows,
times and masks (randint, then rand(1), then rand(B, L), as the C++ loop and mdlm_loss draw them); the same MDLM loss
(Sahoo et al. 2024, eq. 10-11, or the per-sequence masked mean); AdamW with decay on matrices only; the same warm-up +
cosine schedule to 10 %; the same gradient clip. The C++ trainer can resume what this writes and `anchor-text` loads
its export. On the CPU with torch 1.13 it reproduces the C++ trainer's losses (--check-against compares them).

On CUDA: TF32 matmuls, optional bf16 autocast (--amp), scaled_dot_product_attention where torch has it (the same
softmax(q k^T / sqrt(d)) v), fused AdamW (the same update as the manual loop below).

  python3 text/train/mdlm_train_torch.py RUN_DIR --steps 6000 --batch 64 --lr 1e-3 --warmup 200 \
      --device cuda --time-budget 300 --export OUT_DIR
"""
import argparse
import contextlib
import json
import math
import os
import struct
import sys
import time

import torch
import torch.nn.functional as F

# ---- safetensors (the subset our files use: F32 / F16 / BF16 / I64, string metadata) ---------------------------------

_DT = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64}
_DT_NAME = {v: k for k, v in _DT.items()}


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", {}) or {}
    out = {}
    for name, e in header.items():
        if e["dtype"] not in _DT:
            raise SystemExit(f"error: {path}: tensor '{name}' has dtype {e['dtype']}, expected one of {sorted(_DT)}")
        b, end = e["data_offsets"]
        dt = _DT[e["dtype"]]
        t = torch.frombuffer(bytearray(data[b:end]), dtype=dt) if end > b else torch.empty(0, dtype=dt)
        out[name] = t.reshape(e["shape"]).clone()
    return out, meta


def write_safetensors(path, tensors, meta):
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _DT_NAME[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    if meta:
        header["__metadata__"] = {k: str(v) for k, v in meta.items()}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:  # written then renamed: a crash leaves the previous file
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for raw in blobs:
            f.write(raw)
    os.replace(tmp, path)


# ---- the model: text/diffusion/mdlm_model.cpp's forward, by the checkpoint's tensor names -------------------------------------


class Mdlm:
    def __init__(self, cfg, params, device):
        self.cfg = cfg
        self.D, self.H = cfg["hidden_size"], cfg["n_heads"]
        self.d = self.D // self.H
        self.time_anchor = cfg.get("gate", "time_anchor") in ("time_anchor", "anchor")
        self.p = params
        self.compact = cfg.get("compact_vocab", False)
        self.mask_internal = cfg["vocab_size"] - 1 if self.compact else cfg["mask_token_id"]
        self.mask_bias = torch.zeros(cfg["vocab_size"], device=device)
        self.mask_bias[self.mask_internal] = float("-inf")
        self.sdpa = device.type == "cuda" and hasattr(F, "scaled_dot_product_attention")

    def lin(self, x, name, bias=True):
        return F.linear(x, self.p[name + ".weight"], self.p.get(name + ".bias") if bias else None)

    def norm(self, x, name):
        return F.layer_norm(x, (x.shape[-1],), self.p[name + ".weight"], None, self.cfg["norm_eps"])

    def conditioning(self, t):
        eps = self.cfg["noise_eps"]
        sigma = -torch.log1p(-(1.0 - eps) * t) if self.cfg.get("time_conditioning", True) else torch.zeros_like(t)
        half = self.cfg["freq_embed_size"] // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=sigma.dtype, device=sigma.device) / half)
        args = sigma.unsqueeze(-1) * freqs.unsqueeze(0)
        e = torch.cat([torch.cos(args), torch.sin(args)], -1)
        h = self.lin(F.silu(self.lin(e, "sigma_map.mlp.0")), "sigma_map.mlp.2")
        return F.silu(h)

    def rope(self, n, device):
        half = self.d // 2
        inv = torch.pow(self.cfg["rope_base"], -torch.arange(half, dtype=torch.float64, device=device) / half)
        ang = torch.arange(n, dtype=torch.float64, device=device).unsqueeze(1) * inv.unsqueeze(0)
        ang = torch.cat([ang, ang], 1)
        return torch.cos(ang).float(), torch.sin(ang).float()

    @staticmethod
    def apply_rope(x, cos, sin):
        h = x.shape[-1] // 2
        x1, x2 = x[..., :h], x[..., h:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def block(self, i, x, c, cos, sin):
        b = f"blocks.{i}"
        B, n, D = x.shape
        mod = self.lin(c, b + ".adaLN_modulation").unsqueeze(1)
        if self.time_anchor:  # g = sigmoid(W E(t) + b) per branch
            shift1, scale1, shift2, scale2 = mod.chunk(4, -1)
            g_attn = torch.sigmoid(self.lin(c, b + ".gate_attn")).unsqueeze(1)
            g_ffn = torch.sigmoid(self.lin(c, b + ".gate_ffn")).unsqueeze(1)
        else:  # SEDD's 6-way adaLN
            shift1, scale1, g_attn, shift2, scale2, g_ffn = mod.chunk(6, -1)
        h = self.norm(x, b + ".norm1") * (1 + scale1) + shift1
        qkv = self.lin(h, b + ".attn_qkv", bias=False).view(B, n, 3, self.H, self.d).permute(2, 0, 3, 1, 4)
        q, k, v = self.apply_rope(qkv[0], cos, sin), self.apply_rope(qkv[1], cos, sin), qkv[2]
        if self.sdpa:  # rope's float32 tables promote q and k under autocast: one dtype for the fused kernel
            o = F.scaled_dot_product_attention(q.to(v.dtype), k.to(v.dtype), v)
        else:  # SEDD: (q k^T) * scale, softmax, @ v
            o = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * (self.d ** -0.5), -1) @ v
        o = self.lin(o.permute(0, 2, 1, 3).reshape(B, n, D), b + ".attn_out", bias=False)
        y = x + g_attn * o
        f = self.norm(y, b + ".norm2") * (1 + scale2) + shift2
        f = self.lin(F.gelu(self.lin(f, b + ".mlp.0"), approximate="tanh"), b + ".mlp.2")
        return y + g_ffn * f

    def hidden(self, ids, c):
        x = self.p["vocab_embed.embedding"][ids]
        cos, sin = self.rope(ids.shape[1], ids.device)
        for i in range(self.cfg["n_blocks"]):
            x = self.block(i, x, c, cos, sin)
        return x

    def head(self, h, c):
        shift, scale = self.lin(c, "output_layer.adaLN_modulation").unsqueeze(1).chunk(2, -1)
        x = self.norm(h, "output_layer.norm_final") * (1 + scale) + shift
        w = self.p.get("output_layer.linear.weight", self.p["vocab_embed.embedding"])
        return F.linear(x, w, self.p["output_layer.linear.bias"]) + self.mask_bias


def param_names(cfg):
    """The C++ model's parameters in registration order (named_parameters(true)), with shapes."""
    D, C, V, F_ = cfg["hidden_size"], cfg["cond_dim"], cfg["vocab_size"], cfg["freq_embed_size"]
    M = cfg["mlp_ratio"] * D
    time_anchor = cfg.get("gate", "time_anchor") in ("time_anchor", "anchor")
    out = [("vocab_embed.embedding", [V, D]), ("sigma_map.mlp.0.weight", [C, F_]), ("sigma_map.mlp.0.bias", [C]),
           ("sigma_map.mlp.2.weight", [C, C]), ("sigma_map.mlp.2.bias", [C])]
    for i in range(cfg["n_blocks"]):
        b = f"blocks.{i}."
        out += [(b + "norm1.weight", [D]), (b + "norm2.weight", [D]), (b + "attn_qkv.weight", [3 * D, D]),
                (b + "attn_out.weight", [D, D]), (b + "mlp.0.weight", [M, D]), (b + "mlp.0.bias", [M]),
                (b + "mlp.2.weight", [D, M]), (b + "mlp.2.bias", [D]),
                (b + "adaLN_modulation.weight", [(4 if time_anchor else 6) * D, C]),
                (b + "adaLN_modulation.bias", [(4 if time_anchor else 6) * D])]
        if time_anchor:
            out += [(b + "gate_attn.weight", [D, C]), (b + "gate_attn.bias", [D]), (b + "gate_ffn.weight", [D, C]),
                    (b + "gate_ffn.bias", [D])]
    out += [("output_layer.norm_final.weight", [D]), ("output_layer.adaLN_modulation.weight", [2 * D, C]),
            ("output_layer.adaLN_modulation.bias", [2 * D])]
    if not cfg.get("tie_word_embeddings", False):
        out.append(("output_layer.linear.weight", [V, D]))
    out.append(("output_layer.linear.bias", [V]))
    return out


def init_run(run, seed, std=0.02):
    """A fresh checkpoint at step 0 from config.json and train_tokens.bin, as text/diffusion/mdlm_model.cpp init_mdlm_weights
    makes it (norms 1, adaLN and biases 0, the rest N(0, std) from one CPU generator in registration order) with the
    compact vocabulary of the C++ trainer (the corpus' sorted unique ids, then [MASK])."""
    cfg = json.load(open(os.path.join(run, "config.json")))
    gen = torch.Generator().manual_seed(seed)
    w = {}
    for n, shape in param_names(cfg):
        t = torch.empty(shape)
        if "norm" in n:
            t.fill_(1.0)
        elif "adaLN_modulation" in n or n.endswith(".bias"):
            t.zero_()
        else:
            t.normal_(0.0, std, generator=gen)
        w[n] = t
    if cfg.get("compact_vocab", False):
        ids = torch.unique(read_tokens(os.path.join(run, "train_tokens.bin")), sorted=True)
        w["vocab_ids"] = torch.cat([ids, torch.tensor([cfg["mask_token_id"]])])
        if w["vocab_ids"].numel() != cfg["vocab_size"]:
            raise SystemExit(f"error: config.json vocab_size {cfg['vocab_size']} but the corpus has "
                             f"{w['vocab_ids'].numel() - 1} distinct ids + [MASK]")
    write_safetensors(os.path.join(run, "model.safetensors"), w, {"format": "pt"})
    st = {**{"m." + n: torch.zeros_like(t) for n, t in w.items() if n != "vocab_ids"},
          **{"v." + n: torch.zeros_like(t) for n, t in w.items() if n != "vocab_ids"}}
    write_safetensors(os.path.join(run, "train_state.safetensors"), st, {"step": 0, "adam_t": 0})


def read_tokens(path):  # uint16 LE GPT-2 ids (text/token_file.h)
    raw = open(path, "rb").read()
    return torch.frombuffer(bytearray(raw), dtype=torch.int16).to(torch.int64) & 0xFFFF


def mdlm_loss(model, ids, gen, weight):
    """text/train/mdlm_train.cpp's mdlm_loss: the same draws from `gen` (CPU), in the same order."""
    B, L = ids.shape
    eps = model.cfg["noise_eps"]
    u = torch.rand(1, generator=gen, dtype=torch.float32)
    t = torch.remainder(u + torch.arange(B, dtype=torch.float32) / float(B), 1.0) * (1.0 - eps) + eps
    r = torch.rand(B, L, generator=gen, dtype=torch.float32)
    masked = (r < ((1.0 - eps) * t).unsqueeze(1)).to(ids.device)
    t = t.to(ids.device)
    xt = torch.where(masked, torch.full_like(ids, model.mask_internal), ids)
    c = model.conditioning(t)
    h = model.hidden(xt, c)
    flat = torch.nonzero(masked.reshape(-1)).reshape(-1)
    rows = h.reshape(B * L, -1).index_select(0, flat).unsqueeze(1)
    batch_of = torch.div(flat, L, rounding_mode="floor")
    logits = model.head(rows, c.index_select(0, batch_of)).squeeze(1)
    nll = F.cross_entropy(logits.float(), ids.reshape(-1).index_select(0, flat), reduction="none")
    if weight == "masked_mean":
        count = masked.sum(1).clamp_min(1).float()
        return (nll / count.index_select(0, batch_of)).sum() / float(B)
    return (nll / t.index_select(0, batch_of)).sum() / float(B * L)


def lr_at(lr, step, warmup, steps, min_ratio=0.1):  # cache/train/optim.h warmup_cosine_lr
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    prog = (step - warmup) / (steps - warmup) if steps > warmup else 1.0
    prog = min(1.0, max(0.0, prog))
    return lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * prog)))


class ManualAdamW:
    """cache/train/optim.h NamedAdamW, operation for operation (the CPU path, so that losses match the C++ run)."""

    def __init__(self, named, m, v, t, cfg):
        self.named, self.m, self.v, self.t, self.c = named, m, v, t, cfg

    @torch.no_grad()
    def step(self, lr):
        b1, b2, eps, wd = self.c
        self.t += 1
        bc1, bc2 = 1.0 - b1 ** self.t, 1.0 - b2 ** self.t
        for n, p in self.named:
            g, mm, vv = p.grad, self.m[n], self.v[n]
            mm.mul_(b1).add_(g, alpha=1.0 - b1)
            vv.mul_(b2).addcmul_(g, g, value=1.0 - b2)
            if p.dim() >= 2 and wd > 0:
                p.mul_(1.0 - lr * wd)
            p.addcdiv_(mm, (vv / bc2).sqrt_().add_(eps), value=-lr / bc1)

    def moments(self):
        return self.m, self.v, self.t


class FusedAdamW:
    """torch.optim.AdamW(fused=True) with the same two groups (decay on matrices only): the same update
    p <- p (1 - lr wd) - lr / bc1 * m / (sqrt(v / bc2) + eps), in one kernel per step."""

    def __init__(self, named, m, v, t, cfg):
        b1, b2, eps, wd = cfg
        self.named = named
        mats = [p for n, p in named if p.dim() >= 2]
        rest = [p for n, p in named if p.dim() < 2]
        groups = [{"params": mats, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=1e-3, betas=(b1, b2), eps=eps, fused=True)
        dev = named[0][1].device
        for n, p in named:
            self.opt.state[p] = {"step": torch.tensor(float(t), dtype=torch.float32, device=dev),
                                 "exp_avg": m[n], "exp_avg_sq": v[n]}
        self.t = t

    def step(self, lr):
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        self.t += 1

    def moments(self):
        st = self.opt.state
        return ({n: st[p]["exp_avg"] for n, p in self.named}, {n: st[p]["exp_avg_sq"] for n, p in self.named}, self.t)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="run folder of `anchor-text diffusion train` (a checkpoint and train_tokens.bin)")
    ap.add_argument("--steps", type=int, required=True, help="total optimizer steps of the schedule")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--loss-weight", choices=["nelbo", "masked_mean"], default="masked_mean")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--checkpoint-every", type=int, default=1000)
    ap.add_argument("--stop-after", type=int, default=0, help="> 0: stop after this many steps in this invocation")
    ap.add_argument("--time-budget", type=float, default=0.0,
                    help="seconds: size the schedule from the step rate measured over steps 5-25 (at most --steps)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--amp", choices=["off", "bf16"], default="off", help="CUDA autocast (float32 master weights)")
    ap.add_argument("--export", default="",
                    help="folder for float16 weights (config.json + model): the final step's, or the step with the "
                         "lowest held-out NELBO when that is lower")
    ap.add_argument("--eval-every", type=int, default=500, help="held-out NELBO interval (0 = none)")
    ap.add_argument("--eval-windows", type=int, default=32)
    ap.add_argument("--init", action="store_true",
                    help="start the run: write a step-0 checkpoint from config.json and train_tokens.bin")
    a = ap.parse_args()
    if a.init:
        init_run(a.run, a.seed)

    dev = torch.device(a.device)
    if a.amp == "bf16" and dev.type != "cuda":
        raise SystemExit("error: --amp bf16 needs a CUDA --device")

    def amp():  # bf16 autocast on CUDA (float32 master weights, optimizer state and loss), else nothing
        return torch.autocast("cuda", dtype=torch.bfloat16) if a.amp == "bf16" else contextlib.nullcontext()

    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    cfg = json.load(open(os.path.join(a.run, "config.json")))
    weights, _ = read_safetensors(os.path.join(a.run, "model.safetensors"))
    state, meta = read_safetensors(os.path.join(a.run, "train_state.safetensors"))
    start, adam_t = int(meta["step"]), int(meta["adam_t"])
    buffers = {k: v for k, v in weights.items() if k == "vocab_ids"}
    params = {k: v.float().to(dev).requires_grad_(True) for k, v in weights.items() if k not in buffers}
    named = sorted(params.items())
    m = {n: state["m." + n].float().to(dev) for n, _ in named}
    v = {n: state["v." + n].float().to(dev) for n, _ in named}
    adam_cfg = (0.9, 0.999, 1e-8, a.weight_decay)
    opt = (FusedAdamW if dev.type == "cuda" else ManualAdamW)(named, m, v, adam_t, adam_cfg)
    model = Mdlm(cfg, params, dev)

    ext_to_int = None
    if cfg.get("compact_vocab", False):
        ext_to_int = torch.full((cfg["mask_token_id"] + 1,), -1, dtype=torch.int64)
        ext_to_int[buffers["vocab_ids"]] = torch.arange(cfg["vocab_size"])
    corpus = read_tokens(os.path.join(a.run, "train_tokens.bin"))
    if ext_to_int is not None:
        corpus = ext_to_int[corpus]
        if int(corpus.min()) < 0:
            raise SystemExit("error: train_tokens.bin holds ids outside the model's vocab_ids")
    data = corpus.to(dev)
    # Held-out NELBO (nats per token, the 1/t weight; an upper bound on the NLL, MDLM eq. 11) on fixed windows of
    # heldout_tokens.bin that the compact vocabulary covers, with fixed masks: comparable across steps.
    eval_ids = None
    hp = os.path.join(a.run, "heldout_tokens.bin")
    if a.eval_every > 0 and os.path.exists(hp):
        held = read_tokens(hp)
        held = ext_to_int[held] if ext_to_int is not None else held
        wins = [held[o:o + a.seq_len] for o in range(0, held.numel() - a.seq_len, a.seq_len // 2)]
        wins = [w for w in wins if int(w.min()) >= 0][:a.eval_windows]
        eval_ids = torch.stack(wins).to(dev) if wins else None

    def evaluate():
        with torch.no_grad(), amp():
            return sum(float(mdlm_loss(model, eval_ids, torch.Generator().manual_seed(777 + k), "nelbo"))
                       for k in range(4)) / 4.0

    best = (float("inf"), None, -1)
    n_windows = data.numel() - a.seq_len
    log_f = open(os.path.join(a.run, "train_log.txt"), "a")
    print(f"run {a.run}: step {start}, {sum(p.numel() for p in params.values())} parameters, {corpus.numel()} "
          f"training tokens, device {dev}" + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else "")
          + f", amp {a.amp}", flush=True)

    def save(step):
        write_safetensors(os.path.join(a.run, "model.safetensors"), {**{n: p for n, p in named}, **buffers},
                          {"format": "pt"})
        mm, vv, tt = opt.moments()
        st = {**{"m." + n: t for n, t in mm.items()}, **{"v." + n: t for n, t in vv.items()}}
        write_safetensors(os.path.join(a.run, "train_state.safetensors"), st, {"step": step, "adam_t": tt})

    total = a.steps
    stop = min(total, start + a.stop_after) if a.stop_after > 0 else total
    t0 = time.time()
    t_plan = t0
    running, running_n = 0.0, 0
    step = start
    while step < stop:
        if a.time_budget > 0 and step == start + 5:
            t_plan = time.time()
        if a.time_budget > 0 and step == start + 25:
            per = (time.time() - t_plan) / 20.0
            fit = step + max(1, int(max(0.0, a.time_budget - (time.time() - t0)) / per))  # this step is run
            total = max(a.warmup + 1, min(a.steps, fit))
            stop = min(total, start + a.stop_after) if a.stop_after > 0 else total
            line = f"time budget {a.time_budget:g} s: {per * 1e3:.4g} ms/step -> schedule of {total} steps"
            print(line, flush=True)
            log_f.write(line + "\n")
        gen = torch.Generator().manual_seed(a.seed * 1000003 + step + 1)
        offs = torch.randint(n_windows, (a.batch,), generator=gen, dtype=torch.int64)
        idx = offs.unsqueeze(1) + torch.arange(a.seq_len, dtype=torch.int64).unsqueeze(0)
        batch = data.index_select(0, idx.reshape(-1).to(dev)).view(a.batch, a.seq_len)
        for p in params.values():
            p.grad = None
        with amp():
            loss = mdlm_loss(model, batch, gen, a.loss_weight)
        loss.backward()
        if a.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_([p for _, p in named], a.grad_clip)
        lr = lr_at(a.lr, step, a.warmup, total)
        opt.step(lr)
        lv = float(loss.detach())
        if not math.isfinite(lv):
            raise SystemExit(f"error: loss became {lv} at step {step}")
        running, running_n = running + lv, running_n + 1
        step += 1
        if step % a.log_every == 0 or step == stop:
            line = f"step {step}/{total} loss {running / running_n:.4f} lr {lr:.2e} elapsed {time.time() - t0:.1f}s"
            print(f"{line} (loss {running / running_n:.7f})", flush=True)  # the log keeps the C++ trainer's format
            log_f.write(line + "\n")
            log_f.flush()
            running, running_n = 0.0, 0
        if eval_ids is not None and (step % a.eval_every == 0 or step == stop):
            ev = evaluate()
            line = f"eval step {step} held-out NELBO {ev:.4f} nats/token ({eval_ids.shape[0]} windows)"
            print(line, flush=True)
            log_f.write(line + "\n")
            if ev < best[0]:
                best = (ev, {n: p.detach().to("cpu", torch.float16) for n, p in named}, step)
        if step % a.checkpoint_every == 0 or step == stop:
            save(step)
    if a.export:
        os.makedirs(a.export, exist_ok=True)
        final = {n: p.detach().to("cpu", torch.float16) for n, p in named}
        weights16, which = final, f"the final step {step}"
        if best[1] is not None and best[2] != step:  # the held-out NELBO rose after its best: export the best
            weights16, which = best[1], f"step {best[2]} (held-out NELBO {best[0]:.4f}, the lowest)"
        write_safetensors(os.path.join(a.export, "model.safetensors"), {**weights16, **buffers}, {"format": "pt"})
        print(f"exported weights of {which}", flush=True)
        with open(os.path.join(a.export, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
            f.write("\n")
        print(f"exported float16 weights to {a.export}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
