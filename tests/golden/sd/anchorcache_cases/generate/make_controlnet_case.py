# A variant of ../shared/golden/sd/controlnet_tiny made with diffusers 0.27.2 (another sampler, batch, scale, guess mode,
# start/end, control image size), for golden_runner DIR --filter controlnet. Usage (a diffusers 0.27.2 venv):
#   python make_controlnet_case.py NAME ddim|euler|euler_a|dpm PROMPT_ROWS IMAGES_PER_PROMPT SCALE GUESS(0/1) START END SEED IMAGE_SIZE CFG
# writes /tmp/cn61/NAME/controlnet_tiny (the path below).
import json, os, shutil, sys, torch, numpy as np
from PIL import Image
from safetensors.torch import save_file
from diffusers import (StableDiffusionControlNetPipeline, ControlNetModel, UNet2DConditionModel, AutoencoderKL,
                       DDIMScheduler, EulerAncestralDiscreteScheduler, DPMSolverMultistepScheduler, EulerDiscreteScheduler)
torch.set_num_threads(1)
# baddbmm with beta=0 on an uninitialised buffer (see the golden README): use a zero-filled out
_orig = torch.baddbmm
def _bb(input, b1, b2, *, beta=1, alpha=1, out=None):
    if beta == 0:
        return alpha * torch.bmm(b1, b2)
    return _orig(input, b1, b2, beta=beta, alpha=alpha)
torch.baddbmm = _bb
src = '/work/shared/golden/sd/controlnet_tiny'
name, sched_cls, batch_p, nipp, scale, guess, start, end, seed, img_size, cfg_scale = sys.argv[1:12]
batch_p, nipp, seed, img_size = int(batch_p), int(nipp), int(seed), int(img_size)
scale, start, end, cfg_scale = float(scale), float(start), float(end), float(cfg_scale)
guess = guess == '1'
out = f'/tmp/cn61/{name}/controlnet_tiny'
shutil.rmtree(out, ignore_errors=True)
os.makedirs(out)
for d in ['controlnet', 'unet', 'vae']:
    shutil.copytree(f'{src}/{d}', f'{out}/{d}')
unet = UNet2DConditionModel.from_pretrained(f'{src}/unet')
vae = AutoencoderKL.from_pretrained(f'{src}/vae')
cn = ControlNetModel.from_pretrained(f'{src}/controlnet')
base = json.load(open(f'{src}/scheduler/scheduler_config.json'))
cls = {'ddim': DDIMScheduler, 'euler_a': EulerAncestralDiscreteScheduler, 'dpm': DPMSolverMultistepScheduler, 'euler': EulerDiscreteScheduler}[sched_cls]
sched = cls.from_config(base)
os.makedirs(f'{out}/scheduler')
sched.save_config(f'{out}/scheduler')
sc = json.load(open(f'{out}/scheduler/scheduler_config.json'))
sc = {k: v for k, v in sc.items() if not (isinstance(v, float) and v == float('-inf'))}
json.dump(sc, open(f'{out}/scheduler/scheduler_config.json', 'w'), indent=1)
pipe = StableDiffusionControlNetPipeline(vae=vae, text_encoder=None, tokenizer=None, unet=unet, controlnet=cn,
                                         scheduler=sched, safety_checker=None, feature_extractor=None,
                                         requires_safety_checker=False)
g = torch.Generator('cpu').manual_seed(seed + 100)
img = (torch.rand((img_size, img_size, 3), generator=g) * 255).round().to(torch.uint8).numpy()
Image.fromarray(img).save(f'{out}/control_image.png')
pe = torch.randn((batch_p, 77, 32), generator=torch.Generator('cpu').manual_seed(seed + 1))
ne = torch.randn((batch_p, 77, 32), generator=torch.Generator('cpu').manual_seed(seed + 2))
lat = {}
def cb(p, i, t, kw):
    lat[f'latents.{i}'] = kw['latents'].clone(); return kw
res = pipe(prompt_embeds=pe, negative_prompt_embeds=ne, image=Image.open(f'{out}/control_image.png'),
           num_inference_steps=6, guidance_scale=cfg_scale, controlnet_conditioning_scale=scale, guess_mode=guess,
           control_guidance_start=start, control_guidance_end=end, height=16, width=16, num_images_per_prompt=nipp,
           generator=torch.Generator('cpu').manual_seed(seed), output_type='pt', callback_on_step_end=cb)
t = dict(lat); t['images'] = res.images; t['prompt_embeds'] = pe; t['negative_prompt_embeds'] = ne
t['control_image_u8'] = torch.from_numpy(img)
save_file({k: v.contiguous() for k, v in t.items()}, f'{out}/golden_pipeline.safetensors')
cfg = json.load(open(f'{src}/config.json')); del cfg['component']
cfg['pipeline'].update({'scheduler': type(sched).__name__, 'controlnet_conditioning_scale': scale, 'guidance_scale': cfg_scale,
    'batch': batch_p * nipp, 'num_images_per_prompt': nipp, 'generator_seed': seed, 'guess_mode': guess,
    'control_guidance_start': start, 'control_guidance_end': end,
    'control_image': f'control_image.png ({img_size}x{img_size} RGB), passed as a PIL image'})
json.dump(cfg, open(f'{out}/config.json', 'w'), indent=1)
print(name, 'ok', res.images.shape, bool(torch.isfinite(res.images).all()))
