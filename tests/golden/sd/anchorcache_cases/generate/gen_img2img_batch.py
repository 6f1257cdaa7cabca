# Batched img2img / inpaint reference runs (diffusers 0.27.2 StableDiffusionImg2ImgPipeline /
import baddbmm_fix
# StableDiffusionInpaintPipeline.__call__ themselves, prompt=[p1, p2(, p3)] with image=[...] and mask_image=[...])
# in the layout of the golden img2img_tiny / inpaint_tiny cases. Every intermediate is recorded from inside the
# real __call__ (hooks on the UNet, the scheduler's step / add_noise, the posterior's sample, the pipeline's
# randn_tensor, prepare_latents and prepare_mask_latents), so the stored run is the reference pipeline's own.
# Text encoder = the HF CLIPTextModel equations on the stored weights (as gen_pipe.py), passed as prompt_embeds.
import json, os, sys, torch, numpy as np
sys.path.insert(0, os.environ['CLIP_TOKENIZER_DIR'])  # openai/CLIP's clip/ folder (simple_tokenizer.py)
from clip_ref import clip_reference
from PIL import Image
from safetensors.torch import save_file, load_file
import diffusers
from diffusers import (UNet2DConditionModel, AutoencoderKL, DDIMScheduler, EulerDiscreteScheduler,
                       StableDiffusionImg2ImgPipeline, StableDiffusionInpaintPipeline)
from diffusers.models.autoencoders import vae as vae_mod
from diffusers.pipelines.stable_diffusion import pipeline_stable_diffusion_img2img as i2i_mod
from diffusers.pipelines.stable_diffusion import pipeline_stable_diffusion_inpaint as inp_mod
assert diffusers.__version__ == '0.27.2', diffusers.__version__
torch.set_num_threads(1)
G = sys.argv[1]; OUT = sys.argv[2]  # G: the golden sd/ folder (models, vocab); OUT: anchorcache_cases/
ids, te = clip_reference(G)

unet4 = UNet2DConditionModel.from_pretrained(G + '/unet_sd15_tiny').eval()
unet9 = UNet2DConditionModel.from_pretrained(G + '/inpaint_tiny/unet_inpaint').eval()
assert unet9.config.in_channels == 9
vae = AutoencoderKL.from_pretrained(G + '/vae_tiny').eval()
base = json.load(open(G + '/img2img_tiny/config.json'))['scheduler_base_config']
CLS = {'DDIMScheduler': DDIMScheduler, 'EulerDiscreteScheduler': EulerDiscreteScheduler}

def init_image(seed, H, Wd):  # smooth gradient + noise, as the golden cases' init images
    g = torch.Generator('cpu').manual_seed(seed)
    y = torch.linspace(0, 1, H).view(H, 1, 1); x = torch.linspace(0, 1, Wd).view(1, Wd, 1)
    c = torch.rand((1, 1, 3), generator=g)
    img = 255 * (0.5 * c + 0.3 * y * (1 - c) + 0.2 * x * c) + 40 * torch.randn((H, Wd, 3), generator=g)
    return img.clamp(0, 255).round().to(torch.uint8)

def mask_image(k, H, Wd):  # white = repaint; a rectangle per image, a ramp across 0.5 on one row
    m = torch.zeros((H, Wd), dtype=torch.uint8)
    r0, c0 = 2 + 2 * k, 3 + 5 * k
    m[r0:r0 + 8, c0:c0 + 10] = 255
    m[H - 2, :] = torch.linspace(118, 137, Wd).round().to(torch.uint8)
    return m

class Recorder:
    def __init__(self): self.reset()
    def reset(self):
        self.posteriors = []; self.pipe_noise = []; self.unet = []; self.steps = []; self.adds = []
        self.prep_latents = None; self.prep_mask = None; self.step_index = -1; self.preprocess = []
R = Recorder()

