# Hires fix reference runs (AUTOMATIC1111's txt2img "Hires. fix", modules/processing.py
# StableDiffusionProcessingTxt2Img.sample / sample_hr_pass) built from the real, unmodified diffusers 0.27.2 pipelines
# on the tiny SD 1.x models of the golden set:
#   1. StableDiffusionPipeline.__call__(output_type="latent") at the base size;
#   2. the upscale: "Latent" = F.interpolate(latents, size=(H // f, W // f), mode="bilinear", antialias=False),
#      "Latent (nearest)" = mode "nearest"; "Lanczos" = VAE decode, A1111's uint8 (255 * clamp((x + 1) / 2, 0, 1)
#      truncated), A1111's Upscaler.upscale chain of PIL Lanczos resizes (images.resize_image mode 0), then the image;
#   3. StableDiffusionImg2ImgPipeline.__call__(image=<latents [B, 4, h, w] or the PIL images>, strength=D,
#      num_inference_steps=hires steps or steps) with a new generator seeded with the same seed (A1111 draws the
#      second pass's noise from the image's seed again), output_type="pt".
# Target size: A1111's int(width * scale), int(height * scale), rounded down to a multiple of the VAE factor f (A1111's
# latent interpolation to target // 8 is that rounding for f = 8; the tiny VAE has f = 2).
# Text conditioning: the HF CLIPTextModel equations on the stored weights (clip_ref.py), passed as prompt_embeds.
#
#   gen_hires.py GOLDEN_SD OUT    (GOLDEN_SD: tests/golden/sd; OUT: tests/golden/sd/hires_tiny)
# Needs CLIP_TOKENIZER_DIR (openai/CLIP's clip/ folder) and tests/golden/sd/anchorcache_cases/generate on PYTHONPATH.
import json, os, sys, torch, numpy as np
import baddbmm_fix  # noqa: F401  (torch 1.13's baddbmm beta=0 guard, as every SD generator here)
sys.path.insert(0, os.environ['CLIP_TOKENIZER_DIR'])
from clip_ref import clip_reference
from PIL import Image
import PIL
from safetensors.torch import save_file
import diffusers
from diffusers import (UNet2DConditionModel, AutoencoderKL, DDIMScheduler, EulerDiscreteScheduler,
                       EulerAncestralDiscreteScheduler, StableDiffusionPipeline, StableDiffusionImg2ImgPipeline)
from diffusers.pipelines.stable_diffusion import pipeline_stable_diffusion_img2img as i2i_mod
assert diffusers.__version__ == '0.27.2', diffusers.__version__
torch.set_num_threads(1)
G = sys.argv[1]; OUT = sys.argv[2]
ids, te = clip_reference(G)
unet = UNet2DConditionModel.from_pretrained(G + '/unet_sd15_tiny').eval()
vae = AutoencoderKL.from_pretrained(G + '/vae_tiny').eval()
F = 2 ** (len(vae.config.block_out_channels) - 1)
BASE = json.load(open(G + '/pipeline_tiny/config.json'))['scheduler_base_config']
CLS = {'DDIMScheduler': DDIMScheduler, 'EulerDiscreteScheduler': EulerDiscreteScheduler,
       'EulerAncestralDiscreteScheduler': EulerAncestralDiscreteScheduler}
LANCZOS = Image.LANCZOS
LATENT_MODES = {'latent': ('bilinear', False), 'latent-antialiased': ('bilinear', True),
                'latent-bicubic': ('bicubic', False), 'latent-bicubic-antialiased': ('bicubic', True),
                'latent-nearest': ('nearest', False), 'latent-nearest-exact': ('nearest-exact', False)}

NOISE = []
_rt = i2i_mod.randn_tensor
def _randn(*a, **k):
    r = _rt(*a, **k); NOISE.append(r.clone()); return r
i2i_mod.randn_tensor = _randn


