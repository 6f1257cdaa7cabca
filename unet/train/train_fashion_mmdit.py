"""Trains assets/models/fashion-mmdit: a small SD 3-layout MMDiT (diffusers' SD3Transformer2DModel) with rectified
flow on Fashion-MNIST latents of fashion-sd's VAE, conditioned on fashion-sd's class captions, and writes a diffusers
StableDiffusion3Pipeline folder that anchor-sd loads (transformer/, vae/, text_encoder(_2)/, tokenizer(_2)/,
scheduler/, model_index.json; no T5: diffusers' zeros stand in for it, as with --no-t5).

Why PyTorch and not the project's C++ trainer: our MMDiT (unet/model/mmdit.cpp) runs attention through
kernels::attention, which has no backward, and the C++ trainers (unet/train/sd_train.cpp) train only the UNet, VAE and
classifier; diffusers' SD3Transformer2DModel is the reference our loader is tested against (the sd3_tiny goldens), so
training it directly gives weights our engine reads by construction.

The parts:
  vae/            fashion-sd's AutoencoderKL weights (4 latent channels, 32x32 -> 8x8), with SD 3's latent
                  normalisation written into its config: shift_factor = mean of the training latents, scaling_factor =
                  1 / their std after the shift (SD 3's VAE has both; fashion-sd's has only a scaling factor).
  text_encoder/   fashion-sd's trained CLIP text encoder (2 layers x 64, frozen) as a CLIPTextModelWithProjection with
                  an identity text_projection: SD 3 reads its penultimate hidden state and its projected EOS state.
  text_encoder_2/ a tiny random CLIP (1 layer x 16, frozen), the OpenCLIP bigG role; SD 3 needs two.
  transformer/    trained here: patch size 1 (the 8x8 latent is a 64-token grid), QK RMSNorm (SD 3.5's), no MMDiT-X.
  scheduler/      FlowMatchEulerDiscreteScheduler, shift 1.0 (SD 3 sec. 5.3.2: the shift grows with the resolution;
                  an 8x8 latent is far below the 256^2 base where SD 3 trains with shift 1).

Training objective (Esser et al. 2024, "Scaling Rectified Flow Transformers", eq. 1 and sec. 3.1): x_t = (1 - t) x0 +
t eps, the transformer at timestep 1000 t predicts v = eps - x0 (MSE), t from the logit-normal distribution
(m = 0, s = 1; their best rf/lognorm(0.00, 1.00)). Captions: fashion-sd's 4 templates x 10 class names, the empty
prompt 10 % of the time (classifier-free guidance). The prompts are encoded once through diffusers'
StableDiffusion3Pipeline.encode_prompt (the inference path), since both encoders are frozen.

usage (Debian's torch 1.13 + diffusers 0.31 + transformers 4.38, e.g. /tmp/d63/bin/python):
  OMP_NUM_THREADS=1 nice -n 10 python unet/train/train_fashion_mmdit.py --out assets/models/fashion-mmdit \
      --steps N --time-budget SECONDS
"""
import argparse
import gzip
import json
import math
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F


# Training-time shortcut, exact: without T5 the conditioning ends in 77 zero tokens (diffusers' stand-in for T5). They
# enter every block equal and stay equal (each token's update depends on its own value and on the shared attention
# over all tokens), so one copy whose attention logit carries + log(77) gives every other token the same attention
# output, and its own output equals each copy's. Training feeds 77 CLIP tokens + 1 such token (142 tokens instead of
# 218); check_zero_token_shortcut verifies the equality on the model before training. The saved model is the
# ordinary SD3Transformer2DModel: inference runs the 154 tokens.
ZERO_COPIES = [1]


def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    # torch 1.13 has no F.scaled_dot_product_attention, which diffusers' JointAttnProcessor2_0 calls: the same
    # formula softmax(q k^T / sqrt(d)) v (our engine's ScaleAfter), differentiable. Every attention of this model is
    # joint, [image tokens; text tokens], so the last key is the last text token.
    assert attn_mask is None and not is_causal and dropout_p == 0.0
    s = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    logits = q @ k.transpose(-1, -2) * s
    if ZERO_COPIES[0] > 1:
        bias = torch.zeros(k.shape[-2], dtype=logits.dtype)
        bias[-1] = math.log(ZERO_COPIES[0])
        logits = logits + bias
    return torch.softmax(logits, dim=-1) @ v


