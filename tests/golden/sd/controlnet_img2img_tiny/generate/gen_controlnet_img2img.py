# ControlNet with img2img and inpainting: reference runs of the real, unmodified diffusers 0.27.2 pipelines
# StableDiffusionControlNetImg2ImgPipeline and StableDiffusionControlNetInpaintPipeline on the tiny SD 1.x models of
# the golden set (UNet ../unet_sd15_tiny, 9-channel UNet ../inpaint_tiny/unet_inpaint, VAE ../vae_tiny) and a tiny
# random ControlNet made here (controlnet/: ControlNetModel.from_unet(unet_sd15_tiny,
# conditioning_embedding_out_channels=(8, 16)), the recipe of ../shared/golden/sd/controlnet_tiny, weights drawn from
# seed CONTROLNET_SEED). Text conditioning: random prompt_embeds / negative_prompt_embeds (no text encoder).
#
# What each run records (the pipelines' own methods wrapped on the instance, never edited; every value is what the
# real __call__ computed):
#   prepare_control_image -> control_image.<k> (the prepared [B, 3, H, W] of ControlNet k, one CFG half);
#   vae.encode -> image_encode_mean/std (init image), masked_image_encode_mean/std (inpaint);
#   prepare_latents -> initial_latents (+ noise, image_latents for inpaint); randn_tensor of the img2img module ->
#   noise; prepare_mask_latents -> mask, masked_image_latents (one CFG half);
#   the ControlNets' forward -> control_scales [steps, K] (conditioning_scale of each call: scale x controlnet_keep);
#   the UNet's forward -> step.<i>.model_input (9 channels for the inpainting UNet), step.<i>.noise_pred (before CFG),
#   step.0.down.<j> / step.0.mid (the residuals the UNet got at the first step, all ControlNets summed);
#   callback_on_step_end -> step.<i>.latents (after the 4-channel inpaint blend), final_latents;
#   output_type "pt" -> image [B, 3, H, W] in [0, 1], image_uint8 = round(255 image) NHWC.
#
#   gen_controlnet_img2img.py GOLDEN_SD OUT      (GOLDEN_SD: tests/golden/sd; OUT: this case folder)
# Debian's torch 1.13, diffusers 0.27.2, Pillow; float32, one thread.
import hashlib
import json
import os
import sys

import numpy as np
import PIL
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

import diffusers
from diffusers import (AutoencoderKL, ControlNetModel, DDIMScheduler, DPMSolverMultistepScheduler,
                       EulerAncestralDiscreteScheduler, EulerDiscreteScheduler,
                       StableDiffusionControlNetImg2ImgPipeline, StableDiffusionControlNetInpaintPipeline,
                       UNet2DConditionModel)
from diffusers.pipelines.controlnet import MultiControlNetModel
from diffusers.pipelines.controlnet import pipeline_controlnet_img2img as cn_i2i_module

assert diffusers.__version__ == '0.27.2', diffusers.__version__
torch.set_num_threads(1)

# torch 1.13's baddbmm with beta=0 reads its uninitialised `input` buffer (diffusers' attention passes torch.empty):
# give it zeros, as every SD generator of the golden set does, so that the result never depends on stale memory.
_torch_baddbmm = torch.baddbmm


def _baddbmm_zeroed_input(input, b1, b2, *, beta=1, alpha=1, out=None):
    if beta == 0 and out is None:
        zeros = torch.zeros(b1.shape[0], b1.shape[1], b2.shape[2], dtype=b1.dtype, device=b1.device)
        return _torch_baddbmm(input, b1, b2, beta=beta, alpha=alpha, out=zeros)
    if out is not None:
        return _torch_baddbmm(input, b1, b2, beta=beta, alpha=alpha, out=out)
    return _torch_baddbmm(input, b1, b2, beta=beta, alpha=alpha)


torch.baddbmm = _baddbmm_zeroed_input

G, OUT = sys.argv[1], sys.argv[2]
CONTROLNET_SEED = 6101
SD15_SCHEDULER = {"_class_name": "PNDMScheduler", "num_train_timesteps": 1000, "beta_start": 0.00085,
                  "beta_end": 0.012, "beta_schedule": "scaled_linear", "trained_betas": None, "steps_offset": 1,
                  "set_alpha_to_one": False, "clip_sample": False, "skip_prk_steps": True,
                  "prediction_type": "epsilon", "timestep_spacing": "leading"}
