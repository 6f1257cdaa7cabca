#!/usr/bin/env python3
"""A random-weight SD 1.5 pipeline in a peer engine, timed per part: OpenVINO (optimum-intel) or diffusers on PyTorch.

usage: sd15_pipeline_peer.py --backend openvino|torch --peers PEERS --vocab BPE.txt.gz --workdir DIR [--size 512]
                             [--reps 3] [--threads 2] [--precision f32|bf16] [--steps 20] [--parts unet,vae,pipeline]
                             [--pipeline-reps N]

The pipeline folder (diffusers layout: SD 1.5's UNet and VAE configs from PEERS/make_random_sd15.py, a CLIP ViT-L/14
text encoder, the CLIP tokenizer written from the BPE merges file, PNDM as SD 1.5 ships) is made once with random
weights under DIR/sd15-random.
- openvino: exported once to OpenVINO IR under DIR/sd15-openvino, then loaded, reshaped to one image of SIZE x SIZE
  (static shapes, as Intel's published pipeline runs) and compiled for the CPU with INFERENCE_NUM_THREADS and
  INFERENCE_PRECISION_HINT.
- torch: diffusers' StableDiffusionPipeline on the installed PyTorch (SDPA attention on 2.x), the modules cast to
  bfloat16 for --precision bf16.
Prints one line per timing, in seconds (the prefix names the backend: ov_ or torch_):
  ov_unet_step_s SIZE T      one UNet request on the CFG batch (2 latents)
  ov_vae_decode_s SIZE T     one VAE decoder request
  ov_pipeline_s SIZE T       the whole STEPS-step txt2img call (text encoder, STEPS CFG steps, decode)
"""
import argparse
import gzip
import json
import os
import sys
import time
from pathlib import Path


def write_clip_tokenizer(bpe_gz: Path, out: Path) -> None:
    """vocab.json / merges.txt of the CLIP tokenizer, derived from OpenAI's merges file the way its tokenizer builds
    its vocabulary: the 256 byte symbols, the same with the end-of-word mark, one symbol per merge, then the two
    special tokens."""
    lines = gzip.open(bpe_gz, "rt", encoding="utf-8").read().split("\n")
    merges = [tuple(l.split()) for l in lines[1 : 49152 - 256 - 2 + 1]]
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    symbols = [chr(c) for c in cs]
    vocab = symbols + [s + "</w>" for s in symbols] + ["".join(m) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(vocab)}, ensure_ascii=False))
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 77, "pad_token": "<|endoftext|>",
                                                           "bos_token": "<|startoftext|>",
                                                           "eos_token": "<|endoftext|>",
                                                           "unk_token": "<|endoftext|>"}))


def make_pipeline_folder(peers: Path, bpe_gz: Path, out: Path) -> None:
    import torch
    from diffusers import AutoencoderKL, PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    sys.path.insert(0, str(peers))
    import make_random_sd15 as m

    torch.manual_seed(0)
    unet = UNet2DConditionModel(**m.UNET_CONFIG).eval()
    vae = AutoencoderKL(**m.VAE_CONFIG).eval()
    c = m.CLIP_CONFIG
    text = CLIPTextModel(CLIPTextConfig(vocab_size=c["vocab_size"], hidden_size=c["hidden"],
                                        num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
                                        intermediate_size=c["intermediate"], max_position_embeddings=c["positions"],
                                        hidden_act="quick_gelu", projection_dim=768)).eval()
    tok_dir = out.parent / (out.name + "-tokenizer")
    write_clip_tokenizer(bpe_gz, tok_dir)
    tokenizer = CLIPTokenizer.from_pretrained(str(tok_dir))
    scheduler = PNDMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                              num_train_timesteps=1000, skip_prk_steps=True, steps_offset=1, set_alpha_to_one=False)
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    tmp = out.parent / (out.name + ".tmp")
    pipe.save_pretrained(str(tmp))
    os.replace(tmp, out)


