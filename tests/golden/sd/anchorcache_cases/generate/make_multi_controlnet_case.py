# Two ControlNets at once (diffusers' MultiControlNetModel) on controlnet_tiny, Euler, scales 0.8 / 0.4, start/end
# 0-1 / 0.3-0.9, the second control image 20x20 (resized): golden_runner /tmp/cn61/e --filter controlnet.
import json, os, shutil, torch, numpy as np
from PIL import Image
from safetensors.torch import save_file
from diffusers import StableDiffusionControlNetPipeline, ControlNetModel, UNet2DConditionModel, AutoencoderKL, EulerDiscreteScheduler
torch.set_num_threads(1)
_orig = torch.baddbmm
def _bb(input, b1, b2, *, beta=1, alpha=1, out=None):
    return alpha * torch.bmm(b1, b2) if beta == 0 else _orig(input, b1, b2, beta=beta, alpha=alpha)
torch.baddbmm = _bb
src = '/work/shared/golden/sd/controlnet_tiny'; out = '/tmp/cn61/e/controlnet_tiny'
shutil.rmtree(out, ignore_errors=True); os.makedirs(out)
for d in ['controlnet', 'unet', 'vae']: shutil.copytree(f'{src}/{d}', f'{out}/{d}')
cn1 = ControlNetModel.from_pretrained(f'{src}/controlnet')
cn2 = ControlNetModel.from_pretrained(f'{src}/controlnet')
torch.manual_seed(1)
with torch.no_grad():
    for p in cn2.parameters(): p.add_(torch.randn_like(p) * 0.02)
cn2.save_pretrained(f'{out}/controlnet_2')
unet = UNet2DConditionModel.from_pretrained(f'{src}/unet'); vae = AutoencoderKL.from_pretrained(f'{src}/vae')
sched = EulerDiscreteScheduler.from_config(json.load(open(f'{src}/scheduler/scheduler_config.json')))
os.makedirs(f'{out}/scheduler'); sched.save_config(f'{out}/scheduler')
pipe = StableDiffusionControlNetPipeline(vae=vae, text_encoder=None, tokenizer=None, unet=unet, controlnet=[cn1, cn2],
    scheduler=sched, safety_checker=None, feature_extractor=None, requires_safety_checker=False)
imgs = []
for k, (seed, size) in enumerate([(21, 16), (22, 20)]):
    a = (torch.rand((size, size, 3), generator=torch.Generator('cpu').manual_seed(seed)) * 255).round().to(torch.uint8).numpy()
    name = 'control_image.png' if k == 0 else 'control_image_2.png'
    Image.fromarray(a).save(f'{out}/{name}'); imgs.append(name)
pe = torch.randn((1, 77, 32), generator=torch.Generator('cpu').manual_seed(31))
ne = torch.randn((1, 77, 32), generator=torch.Generator('cpu').manual_seed(32))
lat = {}
def cb(p, i, t, kw): lat[f'latents.{i}'] = kw['latents'].clone(); return kw
res = pipe(prompt_embeds=pe, negative_prompt_embeds=ne, image=[Image.open(f'{out}/{n}') for n in imgs],
    num_inference_steps=6, guidance_scale=6.0, controlnet_conditioning_scale=[0.8, 0.4], control_guidance_start=[0.0, 0.3],
    control_guidance_end=[1.0, 0.9], height=16, width=16, generator=torch.Generator('cpu').manual_seed(9), output_type='pt',
    callback_on_step_end=cb)
t = dict(lat); t['images'] = res.images; t['prompt_embeds'] = pe; t['negative_prompt_embeds'] = ne
save_file({k: v.contiguous() for k, v in t.items()}, f'{out}/golden_pipeline.safetensors')
cfg = json.load(open(f'{src}/config.json')); del cfg['component']
cfg['controlnet_config'] = ['controlnet/config.json', 'controlnet_2/config.json']
cfg['pipeline'].update({'scheduler': 'EulerDiscreteScheduler', 'controlnet_conditioning_scale': [0.8, 0.4],
    'control_guidance_start': [0.0, 0.3], 'control_guidance_end': [1.0, 0.9], 'generator_seed': 9,
    'control_image': imgs})
json.dump(cfg, open(f'{out}/config.json', 'w'), indent=1)
print('ok', bool(torch.isfinite(res.images).all()))