SCHEDULERS = {'DDIMScheduler': DDIMScheduler, 'EulerDiscreteScheduler': EulerDiscreteScheduler,
              'EulerAncestralDiscreteScheduler': EulerAncestralDiscreteScheduler,
              'DPMSolverMultistepScheduler': DPMSolverMultistepScheduler}
MODELS = {'unet': '../unet_sd15_tiny', 'unet_inpaint': '../inpaint_tiny/unet_inpaint', 'vae': '../vae_tiny',
          'controlnet': 'controlnet'}


def load_model(cls, folder):
    """A diffusers model from its config and its (float32 or float16-valued) safetensors, in float32."""
    model = cls.from_config(cls.load_config(folder))
    for name in ('diffusion_pytorch_model.safetensors', 'diffusion_pytorch_model.fp16.safetensors'):
        if os.path.exists(os.path.join(folder, name)):
            state = {k: v.float() for k, v in load_file(os.path.join(folder, name)).items()}
            model.load_state_dict(state)
            return model.eval()
    raise FileNotFoundError(folder)


def make_controlnet(unet):
    """ControlNetModel.from_unet, then every parameter N(0, 0.05), norm weights + 1, rounded to float16 values."""
    net = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(8, 16))
    gen = torch.Generator().manual_seed(CONTROLNET_SEED)
    with torch.no_grad():
        for name, p in net.named_parameters():
            v = torch.randn(p.shape, generator=gen) * 0.05
            if 'norm' in name and name.endswith('weight'):
                v += 1.0
            p.copy_(v.half().float())
    return net.eval()


def rgb_image(w, h, seed):
    """Smooth gradient + noise, uint8 RGB."""
    gen = torch.Generator().manual_seed(seed)
    y, x = torch.meshgrid(torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32), indexing='ij')
    base = torch.stack([255 * x / max(w - 1, 1), 255 * y / max(h - 1, 1), 255 * (x + y) / max(w + h - 2, 1)], -1)
    noisy = base + 40 * torch.randn((h, w, 3), generator=gen)
    return noisy.round().clamp(0, 255).to(torch.uint8).numpy()


def control_image(w, h, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand((h, w, 3), generator=gen) * 255).round().to(torch.uint8).numpy()


