# Reference txt2img runs (diffusers 0.27.2 StableDiffusionPipeline.__call__ loop, batched prompts) in the layout of
import baddbmm_fix
# golden pipeline_tiny / deepcache. Text encoder = HF CLIPTextModel equations on the stored weights.
import json, os, sys, math, torch
sys.path.insert(0, os.environ['CLIP_TOKENIZER_DIR'])  # openai/CLIP's clip/ folder (simple_tokenizer.py)
from clip_ref import clip_reference
from diffusers import UNet2DConditionModel, AutoencoderKL, DDIMScheduler, EulerDiscreteScheduler, EulerAncestralDiscreteScheduler, DPMSolverMultistepScheduler
from safetensors.torch import save_file, load_file
torch.set_num_threads(1)
G = sys.argv[1]; OUT = sys.argv[2]
ids, te = clip_reference(G)

unet = UNet2DConditionModel.from_pretrained(G + '/unet_sd15_tiny').eval()
vae = AutoencoderKL.from_pretrained(G + '/vae_tiny').eval()
base = json.load(open(G + '/pipeline_tiny/config.json'))['scheduler_base_config']
CLS = {'DDIMScheduler': DDIMScheduler, 'EulerDiscreteScheduler': EulerDiscreteScheduler,
       'EulerAncestralDiscreteScheduler': EulerAncestralDiscreteScheduler, 'DPMSolverMultistepScheduler': DPMSolverMultistepScheduler}

def deep_forward(x, t, ctx, cached):
    # DeepCache branch 0 cached step: conv_out(silu(norm(A2(R2(cat([C, conv_in(x)]), temb), ctx))))
    tt = t if torch.is_tensor(t) else torch.tensor(t)
    tt = tt.reshape(1).expand(x.shape[0])
    temb = unet.time_embedding(unet.time_proj(tt).to(x.dtype))
    h = unet.conv_in(x)
    ub = unet.up_blocks[-1]
    h = ub.resnets[2](torch.cat([cached, h], 1), temb)
    h = ub.attentions[2](h, encoder_hidden_states=ctx).sample
    return unet.conv_out(unet.conv_act(unet.conv_norm_out(h)))

def run(name, prompts, negative, seed, guidance, sched_cls, steps, H, Wd, folder, interval=0):
    os.makedirs(folder, exist_ok=True)
    B = len(prompts)
    negs = [negative] * B if isinstance(negative, str) else negative
    pid = torch.tensor([ids(p) for p in prompts]); nid = torch.tensor([ids(n) for n in negs])
    with torch.no_grad():
        pe = te(pid); ne = te(nid)
        emb = torch.cat([ne, pe])
        sch = CLS[sched_cls].from_config(base)
        sch.set_timesteps(steps)
        g = torch.Generator('cpu').manual_seed(seed)
        noise = torch.randn((B, 4, H // 2, Wd // 2), generator=g)
        lat = noise * sch.init_noise_sigma
        T = {'initial_noise': noise, 'initial_latents': lat, 'prompt_ids': pid, 'negative_prompt_ids': nid, 'prompt_embeds': emb}
        import inspect
        kw = {}
        if 'generator' in inspect.signature(sch.step).parameters: kw['generator'] = g
        if 'eta' in inspect.signature(sch.step).parameters: kw['eta'] = 0.0
        cached = None; modes = []
        feats = {}
        for i, t in enumerate(sch.timesteps):
            mi = sch.scale_model_input(torch.cat([lat] * 2), t)
            full = interval == 0 or i % interval == 0
            if full:
                if interval:
                    store = {}
                    hk = unet.up_blocks[-1].attentions[1].register_forward_hook(lambda m, a, o: store.__setitem__('c', o.sample if hasattr(o, 'sample') else o[0]))
                np_ = unet(mi, t, encoder_hidden_states=emb).sample
                if interval:
                    hk.remove(); cached = store['c']; T[f'cache.up_blocks.3.attentions.1.step.{i}'] = cached
            else:
                np_ = deep_forward(mi, t, emb, cached)
            modes.append('full' if full else 'cached')
            u, c = np_.chunk(2)
            gd = u + guidance * (c - u)
            lat = sch.step(gd, t, lat, **kw).prev_sample
            T[f'step.{i}.model_input'] = mi; T[f'step.{i}.noise_pred'] = np_; T[f'step.{i}.guided_noise_pred'] = gd; T[f'step.{i}.latents'] = lat
        dec = vae.decode(lat / vae.config.scaling_factor).sample
        img = (dec / 2 + 0.5).clamp(0, 1)
        T.update(final_latents=lat, decoded=dec, image=img, image_uint8=(img.permute(0, 2, 3, 1) * 255).round().to(torch.uint8))
    save_file(T, f'{folder}/{name}.safetensors')
    r = {'scheduler': sched_cls, 'num_inference_steps': steps, 'timesteps': [float(t) if sched_cls.startswith(('Euler', 'LMS')) else int(t) for t in sch.timesteps],
         'init_noise_sigma': float(sch.init_noise_sigma), 'png': [f'{name}_{k}.png' for k in range(B)]}
    if interval: r.update(cache_interval=interval, cache_branch_id=0, skip_mode='uniform', step_modes=modes)
    return r

def case(folder, prompts, negative, seed, guidance, H, Wd, runs, interval=0):
    cfg = {'prompts': prompts, 'negative_prompt': negative, 'guidance_scale': guidance, 'seed': seed,
           'generator': f"torch.Generator('cpu').manual_seed({seed}), created once per run",
           'height': H, 'width': Wd, 'latent_shape': [len(prompts), 4, H // 2, Wd // 2], 'vae_scale_factor': 2,
           'models': {'unet': 'unet_sd15_tiny', 'vae': 'vae_tiny', 'text_encoder': 'clip_tiny'},
           'scheduler_base_config': base, 'runs': {}}
    for name, (cls, n) in runs.items():
        cfg['runs'][name] = run(name, prompts, negative, seed, guidance, cls, n, H, Wd, folder, interval)
    json.dump(cfg, open(folder + '/config.json', 'w'), indent=1)

case(OUT + '/pipeline_batch', ['a red fox in the snow', 'an old lighthouse at dusk, oil painting'], '', 1234, 6.0, 16, 24,
     {'ddim8': ('DDIMScheduler', 8), 'euler_a6': ('EulerAncestralDiscreteScheduler', 6)})
case(OUT + '/pipeline_batch3', ['a cat', 'a dog on a skateboard', 'mountains'], 'blurry, low quality', 77, 7.5, 16, 16,
     {'dpm7': ('DPMSolverMultistepScheduler', 7), 'euler9': ('EulerDiscreteScheduler', 9)})
case(OUT + '/deepcache_batch', ['a red fox in the snow', 'an old lighthouse at dusk, oil painting'], '', 1234, 6.0, 16, 24,
     {'ddim8_interval3': ('DDIMScheduler', 8)}, interval=3)