F.scaled_dot_product_attention = sdpa

from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from safetensors.torch import load_file, save_file
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer

CLASSES = ["t-shirt", "pair of trousers", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "handbag",
           "ankle boot"]  # unet/train/fashion_mnist.cpp's names and label order
TEMPLATES = ["a photo of a {}", "a {}", "a picture of a {}", "a black and white photo of a {}"]


def read_idx(path):
    b = gzip.open(path).read() if path.endswith(".gz") else open(path, "rb").read()
    ndim = b[3]
    dims = [int.from_bytes(b[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(b, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def fashion_images(data_dir):
    """The 60,000 training images as fashion-sd's trainers feed them: [-1, 1], padded 28 -> 32 with black (-1), RGB."""
    u8 = read_idx(os.path.join(data_dir, "train-images-idx3-ubyte.gz"))
    labels = read_idx(os.path.join(data_dir, "train-labels-idx1-ubyte.gz")).astype(np.int64)
    x = torch.from_numpy(u8.copy()).float().div(127.5).sub(1.0).unsqueeze(1)
    x = F.pad(x, (2, 2, 2, 2), value=-1.0)
    return x.expand(-1, 3, -1, -1), torch.from_numpy(labels)


def bpe_vocab_files(bpe_gz, out):
    """vocab.json / merges.txt of the openai CLIP BPE file (the order CLIPTokenizer expects: bytes, bytes</w>, merges,
    the two specials); our engine bundles the same vocabulary."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    byte_chars = [chr(c) for c in cs]
    merges = gzip.open(bpe_gz).read().decode("utf-8").split("\n")[1:49152 - 256 - 2 + 1]
    vocab = byte_chars + [c + "</w>" for c in byte_chars] + ["".join(m.split()) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    with open(os.path.join(out, "vocab.json"), "w") as f:
        json.dump({t: i for i, t in enumerate(vocab)}, f)
    with open(os.path.join(out, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n" + "\n".join(merges) + "\n")


def text_encoder_from_fashion_sd(folder):
    """fashion-sd's CLIPTextModel with an identity text_projection (CLIPTextModelWithProjection)."""
    cfg = json.load(open(os.path.join(folder, "config.json")))
    cfg.pop("architectures", None)
    hidden = cfg["hidden_size"]
    te = CLIPTextModelWithProjection(CLIPTextConfig(**cfg, projection_dim=hidden)).eval()
    sd = {k: v.float() for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}
    sd = {k: v for k, v in sd.items() if not k.endswith("position_ids")}
    sd["text_projection.weight"] = torch.eye(hidden)
    missing, unexpected = te.load_state_dict(sd, strict=False)
    assert not unexpected and all(m.endswith("position_ids") for m in missing), (missing, unexpected)
    return te


def tiny_random_text_encoder(seed):
    torch.manual_seed(seed)
    cfg = CLIPTextConfig(vocab_size=49408, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=77, projection_dim=16, hidden_act="gelu",
                         bos_token_id=49406, eos_token_id=49407, pad_token_id=49407)
    return CLIPTextModelWithProjection(cfg).eval()


def make_transformer(a):
    t = SD3Transformer2DModel(sample_size=8, patch_size=1, in_channels=4, out_channels=4, num_layers=a.layers,
                              attention_head_dim=a.head_dim, num_attention_heads=a.heads, joint_attention_dim=80,
                              caption_projection_dim=a.heads * a.head_dim, pooled_projection_dim=80,
                              pos_embed_max_size=8, qk_norm="rms_norm")
    # DiT's initialisation (Peebles & Xie 2023, sec. 3.2, adaLN-Zero): every block starts as the identity (the
    # modulation layers' outputs, gates included, are zero) and the output layer predicts zero.
    with torch.no_grad():
        for name, mod in t.named_modules():
            if isinstance(mod, torch.nn.Linear):
                torch.nn.init.xavier_uniform_(mod.weight)
                if mod.bias is not None:
                    mod.bias.zero_()
        for blk in t.transformer_blocks:
            for n in ("norm1", "norm1_context"):
                lin = getattr(blk, n).linear
                lin.weight.zero_(), lin.bias.zero_()
        t.norm_out.linear.weight.zero_(), t.norm_out.linear.bias.zero_()
        t.proj_out.weight.zero_(), t.proj_out.bias.zero_()
        for emb in (t.time_text_embed.timestep_embedder, t.time_text_embed.text_embedder):
            torch.nn.init.normal_(emb.linear_1.weight, std=0.02), torch.nn.init.normal_(emb.linear_2.weight, std=0.02)
    return t


def check_zero_token_shortcut(model, pe, pp, n_zero):
    """The model's output on the full conditioning (CLIP tokens + n_zero zero tokens) against the shortcut's."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        # Random weights in place of the zero-initialised modulation, so that every path carries signal.
        probe = make_transformer_like(model)
        for p in probe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        x = torch.randn(3, 4, 8, 8, generator=g)
        t = torch.tensor([100.0, 500.0, 900.0])
        full = probe(hidden_states=x, encoder_hidden_states=pe[:3], pooled_projections=pp[:3], timestep=t,
                     return_dict=False)[0]
        ZERO_COPIES[0] = n_zero
        short = probe(hidden_states=x, encoder_hidden_states=pe[:3, :pe.shape[1] - n_zero + 1],
                      pooled_projections=pp[:3], timestep=t, return_dict=False)[0]
        ZERO_COPIES[0] = 1
    err = float((full - short).abs().max() / full.abs().max())
    print(f"zero-token shortcut: max relative difference {err:.2e}", flush=True)
    assert err < 1e-4, err
    assert float(pe[:, pe.shape[1] - n_zero:].abs().max()) == 0.0


def make_transformer_like(model):
    t = SD3Transformer2DModel.from_config(model.config)
    t.load_state_dict(model.state_dict())
    return t.eval()


def lr_at(step, a):
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    p = min(1.0, (step - a.warmup) / max(1, a.steps - a.warmup))
    return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))  # cosine to 10 %


def save_transformer(model, out):
    """float16 weights (the EMA's, rounded) except the float32 sine-cosine position grid, as a diffusers folder."""
    d = os.path.join(out, "transformer")
    os.makedirs(d, exist_ok=True)
    sd = {k: (v.float() if k == "pos_embed.pos_embed" else v.half()).contiguous() for k, v in model.state_dict().items()}
    tmp = os.path.join(d, "diffusion_pytorch_model.safetensors.tmp")
    save_file(sd, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(d, "diffusion_pytorch_model.safetensors"))
    cfg = dict(model.config)
    cfg = {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items() if not k.startswith("_")}
    cfg = {"_class_name": "SD3Transformer2DModel", "_diffusers_version": "0.31.0", **cfg}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def prepare(a, tmp):
    """Writes everything but the transformer; returns (latent mean, latent std, shift, scale, prompt table)."""
    out = a.out
    os.makedirs(out, exist_ok=True)
    cache = os.path.join(a.work, "latents.safetensors")
    vae = AutoencoderKL.from_pretrained(os.path.join(a.fashion_sd, "vae"), torch_dtype=torch.float32).eval()
    images, labels = fashion_images(a.data)
    if os.path.exists(cache):
        c = load_file(cache)
        mean, std = c["mean"], c["std"]
    else:
        t0 = time.time()
        ms, ss = [], []
        with torch.no_grad():
            for i in range(0, images.shape[0], 500):
                d = vae.encode(images[i:i + 500]).latent_dist
                ms.append(d.mean), ss.append(d.std)
        mean, std = torch.cat(ms), torch.cat(ss)
        save_file({"mean": mean.contiguous(), "std": std.contiguous()}, cache)
        print(f"encoded {mean.shape[0]} images to latents {tuple(mean.shape[1:])} in {time.time() - t0:.0f} s",
              flush=True)
    # SD 3's latent normalisation from a sample of posterior draws: z' = (z - shift) * scale.
    g = torch.Generator().manual_seed(1234)
    idx = torch.randperm(mean.shape[0], generator=g)[:8192]
    z = mean[idx] + std[idx] * torch.randn(mean[idx].shape, generator=g)
    shift = float(z.mean())
    scale = float(1.0 / (z - shift).std())
    vcfg = dict(vae.config)
    vcfg = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vcfg.items() if not k.startswith("_")}
    vcfg.update(shift_factor=shift, scaling_factor=scale)
    vdir = os.path.join(out, "vae")
    os.makedirs(vdir, exist_ok=True)
    shutil.copy(os.path.join(a.fashion_sd, "vae", "diffusion_pytorch_model.safetensors"), vdir)
    with open(os.path.join(vdir, "config.json"), "w") as f:
        json.dump({"_class_name": "AutoencoderKL", "_diffusers_version": "0.31.0", **vcfg}, f, indent=2)

    bpe_vocab_files(a.bpe, tmp)
    tok = CLIPTokenizer(os.path.join(tmp, "vocab.json"), os.path.join(tmp, "merges.txt"), pad_token="<|endoftext|>",
                        model_max_length=77)
    tok_2 = CLIPTokenizer(os.path.join(tmp, "vocab.json"), os.path.join(tmp, "merges.txt"), pad_token="!",
                          model_max_length=77)
    te = text_encoder_from_fashion_sd(os.path.join(a.fashion_sd, "text_encoder"))
    te_2 = tiny_random_text_encoder(a.seed + 2)
    with torch.no_grad():  # float16-exact, so the committed float16 file is the encoder that was trained with
        for p in te_2.parameters():
            p.copy_(p.half().float())
    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=a.shift)
    dummy = make_transformer(a)
    pipe = StableDiffusion3Pipeline(transformer=dummy, scheduler=sched, vae=vae, text_encoder=te, tokenizer=tok,
                                    text_encoder_2=te_2, tokenizer_2=tok_2, text_encoder_3=None, tokenizer_3=None)
    prompts = [t.format(c) for c in CLASSES for t in TEMPLATES] + [""]
    with torch.no_grad():
        pe, _, pp, _ = pipe.encode_prompt(prompts, None, None, do_classifier_free_guidance=False)
    # The folder without the transformer (written after training) and without vocab.json / merges.txt (our engine
    # bundles CLIP's vocabulary; diffusers needs them copied in).
    te.to(torch.float16), te_2.to(torch.float16)
    for name, m in (("text_encoder", te), ("text_encoder_2", te_2)):
        m.save_pretrained(os.path.join(out, name), safe_serialization=True)
    for name, t in (("tokenizer", tok), ("tokenizer_2", tok_2)):
        t.save_pretrained(os.path.join(out, name))
        for f in ("vocab.json", "merges.txt"):
            os.remove(os.path.join(out, name, f))
    sched.save_pretrained(os.path.join(out, "scheduler"))
    index = {"_class_name": "StableDiffusion3Pipeline", "_diffusers_version": "0.31.0",
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
             "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
             "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"], "text_encoder_3": [None, None],
             "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "CLIPTokenizer"],
             "tokenizer_3": [None, None], "transformer": ["diffusers", "SD3Transformer2DModel"],
             "vae": ["diffusers", "AutoencoderKL"]}
    with open(os.path.join(out, "model_index.json"), "w") as f:
        json.dump(index, f, indent=2)
    print(f"latents: shift_factor {shift:.5f} scaling_factor {scale:.5f}; prompt table {tuple(pe.shape)} "
          f"pooled {tuple(pp.shape)}", flush=True)
    return mean, std, shift, scale, labels, pe.float(), pp.float()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/fashion_mmdit_work", help="latent cache and checkpoints")
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--fashion-sd", default="assets/models/fashion-sd")
    ap.add_argument("--bpe", default="/work/shared/golden/sd/vocab/bpe_simple_vocab_16e6.txt.gz")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=24)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--ema", type=float, default=0.995)
    ap.add_argument("--caption-dropout", type=float, default=0.1)
    ap.add_argument("--shift", type=float, default=1.0)
    ap.add_argument("--time-budget", type=float, default=0, help="seconds of training; stop and save after (0: none)")
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    os.makedirs(a.work, exist_ok=True)
    tmp = tempfile.mkdtemp()
    mean, std, shift, scale, labels, pe, pp = prepare(a, tmp)
    shutil.rmtree(tmp)

    torch.manual_seed(a.seed)
    model = make_transformer(a).train()
    n_zero = 77  # diffusers 0.31 without T5: as many zero tokens as the CLIP window
    check_zero_token_shortcut(model, pe, pp, n_zero)
    pe = pe[:, :pe.shape[1] - n_zero + 1].contiguous()
    ZERO_COPIES[0] = n_zero
    ema = make_transformer(a).eval()
    ema.load_state_dict(model.state_dict())
    for p in ema.parameters():
        p.requires_grad_(False)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"transformer: {a.layers} blocks x {a.heads * a.head_dim} wide, {n_params / 1e6:.2f} M parameters", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.999), weight_decay=0.0)
    g = torch.Generator().manual_seed(a.seed + 1)
    n_templates = len(TEMPLATES)
    empty = pe.shape[0] - 1
    log = open(os.path.join(a.out, "train_mmdit_log.txt"), "w")
    log.write("# step loss(mean of the last 20 steps) lr elapsed_s\n")
    t0 = time.time()
    window = []
    step = 0
    for step in range(a.steps):
        idx = torch.randint(mean.shape[0], (a.batch,), generator=g)
        x0 = ((mean[idx] + std[idx] * torch.randn(mean[idx].shape, generator=g)) - shift) * scale
        cls = labels[idx]
        tpl = torch.randint(n_templates, (a.batch,), generator=g)
        row = cls * n_templates + tpl
        row = torch.where(torch.rand(a.batch, generator=g) < a.caption_dropout, torch.full_like(row, empty), row)
        t = torch.sigmoid(torch.randn(a.batch, generator=g))  # logit-normal(0, 1)
        eps = torch.randn(x0.shape, generator=g)
        tb = t.view(-1, 1, 1, 1)
        xt = (1 - tb) * x0 + tb * eps
        for group in opt.param_groups:
            group["lr"] = lr_at(step, a)
        v = model(hidden_states=xt, encoder_hidden_states=pe[row], pooled_projections=pp[row], timestep=t * 1000,
                  return_dict=False)[0]
        loss = F.mse_loss(v, eps - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        decay = min(a.ema, (1 + step) / (10 + step))
        with torch.no_grad():
            for pe_, pm in zip(ema.parameters(), model.parameters()):
                pe_.mul_(decay).add_(pm.detach(), alpha=1 - decay)
        window.append(float(loss))
        window = window[-20:]
        elapsed = time.time() - t0
        if (step + 1) % 10 == 0 or step == 0:
            log.write(f"{step + 1} {sum(window) / len(window):.5f} {lr_at(step, a):.6g} {elapsed:.1f}\n")
            log.flush()
        if (step + 1) % 50 == 0 or step == 0:
            print(f"step {step + 1}/{a.steps} loss {sum(window) / len(window):.4f} lr {lr_at(step, a):.2e} "
                  f"{elapsed / (step + 1):.2f} s/step", flush=True)
        if (step + 1) % a.save_every == 0:
            save_transformer(ema, a.out)
        if a.time_budget and elapsed > a.time_budget:
            print(f"time budget {a.time_budget:.0f} s reached at step {step + 1}", flush=True)
            break
    ZERO_COPIES[0] = 1
    save_transformer(ema, a.out)
    print(f"done: {step + 1} steps, {time.time() - t0:.0f} s, final loss {sum(window) / len(window):.4f}", flush=True)


if __name__ == "__main__":
    main()