def mask_image(w, h):
    """White (255) = repaint: a rectangle, a ramp 118..137 across one row (binarised at 0.5), a 1-pixel stripe."""
    m = np.zeros((h, w), np.uint8)
    m[h // 4:3 * h // 4, w // 4:3 * w // 4] = 255
    m[h - 2, :] = np.linspace(118, 137, w).round().astype(np.uint8)
    m[1, :] = 255
    return m


def sha(path):
    return hashlib.sha256(open(path, 'rb').read()).hexdigest()


def write_png(array, name, mode):
    path = os.path.join(OUT, name)
    if not os.path.exists(path):
        Image.fromarray(array, mode).save(path)
    return name


RUNS = {
    'i2i_ddim10_s0.6_scale0.8': dict(
        pipeline='img2img', scheduler='DDIMScheduler', steps=10, strength=0.6, guidance_scale=6.0, seed=11,
        init='init_16x16.png', controlnets=[dict(image='control_16x16.png', scale=0.8)]),
    'i2i_euler_a10_s0.75_guess_batch2': dict(
        pipeline='img2img', scheduler='EulerAncestralDiscreteScheduler', steps=10, strength=0.75, guidance_scale=5.0,
        seed=12, images_per_prompt=2, guess_mode=True, init='init_16x16.png',
        controlnets=[dict(image='control_16x16.png', scale=1.2, start=0.1, end=0.9)]),
    'i2i_dpm8_s0.5_control20_prompts2': dict(
        pipeline='img2img', scheduler='DPMSolverMultistepScheduler', steps=8, strength=0.5, guidance_scale=7.5,
        seed=13, prompts=2, width=16, height=16, init='init_16x16.png',
        controlnets=[dict(image='control_20x20.png', scale=1.0, start=0.25)]),
    'i2i_euler10_s1.0_32x16_nocfg': dict(
        pipeline='img2img', scheduler='EulerDiscreteScheduler', steps=10, strength=1.0, guidance_scale=1.0, seed=14,
        init='init_32x16.png', controlnets=[dict(image='control_32x16.png', scale=0.7, end=0.5)]),
    'i2i_ddim10_s0.8_two_controlnets': dict(
        pipeline='img2img', scheduler='DDIMScheduler', steps=10, strength=0.8, guidance_scale=6.0, seed=15,
        init='init_16x16.png', controlnets=[dict(image='control_16x16.png', scale=0.6, end=0.8),
                                            dict(image='control_20x20.png', scale=0.4, start=0.3)],
        width=16, height=16),
    'inp4_ddim10_s1.0_scale0.5': dict(
        pipeline='inpaint', unet='unet', scheduler='DDIMScheduler', steps=10, strength=1.0, guidance_scale=7.5,
        seed=21, init='init_16x16.png', mask='mask_16x16.png', controlnets=[dict(image='control_16x16.png', scale=0.5)]),
    'inp4_euler10_s0.75_guess_batch2': dict(
        pipeline='inpaint', unet='unet', scheduler='EulerDiscreteScheduler', steps=10, strength=0.75,
        guidance_scale=7.5, seed=22, images_per_prompt=2, guess_mode=True, init='init_16x16.png',
        mask='mask_16x16.png', controlnets=[dict(image='control_16x16.png', scale=1.0, end=0.7)]),
    'inp9_ddim10_s1.0_start0.2': dict(
        pipeline='inpaint', unet='unet_inpaint', scheduler='DDIMScheduler', steps=10, strength=1.0,
        guidance_scale=7.5, seed=23, init='init_16x16.png', mask='mask_16x16.png',
        controlnets=[dict(image='control_16x16.png', scale=0.9, start=0.2)]),
    'inp9_euler_a10_s0.6_guess_prompts2': dict(
        pipeline='inpaint', unet='unet_inpaint', scheduler='EulerAncestralDiscreteScheduler', steps=10, strength=0.6,
        guidance_scale=4.0, seed=24, prompts=2, guess_mode=True, init='init_32x16.png', mask='mask_32x16.png',
        controlnets=[dict(image='control_16x16.png', scale=1.1)], width=32, height=16),
}


def run_case(name, run, models, net):
    P, n = run.get('prompts', 1), run.get('images_per_prompt', 1)
    B = P * n
    seed = run['seed']
    cfg_on = run['guidance_scale'] > 1.0
    pe = torch.randn((P, 77, 32), generator=torch.Generator().manual_seed(seed + 1000))
    ne = torch.randn((P, 77, 32), generator=torch.Generator().manual_seed(seed + 2000))
    unet = models[run.get('unet', 'unet')]
    units = run['controlnets']
    nets = net if len(units) == 1 else MultiControlNetModel([net] * len(units))
    sched = SCHEDULERS[run['scheduler']].from_config(SD15_SCHEDULER)
    common = dict(vae=models['vae'], text_encoder=None, tokenizer=None, unet=unet, controlnet=nets, scheduler=sched,
                  safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    inpaint = run['pipeline'] == 'inpaint'
    pipe = (StableDiffusionControlNetInpaintPipeline if inpaint else StableDiffusionControlNetImg2ImgPipeline)(**common)
    pipe.set_progress_bar_config(disable=True)
    T = {'prompt_embeds': pe, 'negative_prompt_embeds': ne}
    half = (lambda x: x.chunk(2)[0]) if cfg_on else (lambda x: x)

    # --- the wrappers (instance attributes; the pipeline code is not changed) ---
    controls = []
    orig_prepare_control = pipe.prepare_control_image

    def prepare_control_image(*a, **k):
        out = orig_prepare_control(*a, **k)
        guess = k.get('guess_mode', False)
        controls.append(out.chunk(2)[0] if cfg_on and not guess else out)
        return out
    pipe.prepare_control_image = prepare_control_image

    encodes = []
    vae = models['vae']

    def encode(x, *a, **k):
        out = type(vae).encode(vae, x, *a, **k)
        encodes.append((out.latent_dist.mean.clone(), out.latent_dist.std.clone()))
        return out
    models['vae'].encode = encode

    noises = []
    orig_randn = cn_i2i_module.randn_tensor

    def randn_tensor(*a, **k):
        r = orig_randn(*a, **k)
        noises.append(r.clone())
        return r
    cn_i2i_module.randn_tensor = randn_tensor

    orig_prepare_latents = pipe.prepare_latents

    def prepare_latents(*a, **k):
        out = orig_prepare_latents(*a, **k)
        if inpaint:
            T['initial_latents'] = out[0].clone()
            T['noise'] = out[1].clone()
            if len(out) > 2:
                T['image_latents'] = out[2].clone()
        else:
            T['initial_latents'] = out.clone()
        return out
    pipe.prepare_latents = prepare_latents

    if inpaint:
        orig_mask_latents = pipe.prepare_mask_latents

        def prepare_mask_latents(*a, **k):
            mask, masked = orig_mask_latents(*a, **k)
            T['mask'] = half(mask).clone()
            T['masked_image_latents'] = half(masked).clone()
            return mask, masked
        pipe.prepare_mask_latents = prepare_mask_latents

    # The ControlNet: one module (a MultiControlNetModel holds it once per unit), called once per unit and step.
    scales = []
    cn_calls = [0]

    def cn_forward(*a, **kw):
        if cn_calls[0] % len(units) == 0:
            scales.append([])
        cn_calls[0] += 1
        scales[-1].append(float(kw['conditioning_scale']))
        return type(net).forward(net, *a, **kw)
    net.forward = cn_forward

    steps = []
    def unet_forward(sample, t, *a, **kw):
        out = type(unet).forward(unet, sample, t, *a, **kw)
        rec = {'model_input': sample.clone(), 'noise_pred': out[0].clone(), 'timestep': float(t)}
        if not steps:
            down = kw.get('down_block_additional_residuals')
            for j, d in enumerate(down):
                rec[f'down.{j}'] = d.clone()
            rec['mid'] = kw['mid_block_additional_residual'].clone()
        steps.append(rec)
        return out
    unet.forward = unet_forward

    lat = []

    def cb(p, i, t, kw):
        lat.append(kw['latents'].clone())
        return kw

    # --- the call ---
    init = Image.open(os.path.join(OUT, run['init']))
    cimgs = [Image.open(os.path.join(OUT, u['image'])) for u in units]
    kwargs = dict(prompt_embeds=pe, negative_prompt_embeds=ne, image=init,
                  control_image=cimgs[0] if len(units) == 1 else cimgs,
                  strength=run['strength'], num_inference_steps=run['steps'], guidance_scale=run['guidance_scale'],
                  num_images_per_prompt=n, eta=0.0, guess_mode=run.get('guess_mode', False),
                  controlnet_conditioning_scale=(units[0]['scale'] if len(units) == 1 else [u['scale'] for u in units]),
                  control_guidance_start=(units[0].get('start', 0.0) if len(units) == 1
                                          else [u.get('start', 0.0) for u in units]),
                  control_guidance_end=(units[0].get('end', 1.0) if len(units) == 1
                                        else [u.get('end', 1.0) for u in units]),
                  generator=torch.Generator().manual_seed(seed), output_type='pt', callback_on_step_end=cb)
    if 'width' in run:
        kwargs['width'], kwargs['height'] = run['width'], run['height']
    if inpaint:
        kwargs['mask_image'] = Image.open(os.path.join(OUT, run['mask']))
    try:
        with torch.no_grad():
            img = pipe(**kwargs).images
    finally:  # the instance attributes removed: the class methods again
        del unet.forward, net.forward, models['vae'].encode
        cn_i2i_module.randn_tensor = orig_randn

    # --- what the run computed ---
    T['init_image_uint8'] = torch.from_numpy(np.array(init.convert('RGB')))
    if inpaint:
        T['mask_image_uint8'] = torch.from_numpy(np.array(kwargs['mask_image'].convert('L')))
    for k, (u, c) in enumerate(zip(cimgs, controls)):
        T[f'control_image_uint8.{k}'] = torch.from_numpy(np.array(u.convert('RGB')))
        T[f'control_image.{k}'] = c.clone()
    # encode order: the init image (img2img always; inpaint when its prepare_latents encodes), the masked image
    if inpaint:
        if 'image_latents' in T or run['strength'] < 1.0:
            T['image_encode_mean'], T['image_encode_std'] = (e.clone() for e in encodes[0])
        T['masked_image_encode_mean'], T['masked_image_encode_std'] = encodes[-1]
    else:
        T['image_encode_mean'], T['image_encode_std'] = (e.clone() for e in encodes[0])
        T['noise'] = noises[-1]
    assert len(steps) == len(lat), (len(steps), len(lat))
    T['timesteps'] = torch.tensor([s['timestep'] for s in steps], dtype=torch.float64)
    T['control_scales'] = torch.tensor(scales, dtype=torch.float64)
    for i, s in enumerate(steps):
        for key, v in s.items():
            if key != 'timestep':
                T[f'step.{i}.{key}'] = v
        T[f'step.{i}.latents'] = lat[i]
    T['final_latents'] = lat[-1].clone()
    T['image'] = img
    T['image_uint8'] = (img * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()
    save_file({k: v.contiguous() for k, v in T.items()}, os.path.join(OUT, name + '.safetensors'))
    out = dict(run)
    out['pipeline'] = type(pipe).__name__
    out.setdefault('unet', 'unet')
    out.update(prompts=P, images_per_prompt=n, batch=B, guess_mode=run.get('guess_mode', False),
               timesteps_run=[s['timestep'] for s in steps],
               output_width=int(img.shape[3]), output_height=int(img.shape[2]))
    out['controlnets'] = [dict(image=u['image'], scale=u['scale'], start=u.get('start', 0.0), end=u.get('end', 1.0))
                          for u in units]
    if 'mask' in run:
        out['mask'] = run['mask']
    return out


def main():
    os.makedirs(OUT, exist_ok=True)
    unet = load_model(UNet2DConditionModel, os.path.join(G, 'unet_sd15_tiny'))
    models = {'unet': unet, 'unet_inpaint': load_model(UNet2DConditionModel, os.path.join(G, 'inpaint_tiny',
                                                                                            'unet_inpaint')),
              'vae': load_model(AutoencoderKL, os.path.join(G, 'vae_tiny'))}
    net = make_controlnet(unet)
    cdir = os.path.join(OUT, 'controlnet')
    os.makedirs(cdir, exist_ok=True)
    net.save_config(cdir)
    save_file({k: v.half().contiguous() for k, v in net.state_dict().items()},
              os.path.join(cdir, 'diffusion_pytorch_model.fp16.safetensors'))
    write_png(rgb_image(16, 16, 9301), 'init_16x16.png', 'RGB')
    write_png(rgb_image(32, 16, 9302), 'init_32x16.png', 'RGB')
    write_png(control_image(16, 16, 9311), 'control_16x16.png', 'RGB')
    write_png(control_image(20, 20, 9312), 'control_20x20.png', 'RGB')
    write_png(control_image(32, 16, 9313), 'control_32x16.png', 'RGB')
    write_png(mask_image(16, 16), 'mask_16x16.png', 'L')
    write_png(mask_image(32, 16), 'mask_32x16.png', 'L')
    runs = {}
    for name, run in RUNS.items():
        runs[name] = run_case(name, run, models, net)
        print(name, 'ok', runs[name]['timesteps_run'], flush=True)
    cfg = {
        'class': 'ControlNetImg2ImgInpaint',
        'reference': 'diffusers 0.27.2 StableDiffusionControlNetImg2ImgPipeline / StableDiffusionControlNetInpaintPipeline '
                     '__call__ (generate/gen_controlnet_img2img.py)',
        'generated_with': {'diffusers': diffusers.__version__, 'torch': torch.__version__, 'pillow': PIL.__version__},
        'models': MODELS,
        'controlnet_init': f'ControlNetModel.from_unet(unet_sd15_tiny, conditioning_embedding_out_channels=(8, 16)); '
                           f'every parameter N(0, 0.05) from seed {CONTROLNET_SEED}, norm weights + 1, float16 values',
        'scheduler_base_config': SD15_SCHEDULER,
        'vae_scale_factor': 2,
        'text_conditioning': 'prompt_embeds randn((prompts, 77, 32), seed + 1000), negative_prompt_embeds seed + 2000',
        'files_sha256': {f: sha(os.path.join(OUT, f)) for f in sorted(os.listdir(OUT)) if f.endswith('.png')},
        'runs': runs,
    }
    json.dump(cfg, open(os.path.join(OUT, 'controlnet_img2img.json'), 'w'), indent=1)


if __name__ == '__main__':
    main()