def plan(w, h, run):
    # calculate_target_resolution with F for A1111's opt_f: (target w, h, upscale w, h, crop x, y in latent cells)
    x, y = run.get('hires_width', 0), run.get('hires_height', 0)
    if not x and not y:
        tw, th = int(w * run['hires_scale']), int(h * run['hires_scale'])
        tw, th = tw - tw % F, th - th % F
        return tw, th, tw, th, 0, 0
    cx = cy = 0
    if y == 0:
        uw, uh = x, x * h // w
    elif x == 0:
        uw, uh = y * w // h, y
    else:
        if w / h < x / y:
            uw, uh = x, x * h // w
        else:
            uw, uh = y * w // h, y
        cx, cy = (uw - x) // F, (uh - y) // F
    tw, th = (x, y) if x and y else (uw // F * F, uh // F * F)
    return tw, th, uw, uh, cx, cy


def a1111_lanczos_upscale(im, w, h):
    # images.resize_image(0, im, w, h, upscaler_name="Lanczos"): UpscalerLanczos through Upscaler.upscale (one
    # int(size * scale) resize, then to the size rounded down to the VAE factor), then to (w, h) when that differs.
    scale = max(w / im.width, h / im.height)
    if scale > 1.0:
        dest_w = int((im.width * scale) // F * F); dest_h = int((im.height * scale) // F * F)
        for _ in range(3):
            shape = (im.width, im.height)
            im = im.resize((int(im.width * scale), int(im.height * scale)), resample=LANCZOS)
            if shape == (im.width, im.height) or (im.width >= dest_w and im.height >= dest_h):
                break
        if im.width != dest_w or im.height != dest_h:
            im = im.resize((dest_w, dest_h), resample=LANCZOS)
    if im.width != w or im.height != h:
        im = im.resize((w, h), resample=LANCZOS)
    return im


def run_case(name, run):
    NOISE.clear()
    pid = torch.tensor([ids(run['prompt'])]); nid = torch.tensor([ids(run.get('negative_prompt', ''))])
    with torch.no_grad():
        pe = te(pid); ne = te(nid)
    n = run.get('batch_size', 1); seed = run['seed']; sched = run['scheduler']
    W, H = run['width'], run['height']
    tw, th, uw, uh, cx, cy = plan(W, H, run)
    common = dict(prompt_embeds=pe, negative_prompt_embeds=ne, guidance_scale=run['guidance_scale'],
                  num_images_per_prompt=n)
    if sched == 'DDIMScheduler': common['eta'] = 0.0
    p1 = StableDiffusionPipeline(vae=vae, text_encoder=None, tokenizer=None, unet=unet,
                                 scheduler=CLS[sched].from_config(BASE), safety_checker=None, feature_extractor=None,
                                 requires_safety_checker=False)
    p1.set_progress_bar_config(disable=True)
    with torch.no_grad():
        base = p1(height=H, width=W, num_inference_steps=run['steps'], generator=torch.Generator().manual_seed(seed),
                  output_type='latent', **common).images
    T = {'prompt_embeds': torch.cat([ne, pe]), 'base_latents': base.clone()}
    up = run['upscaler']
    if up in LATENT_MODES:
        mode, aa = LATENT_MODES[up]  # A1111's shared.latent_upscale_modes
        image = torch.nn.functional.interpolate(base, size=(uh // F, uw // F), mode=mode, antialias=aa)
        image = image[:, :, cy // 2:image.shape[2] - (cy + 1) // 2, cx // 2:image.shape[3] - (cx + 1) // 2]
        T['upscaled_latents'] = image.clone()
    elif up == 'lanczos':
        with torch.no_grad():
            dec = vae.decode(base / vae.config.scaling_factor).sample
        low = torch.clamp((dec + 1.0) / 2.0, min=0.0, max=1.0)
        u8 = (255. * low.permute(0, 2, 3, 1).numpy()).astype(np.uint8)  # A1111: astype truncates
        T['base_image_uint8'] = torch.from_numpy(u8.copy())
        image = [a1111_lanczos_upscale(Image.fromarray(x), uw, uh) for x in u8]
        # hr_resize_x and _y of another aspect: A1111 crops the encoded latents, we the image by the same cells
        image = [i.crop((cx // 2 * F, cy // 2 * F, cx // 2 * F + tw, cy // 2 * F + th)) for i in image]
        T['upscaled_image_uint8'] = torch.from_numpy(np.stack([np.array(i) for i in image]))
    else:
        raise ValueError(up)
    p2 = StableDiffusionImg2ImgPipeline(vae=vae, text_encoder=None, tokenizer=None, unet=unet,
                                        scheduler=CLS[sched].from_config(BASE), safety_checker=None,
                                        feature_extractor=None, requires_safety_checker=False)
    p2.set_progress_bar_config(disable=True)
    lat = []
    def cb(p, i, t, kw):
        lat.append(kw['latents'].clone()); return kw
    NOISE.clear()
    with torch.no_grad():
        img = p2(image=image, strength=run['hires_denoise'], num_inference_steps=run.get('hires_steps') or run['steps'],
                 generator=torch.Generator().manual_seed(seed), output_type='pt', callback_on_step_end=cb,
                 **common).images
    T['hires_noise'] = NOISE[-1]
    T['final_latents'] = lat[-1]
    T['image'] = img
    T['image_uint8'] = (img * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()
    assert T['image_uint8'].shape[1:3] == (th, tw), (T['image_uint8'].shape, th, tw)
    save_file({k: v.contiguous() for k, v in T.items()}, os.path.join(OUT, name + '.safetensors'))
    return dict(run, hires_steps_run=len(lat), target_width=tw, target_height=th)


RUNS = {
    'latent_x2_euler_a_seed42': dict(upscaler='latent', hires_scale=2.0, scheduler='EulerAncestralDiscreteScheduler',
                                     steps=6, hires_denoise=0.55, seed=42),
    'latent_x1.3_ddim_seed7_batch2': dict(upscaler='latent', hires_scale=1.3, scheduler='DDIMScheduler', steps=6,
                                          hires_steps=8, hires_denoise=0.6, seed=7, batch_size=2),
    'latent_nearest_x2_euler_seed7': dict(upscaler='latent-nearest', hires_scale=2.0,
                                          scheduler='EulerDiscreteScheduler', steps=5, hires_denoise=0.7, seed=7),
    'lanczos_x2_euler_seed7': dict(upscaler='lanczos', hires_scale=2.0, scheduler='EulerDiscreteScheduler', steps=6,
                                   hires_steps=5, hires_denoise=0.7, seed=7),
    'lanczos_x1.3_euler_a_seed42': dict(upscaler='lanczos', hires_scale=1.3,
                                        scheduler='EulerAncestralDiscreteScheduler', steps=6, hires_denoise=0.5,
                                        seed=42),
    'lanczos_40x36_ddim_seed42_batch2': dict(upscaler='lanczos', hires_width=40, hires_height=36,
                                             scheduler='DDIMScheduler', steps=5, hires_denoise=0.8, seed=42,
                                             batch_size=2),
    'latent_bicubic_aa_48x48_euler_seed3': dict(upscaler='latent-bicubic-antialiased', hires_width=48,
                                                hires_height=48, scheduler='EulerDiscreteScheduler', steps=5,
                                                hires_denoise=0.6, seed=3),
    'lanczos_w56_euler_a_seed5': dict(upscaler='lanczos', hires_width=56, scheduler='EulerAncestralDiscreteScheduler',
                                      steps=5, hires_steps=6, hires_denoise=0.5, seed=5),
}

if __name__ == '__main__':
    common = dict(prompt='a photo of an astronaut riding a horse on mars', negative_prompt='', guidance_scale=7.5,
                  width=32, height=24)
    out = {}
    for name, r in RUNS.items():
        out[name] = run_case(name, dict(common, **r))
        print(name, out[name]['target_width'], out[name]['target_height'], out[name]['hires_steps_run'])
    cfg = {'class': 'HiresFix', 'reference': 'diffusers 0.27.2 StableDiffusionPipeline(output_type="latent") -> '
           'upscale -> StableDiffusionImg2ImgPipeline (generate/gen_hires.py)',
           'generated_with': {'diffusers': diffusers.__version__, 'torch': torch.__version__, 'pillow': PIL.__version__},
           'models': {'unet': 'unet_sd15_tiny', 'vae': 'vae_tiny', 'text_encoder': 'clip_tiny'},
           'scheduler_base_config': BASE, 'vae_scale_factor': F, 'runs': out,
           'cache_runs': {'latent_x2_freq': dict(common, upscaler='latent', hires_scale=2.0, steps=8,
                                                 scheduler='EulerAncestralDiscreteScheduler', hires_denoise=0.6,
                                                 seed=3, cache='freq'),
                          'lanczos_x2_deepcache': dict(common, upscaler='lanczos', hires_scale=2.0, steps=8,
                                                       scheduler='EulerDiscreteScheduler', hires_denoise=0.6,
                                                       seed=3, cache='deepcache:2')}}
    json.dump(cfg, open(os.path.join(OUT, 'hires.json'), 'w'), indent=1)