def versions_line(backend: str, extra: str) -> str:
    import diffusers
    import torch
    line = f"# {backend}: diffusers {diffusers.__version__}, torch {torch.__version__}"
    if backend == "openvino":
        import openvino
        from importlib.metadata import version
        line += f", openvino {openvino.__version__}, optimum-intel {version('optimum-intel')}"
    else:
        line += f", mkldnn {torch.backends.mkldnn.is_available()}, threads {torch.get_num_threads()}"
    return line + ", " + extra


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=["openvino", "torch"], default="openvino")
    ap.add_argument("--peers", required=True, type=Path)
    ap.add_argument("--vocab", required=True, type=Path)
    ap.add_argument("--workdir", required=True, type=Path)
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--parts", default="unet,vae,pipeline")
    ap.add_argument("--pipeline-reps", type=int, default=0, help="timed whole-pipeline calls (default: --reps)")
    a = ap.parse_args()
    parts = set(a.parts.split(","))
    if not a.vocab.is_file():
        sys.exit(f"error: --vocab: no file {a.vocab} (the CLIP BPE merges, assets/vocab/clip/bpe_simple_vocab_16e6.txt.gz)")
    unknown = parts - {"unet", "vae", "pipeline"}
    if unknown:
        sys.exit(f"error: --parts: unknown part(s) {sorted(unknown)}; expected unet, vae, pipeline")

    import numpy as np
    import torch

    torch.set_num_threads(a.threads)
    a.workdir.mkdir(parents=True, exist_ok=True)
    src = a.workdir / "sd15-random"
    if not src.exists():
        make_pipeline_folder(a.peers, a.vocab, src)
    s = a.size // 8
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4, s, s), dtype=np.float32)
    ctx = rng.standard_normal((2, 77, 768), dtype=np.float32)
    z = rng.standard_normal((1, 4, s, s), dtype=np.float32)

    if a.backend == "openvino":
        from optimum.intel import OVStableDiffusionPipeline

        ir = a.workdir / "sd15-openvino"
        ov_config = {"INFERENCE_NUM_THREADS": str(a.threads),
                     "INFERENCE_PRECISION_HINT": "f32" if a.precision == "f32" else "bf16"}
        if not ir.exists():
            pipe = OVStableDiffusionPipeline.from_pretrained(str(src), export=True, compile=False)
            tmp = a.workdir / "sd15-openvino.tmp"
            pipe.save_pretrained(str(tmp))
            os.replace(tmp, ir)
            del pipe
        pipe = OVStableDiffusionPipeline.from_pretrained(str(ir), compile=False, ov_config=ov_config)
        pipe.reshape(batch_size=1, height=a.size, width=a.size, num_images_per_prompt=1)
        pipe.compile()
        print(versions_line("openvino", str(ov_config)), flush=True)
        prefix = "ov"
        unet = lambda: pipe.unet(sample=x, timestep=np.array([999], dtype=np.int64), encoder_hidden_states=ctx)
        vae = lambda: pipe.vae_decoder(latent_sample=z)
    else:
        from diffusers import StableDiffusionPipeline

        dtype = torch.float32 if a.precision == "f32" else torch.bfloat16
        pipe = StableDiffusionPipeline.from_pretrained(str(src), torch_dtype=dtype, safety_checker=None)
        pipe.set_progress_bar_config(disable=True)
        print(versions_line("torch", f"dtype {dtype}"), flush=True)
        prefix = "torch"
        xt, ct, zt = (torch.from_numpy(v).to(dtype) for v in (x, ctx, z))
        tt = torch.tensor([999, 999])

        def unet():
            with torch.no_grad():
                pipe.unet(xt, tt, encoder_hidden_states=ct)

        def vae():
            with torch.no_grad():
                pipe.vae.decode(zt)

    def timed(label, fn, warm=True, reps=a.reps):
        if warm:
            fn()
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            print(f"{prefix}_{label} {a.size} {time.perf_counter() - t0:.3f}", flush=True)

    if "unet" in parts:
        timed("unet_step_s", unet)
    if "vae" in parts:
        timed("vae_decode_s", vae)
    if "pipeline" in parts:
        call = lambda: pipe("a red dress on a wooden table", num_inference_steps=a.steps, guidance_scale=7.5,
                            height=a.size, width=a.size, output_type="np")
        # no warm-up call: the UNet and VAE requests above warmed the same compiled models; alone, one short run
        timed("pipeline_s", call, warm=not ({"unet", "vae"} & parts), reps=a.pipeline_reps or a.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