_orig_sample = vae_mod.DiagonalGaussianDistribution.sample
def _sample(self, generator=None):  # the same arithmetic as diffusers' sample(), with its draw recorded
    noise = diffusers.utils.torch_utils.randn_tensor(self.mean.shape, generator=generator, device=self.parameters.device, dtype=self.parameters.dtype)
    x = self.mean + self.std * noise
    R.posteriors.append((self.mean.clone(), self.std.clone(), noise.clone(), x.clone()))
    return x
vae_mod.DiagonalGaussianDistribution.sample = _sample
for mod in (i2i_mod, inp_mod):
    _rt = mod.randn_tensor
    def _randn(*a, _rt=_rt, **k):
        r = _rt(*a, **k); R.pipe_noise.append(r.clone()); return r
    mod.randn_tensor = _randn

def hook_unet(u):
    def fwd(m, args, out):
        R.unet.append((args[0].clone(), (out.sample if hasattr(out, 'sample') else out[0]).clone()))
    return u.register_forward_hook(fwd)

def wrap_scheduler(s):
    step0, add0 = s.step, s.add_noise
    def step(model_output, timestep, sample, *a, **k):
        out = step0(model_output, timestep, sample, *a, **k)
        prev = out[0] if isinstance(out, tuple) else out.prev_sample
        R.steps.append((model_output.clone(), prev.clone())); R.step_index += 1
        return out
    def add_noise(x, noise, t):
        r = add0(x, noise, t); R.adds.append((R.step_index, r.clone(), t.clone())); return r
    s.step = step; s.add_noise = add_noise
    return s

def run(kind, name, prompts, images, masks, sched_cls, steps, strength, seed, guidance, H, Wd, folder, unet_name):
    R.reset()
    B = len(prompts)
    unet = unet9 if unet_name == 'unet9' else unet4
    pid = torch.tensor([ids(p) for p in prompts]); nid = torch.tensor([ids('') for _ in prompts])
    with torch.no_grad():
        pe = te(pid); ne = te(nid)
    sch = wrap_scheduler(CLS[sched_cls].from_config(base))
    cls = StableDiffusionInpaintPipeline if kind == 'inpaint' else StableDiffusionImg2ImgPipeline
    pipe = cls(vae=vae, text_encoder=None, tokenizer=None, unet=unet, scheduler=sch, safety_checker=None,
               feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    pp0 = pipe.image_processor.preprocess
    def pp(*a, **k):
        r = pp0(*a, **k); R.preprocess.append(r.clone()); return r
    pipe.image_processor.preprocess = pp
    if kind == 'inpaint':
        mp0 = pipe.mask_processor.preprocess
        def mp(*a, **k):
            r = mp0(*a, **k); R.mask_condition = r.clone(); return r
        pipe.mask_processor.preprocess = mp
        pml0 = pipe.prepare_mask_latents
        def pml(mask_, masked_image, *a, **k):
            R.masked_image = masked_image.clone()
            r = pml0(mask_, masked_image, *a, **k); R.prep_mask = tuple(t.clone() for t in r); return r
        pipe.prepare_mask_latents = pml
    pl0 = pipe.prepare_latents
    def pl(*a, **k):
        r = pl0(*a, **k); R.prep_latents = r; return r
    pipe.prepare_latents = pl
    lat_steps = []; ts = []
    def cb(p, i, t, kw):
        lat_steps.append(kw['latents'].clone()); ts.append(t.clone()); return kw
    h = hook_unet(unet)
    pil = [Image.fromarray(im.numpy(), 'RGB') for im in images]
    g = torch.Generator('cpu').manual_seed(seed)
    kw = dict(prompt_embeds=pe, negative_prompt_embeds=ne, image=pil, strength=strength, num_inference_steps=steps,
              guidance_scale=guidance, generator=g, output_type='pt', callback_on_step_end=cb)
    if kind == 'inpaint':
        kw.update(mask_image=[Image.fromarray(m.numpy(), 'L') for m in masks], height=H, width=Wd)
    if sched_cls == 'DDIMScheduler': kw['eta'] = 0.0
    dec_store = {}
    dec0 = vae.decode
    def dec(z, *a, **k):
        r = dec0(z, *a, **k); dec_store['z'] = z.clone()
        dec_store['d'] = (r[0] if isinstance(r, tuple) else r.sample).clone(); return r
    vae.decode = dec
    with torch.no_grad():
        img = pipe(**kw).images
    vae.decode = dec0; h.remove()
    n = len(ts)
    assert len(R.unet) == n and len(R.steps) == n and len(lat_steps) == n
    timesteps = torch.stack(ts)
    T = {'prompt_ids': pid, 'negative_prompt_ids': nid, 'prompt_embeds': torch.cat([ne, pe]),
         'init_image_uint8': torch.stack(images), 'init_image': R.preprocess[0], 'timesteps': timesteps,
         'latent_timestep': timesteps[:1].repeat(B)}
    post = list(R.posteriors)
    noise = R.pipe_noise[0]
    if kind == 'img2img':
        m_, s_, z_, x_ = post.pop(0)
        T.update(vae_encode_mean=m_, vae_encode_std=s_, vae_encode_noise=z_, vae_encode_sample=x_)
        T['init_latents'] = vae.config.scaling_factor * x_
        T['initial_latents'] = R.prep_latents
    else:
        T['mask_image_uint8'] = torch.stack(masks)
        T['mask_condition'] = R.mask_condition; T['masked_image'] = R.masked_image
        lat0 = R.prep_latents[0]
        if unet_name == 'unet4' or strength < 1:
            m_, s_, z_, x_ = post.pop(0)
            T.update(image_encode_mean=m_, image_encode_std=s_, image_encode_noise=z_)
            T['image_latents'] = (vae.config.scaling_factor * x_)
            if unet_name == 'unet4': T['image_latents'] = R.prep_latents[2]
        m_, s_, z_, x_ = post.pop(0)
        T.update(masked_image_encode_mean=m_, masked_image_encode_std=s_, masked_image_encode_noise=z_)
        mask_, mil = R.prep_mask
        T['mask'] = mask_[:B]; T['masked_image_latents'] = mil[:B]
        T['initial_latents'] = lat0
    assert not post
    T['noise'] = noise
    adds = [a for a in R.adds if a[0] >= 0]
    for i in range(n):
        mi, np_ = R.unet[i]; gd, so = R.steps[i]
        T[f'step.{i}.model_input'] = mi; T[f'step.{i}.noise_pred'] = np_; T[f'step.{i}.guided_noise_pred'] = gd
        T[f'step.{i}.latents'] = lat_steps[i]
        if kind == 'inpaint' and unet_name == 'unet4':
            T[f'step.{i}.scheduler_output'] = so
            prop = [a[1] for a in adds if a[0] == i]
            T[f'step.{i}.init_latents_proper'] = prop[0] if prop else T['image_latents']
    T['final_latents'] = lat_steps[-1]
    assert torch.equal(dec_store['z'], lat_steps[-1] / vae.config.scaling_factor)
    T['decoded'] = dec_store['d']
    T['image'] = img
    T['image_uint8'] = (img.permute(0, 2, 3, 1) * 255).round().to(torch.uint8)
    T = {k: v.clone().contiguous() for k, v in T.items()}
    save_file(T, f'{folder}/{name}.safetensors')
    pngs = []
    for k in range(B):
        f = f'{name}_{k}.png'; Image.fromarray(T['image_uint8'][k].numpy()).save(f'{folder}/{f}'); pngs.append(f)
    euler = sched_cls.startswith('Euler')
    all_ts = [float(t) if euler else int(t) for t in sch.timesteps]
    init_timestep = min(int(steps * strength), steps)
    r = {'scheduler': sched_cls, 'num_inference_steps': steps, 'strength': strength,
         't_start': steps - init_timestep, 'num_denoising_steps': n, 'init_timestep': init_timestep,
         'all_timesteps': all_ts, 'timesteps': [float(t) if euler else int(t) for t in timesteps],
         'png': pngs}
    if kind == 'inpaint':
        r['unet'] = '../../unet_sd15_tiny (4 channels)' if unet_name == 'unet4' else '../../inpaint_tiny/unet_inpaint (9 channels)'
        r['is_strength_max'] = strength == 1.0
        r['init_noise_sigma'] = float(sch.init_noise_sigma)
    return r

def case(kind, folder, prompts, seed, guidance, H, Wd, image_seeds, runs, n_masks=None):
    os.makedirs(folder, exist_ok=True)
    images = [init_image(s, H, Wd) for s in image_seeds]
    masks = [mask_image(k, H, Wd) for k in range(n_masks or len(images))] if kind == 'inpaint' else []
    names = []
    for k, im in enumerate(images):
        f = f'init_image_{k}.png'; Image.fromarray(im.numpy(), 'RGB').save(f'{folder}/{f}'); names.append(f)
    mnames = []
    for k, m in enumerate(masks):
        f = f'mask_image_{k}.png'; Image.fromarray(m.numpy(), 'L').save(f'{folder}/{f}'); mnames.append(f)
    cfg = {'set': 'anchorcache', 'prompts': prompts, 'negative_prompt': '', 'guidance_scale': guidance, 'seed': seed,
           'generator': f"torch.Generator('cpu').manual_seed({seed}), created once per run",
           'image_seeds': image_seeds, 'height': H, 'width': Wd, 'init_images': names,
           'models': {'unet': '../../unet_sd15_tiny', 'vae': '../../vae_tiny', 'text_encoder': '../../clip_tiny'},
           'scheduler_base_config': base, 'vae_scale_factor': 2, 'runs': {}}
    if kind == 'inpaint':
        cfg['mask_images'] = mnames
        cfg['models'] = {'unet4': '../../unet_sd15_tiny', 'unet9': '../../inpaint_tiny/unet_inpaint',
                         'vae': '../../vae_tiny', 'text_encoder': '../../clip_tiny'}
    for name, (cls, n, strength, un) in runs.items():
        cfg['runs'][name] = run(kind, name, prompts, images, masks, cls, n, strength, seed, guidance, H, Wd, folder, un)
    json.dump(cfg, open(folder + '/config.json', 'w'), indent=1)

case('img2img', OUT + '/img2img_batch', ['a red fox in the snow', 'an old lighthouse at dusk, oil painting'], 321, 6.5,
     16, 24, [9101, 9102],
     {'ddim8_strength0.7': ('DDIMScheduler', 8, 0.7, 'unet4'), 'euler7_strength0.9': ('EulerDiscreteScheduler', 7, 0.9, 'unet4')})
case('inpaint', OUT + '/inpaint_batch', ['a cat on a sofa', 'a bowl of fruit', 'a ship at sea'], 555, 7.0,
     16, 24, [9301, 9302, 9303],
     {'unet4_ddim6_strength1.0': ('DDIMScheduler', 6, 1.0, 'unet4'),
      'unet4_euler8_strength0.6': ('EulerDiscreteScheduler', 8, 0.6, 'unet4'),
      'unet9_ddim6_strength1.0': ('DDIMScheduler', 6, 1.0, 'unet9'),
      'unet9_euler8_strength0.75': ('EulerDiscreteScheduler', 8, 0.75, 'unet9')})
# One init image for both prompts (diffusers tiles it: cat([latents] * 2)); two init images with one mask.
case('img2img', OUT + '/img2img_broadcast', ['a red fox in the snow', 'a quiet harbour'], 808, 7.5, 24, 16, [9401],
     {'euler6_strength0.5': ('EulerDiscreteScheduler', 6, 0.5, 'unet4')})
case('inpaint', OUT + '/inpaint_one_mask', ['a cat on a sofa', 'a bowl of fruit'], 909, 7.5, 16, 24, [9501, 9502],
     {'unet9_ddim5_strength0.8': ('DDIMScheduler', 5, 0.8, 'unet9')}, n_masks=1)
