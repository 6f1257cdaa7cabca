# Few-step reference runs (issue 59): SD-Turbo-, SDXL-Turbo- and SDXS-shaped pipelines, LCM-LoRA and TAESD in the
import baddbmm_fix
# pipeline, each from the real, unmodified diffusers 0.27.2 pipeline's __call__ (StableDiffusionPipeline /
# StableDiffusionXLPipeline with prompt_embeds, output_type="pt"), every intermediate recorded from inside the call
# (a wrapper on the UNet's forward, the scheduler's step, the pipeline module's randn_tensor, the VAE's decode).
# Text encoders: the HF CLIPTextModel equations on the stored SD 1.x weights (clip_ref.py) and transformers'
# CLIPTextModel(WithProjection) on sdxl_tiny's, passed as prompt_embeds (the tokenizers are not stored as HF files).
#
#   gen_fewstep.py GOLDEN_SD OUT     (GOLDEN_SD: tests/golden/sd; OUT: tests/golden/sd/anchorcache_cases)
import functools, json, os, sys, torch
sys.path.insert(0, os.environ['CLIP_TOKENIZER_DIR'])  # openai/CLIP's clip/ folder (simple_tokenizer.py)
from clip_ref import clip_reference
from gen_unet import init_random, run_case
from safetensors.torch import save_file
import diffusers
from diffusers import (UNet2DConditionModel, AutoencoderKL, AutoencoderTiny, EulerDiscreteScheduler,
                       EulerAncestralDiscreteScheduler, LCMScheduler, StableDiffusionPipeline, StableDiffusionXLPipeline)
from diffusers.pipelines.stable_diffusion import pipeline_stable_diffusion as sd_mod
from diffusers.pipelines.stable_diffusion_xl import pipeline_stable_diffusion_xl as sdxl_mod
assert diffusers.__version__ == '0.27.2', diffusers.__version__
torch.set_num_threads(1)
G = sys.argv[1]; OUT = sys.argv[2]
ids, te = clip_reference(G)
CLS = {'EulerDiscreteScheduler': EulerDiscreteScheduler, 'EulerAncestralDiscreteScheduler': EulerAncestralDiscreteScheduler,
       'LCMScheduler': LCMScheduler}
SD15_BASE = json.load(open(G + '/pipeline_tiny/config.json'))['scheduler_base_config']  # SD 1.5's PNDM config


class Rec:
    def __init__(self): self.reset()
    def reset(self): self.noise = []; self.unet = []; self.steps = []; self.decoded = []
R = Rec()
for mod in (sd_mod, sdxl_mod):
    _rt = mod.randn_tensor
    def _randn(*a, _rt=_rt, **k):
        r = _rt(*a, **k); R.noise.append(r.clone()); return r
    mod.randn_tensor = _randn
    for fn in ('scale_lora_layers', 'unscale_lora_layers'):  # no text encoder module: prompt_embeds are given
        if hasattr(mod, fn):
            setattr(mod, fn, lambda m, w=None, _f=getattr(mod, fn): None if m is None else _f(m, w))


def wrap_unet(u):
    f0 = u.forward
    def fwd(sample, timestep, encoder_hidden_states, *a, **k):
        out = f0(sample, timestep, encoder_hidden_states, *a, **k)
        o = out[0] if isinstance(out, tuple) else out.sample
        R.unet.append(dict(x=sample.clone(), t=timestep, ctx=encoder_hidden_states.clone(), out=o.clone(),
                           added={kk: v.clone() for kk, v in (k.get('added_cond_kwargs') or {}).items()}))
        return out
    u.forward = fwd
    return u


def wrap_vae(v):
    d0 = v.decode
    def dec(z, *a, **k):
        out = d0(z, *a, **k)
        R.decoded.append((out[0] if isinstance(out, tuple) else out.sample).clone())
        return out
    v.decode = dec
    return v


def scheduler(cls, base, **over):
    s = CLS[cls].from_config({**base, **over})
    step0 = s.step
    @functools.wraps(step0)  # the pipeline passes generator / eta when step's signature has them
    def step(model_output, timestep, sample, *a, **k):
        out = step0(model_output, timestep, sample, *a, **k)
        R.steps.append((model_output.clone(), (out[0] if isinstance(out, tuple) else out.prev_sample).clone()))
        return out
    s.step = step
    return s


def plain_config(s):  # the scheduler's own config, as diffusers would save it
    return {k: v for k, v in dict(s.config).items() if not k.startswith('_')} | {'_class_name': type(s).__name__}


def record_steps(T, cfg_on):
    assert len(R.unet) == len(R.steps), (len(R.unet), len(R.steps))
    for i, (u, (guided, prev)) in enumerate(zip(R.unet, R.steps)):
        T[f'step.{i}.model_input'] = u['x']; T[f'step.{i}.noise_pred'] = u['out']
        T[f'step.{i}.guided_noise_pred'] = guided; T[f'step.{i}.latents'] = prev
    T['final_latents'] = R.steps[-1][1]
    T['decoded'] = R.decoded[-1]


def finish_image(T, img):
    T['image'] = img
    T['image_uint8'] = (img.permute(0, 2, 3, 1) * 255).round().to(torch.uint8)


def timesteps_of(s):
    return [float(t) if type(s).__name__.startswith('Euler') else int(t) for t in s.timesteps]


# ---------------------------------------------------------------- SD 1.x-shaped pipelines (sd-txt2img layout)
def sd_run(pipe, folder, name, prompts, negative, seed, guidance, steps, H, Wd, cls, sched_over, base=SD15_BASE):
    os.makedirs(folder, exist_ok=True)
    R.reset()
    pipe.scheduler = scheduler(cls, base, **sched_over)
    B = len(prompts); cfg_on = guidance > 1
    pid = torch.tensor([ids(p) for p in prompts])
    T = {'prompt_ids': pid}
    with torch.no_grad():
        pe = te(pid); kw = {}
        if cfg_on:
            nid = torch.tensor([ids(negative)] * B); ne = te(nid)
            kw['negative_prompt_embeds'] = ne; T['negative_prompt_ids'] = nid; T['prompt_embeds'] = torch.cat([ne, pe])
        else:
            T['prompt_embeds'] = pe  # no CFG batch: diffusers encodes no negative prompt
        g = torch.Generator('cpu').manual_seed(seed)
        img = pipe(prompt_embeds=pe, guidance_scale=guidance, num_inference_steps=steps, height=H, width=Wd,
                   generator=g, output_type='pt', **kw).images
    s = pipe.scheduler
    T['initial_noise'] = R.noise[0]; T['initial_latents'] = R.noise[0] * s.init_noise_sigma
    record_steps(T, cfg_on)
    finish_image(T, img)
    save_file({k: v.clone().contiguous() for k, v in T.items()}, f'{folder}/{name}.safetensors')
    return {'scheduler': cls, 'scheduler_base_config': plain_config(s), 'num_inference_steps': steps,
            'guidance_scale': guidance, 'timesteps': timesteps_of(s), 'init_noise_sigma': float(s.init_noise_sigma)}


def sd_case(folder, models, pipe, prompts, negative, seed, H, Wd, runs, config_name='config.json', extra=None):
    cfg = {'prompts': prompts, 'negative_prompt': negative, 'seed': seed,
           'generator': f"torch.Generator('cpu').manual_seed({seed}), created once per run",
           'height': H, 'width': Wd, 'latent_shape': [len(prompts), 4, H // pipe.vae_scale_factor, Wd // pipe.vae_scale_factor],
           'vae_scale_factor': pipe.vae_scale_factor, 'models': models, 'runs': {}}
    cfg.update(extra or {})
    for name, (guidance, cls, steps, over) in runs.items():
        cfg['runs'][name] = sd_run(pipe, folder, name, prompts, negative, seed, guidance, steps, H, Wd, cls, over)
    json.dump(cfg, open(f'{folder}/{config_name}', 'w'), indent=1)


def sd_pipe(unet, vae):
    return StableDiffusionPipeline(vae=wrap_vae(vae), text_encoder=None, tokenizer=None, unet=wrap_unet(unet),
                                   scheduler=EulerDiscreteScheduler.from_config(SD15_BASE), safety_checker=None,
                                   feature_extractor=None, requires_safety_checker=False)


unet15 = UNet2DConditionModel.from_pretrained(G + '/unet_sd15_tiny').eval()
vae15 = AutoencoderKL.from_pretrained(G + '/vae_tiny').eval()
MODELS15 = {'unet': '../unet_sd15_tiny', 'vae': '../vae_tiny', 'text_encoder': '../clip_tiny'}
TRAIL = {'timestep_spacing': 'trailing'}
prompts = ['a cinematic photo of a red fox in the snow', 'a lighthouse at dusk']

# (a) SD-Turbo-shaped: trailing spacing, 1 and 2 steps, guidance off (0 as the model card, 1 = also no CFG batch).
pipe = sd_pipe(unet15, vae15)
sd_case(OUT + '/turbo_sd', MODELS15, pipe, prompts, '', 2024, 32, 32, {
    'euler_a_trailing1': (0.0, 'EulerAncestralDiscreteScheduler', 1, TRAIL),
    'euler_a_trailing2': (0.0, 'EulerAncestralDiscreteScheduler', 2, TRAIL),
    'euler_trailing1': (0.0, 'EulerDiscreteScheduler', 1, TRAIL),
    'euler_trailing2_cfg1': (1.0, 'EulerDiscreteScheduler', 2, TRAIL),
    'euler_a_trailing4_vpred': (0.0, 'EulerAncestralDiscreteScheduler', 4, {**TRAIL, 'prediction_type': 'v_prediction'}),
})

# (c) SDXS-style slim UNet: three levels, the first without attention, one resnet per level, transformer depth per
# level [1, 1, 2], no mid block, linear projections; a UNet forward case (features) and 1-step pipelines.
slim = UNet2DConditionModel(
    sample_size=16, in_channels=4, out_channels=4,
    down_block_types=['DownBlock2D', 'CrossAttnDownBlock2D', 'CrossAttnDownBlock2D'],
    up_block_types=['CrossAttnUpBlock2D', 'CrossAttnUpBlock2D', 'UpBlock2D'],
    block_out_channels=[32, 32, 64], layers_per_block=1, transformer_layers_per_block=[1, 1, 2],
    attention_head_dim=[2, 2, 4], cross_attention_dim=32, norm_num_groups=32, use_linear_projection=True,
    mid_block_type=None).eval()
init_random(slim, 5001)
slim.to(torch.float16).save_pretrained(OUT + '/sdxs_unet')  # float16-exact weights, stored as float16
slim = UNet2DConditionModel.from_pretrained(OUT + '/sdxs_unet', torch_dtype=torch.float32).eval()
run_case(OUT + '/sdxs_unet', slim, 2, 16, 24, 77, (5002, 5003), [999, 250], 999)
pipe = sd_pipe(slim, AutoencoderKL.from_pretrained(G + '/vae_tiny').eval())
sd_case(OUT + '/sdxs_pipeline', {'unet': 'sdxs_unet', 'vae': '../vae_tiny', 'text_encoder': '../clip_tiny'}, pipe,
        prompts[:1], '', 77, 32, 48, {
            'euler_trailing1': (0.0, 'EulerDiscreteScheduler', 1, TRAIL),
            'euler_a_trailing1': (0.0, 'EulerAncestralDiscreteScheduler', 1, TRAIL),
        })

# TAESD in the pipeline: StableDiffusionPipeline(vae=AutoencoderTiny). A tiny TAESD whose decoder upscales by 2, as
# vae_tiny (2 levels), random weights; the UNet and text encoder of the SD 1.x tiny pipeline.
tiny = AutoencoderTiny(in_channels=3, out_channels=3, encoder_block_out_channels=(16, 16),
                       decoder_block_out_channels=(16, 16), num_encoder_blocks=(1, 2), num_decoder_blocks=(2, 1),
                       latent_channels=4, act_fn='relu', upsampling_scaling_factor=2,
                       latent_magnitude=3, latent_shift=0.5, scaling_factor=1.0).eval()
init_random(tiny, 6001)
for m in tiny.modules():  # a usable range of outputs: a wider init than the UNet's N(0, 0.05)
    if isinstance(m, torch.nn.Conv2d):
        with torch.no_grad(): m.weight.mul_(4).copy_(m.weight.half().float())
tiny.save_pretrained(OUT + '/taesd_pipeline/taesd')
tiny = AutoencoderTiny.from_pretrained(OUT + '/taesd_pipeline/taesd').eval()
pipe = sd_pipe(UNet2DConditionModel.from_pretrained(G + '/unet_sd15_tiny').eval(), tiny)
assert pipe.vae_scale_factor == 2
sd_case(OUT + '/taesd_pipeline', {'unet': '../unet_sd15_tiny', 'vae': '../vae_tiny', 'text_encoder': '../clip_tiny'},
        pipe, prompts, 'blurry', 99, 32, 32, {
            'euler_a_trailing1': (0.0, 'EulerAncestralDiscreteScheduler', 1, TRAIL),
            'euler6_cfg': (5.0, 'EulerDiscreteScheduler', 6, {}),
        }, config_name='fewstep.json', extra={'vae_decoder': 'taesd', 'pipeline_class': 'StableDiffusionPipeline'})

# LCM-LoRA: a kohya-format file with diffusers' module paths (lora_unet_down_blocks_0_..., .lora_down / .lora_up /
# .alpha), the naming of the published latent-consistency/lcm-lora-sdv1-5, on the LCM-LoRA training script's target
# modules (attention projections, proj_in/out, feed-forward, resnet convs and time_emb_proj, down/up-sampler convs);
# loaded by diffusers' own load_lora_weights, LCMScheduler from the SD 1.5 config, guidance 1, 4 steps.
TARGETS = ('to_q', 'to_k', 'to_v', 'to_out.0', 'proj_in', 'proj_out', 'ff.net.0.proj', 'ff.net.2', 'conv1', 'conv2',
           'conv_shortcut', 'downsamplers.0.conv', 'upsamplers.0.conv', 'time_emb_proj')
unet_l = UNet2DConditionModel.from_pretrained(G + '/unet_sd15_tiny').eval()
gl = torch.Generator().manual_seed(7001); sd = {}; rank, alpha = 4, 2.0
for name, m in unet_l.named_modules():
    if not name.endswith(TARGETS) or not isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)): continue
    key = 'lora_unet_' + name.replace('.', '_')
    if isinstance(m, torch.nn.Linear):
        down = torch.randn((rank, m.in_features), generator=gl) * 0.2; up = torch.randn((m.out_features, rank), generator=gl) * 0.2
    else:
        kh, kw = m.kernel_size
        down = torch.randn((rank, m.in_channels, kh, kw), generator=gl) * 0.2; up = torch.randn((m.out_channels, rank, 1, 1), generator=gl) * 0.2
    sd[key + '.lora_down.weight'] = down.half().float(); sd[key + '.lora_up.weight'] = up.half().float()
    sd[key + '.alpha'] = torch.tensor(alpha)
os.makedirs(OUT + '/lcm_lora', exist_ok=True)
save_file({k: v.half() for k, v in sd.items()}, OUT + '/lcm_lora/pytorch_lora_weights.safetensors')
pipe = sd_pipe(unet_l, AutoencoderKL.from_pretrained(G + '/vae_tiny').eval())
pipe.load_lora_weights(OUT + '/lcm_lora', weight_name='pytorch_lora_weights.safetensors')
pipe.fuse_lora(fuse_unet=True, fuse_text_encoder=False)
sd_case(OUT + '/lcm_lora', {'unet': '../unet_sd15_tiny', 'vae': '../vae_tiny', 'text_encoder': '../clip_tiny'}, pipe,
        prompts, '', 4242, 32, 32, {
            'lcm4': (1.0, 'LCMScheduler', 4, {}),
            'lcm2': (1.0, 'LCMScheduler', 2, {}),
        }, config_name='fewstep.json',
        extra={'lora': 'pytorch_lora_weights.safetensors', 'lora_scale': 1.0, 'pipeline_class': 'StableDiffusionPipeline'})

# (b) SDXL-Turbo-shaped: sdxl_tiny's models, trailing Euler ancestral (sdxl-turbo's scheduler), 1 and 2 steps,
# guidance 0, 512-style micro-conditioning given explicitly.
from transformers import CLIPTextModel, CLIPTextModelWithProjection
from simple_tokenizer import SimpleTokenizer
X = G + '/sdxl_tiny'
bpe = SimpleTokenizer(G + '/vocab/bpe_simple_vocab_16e6.txt.gz')
def xl_ids(text, pad):
    r = [49406] + bpe.encode(text)[:75] + [49407]
    return r + [pad] * (77 - len(r))
te1 = CLIPTextModel.from_pretrained(X + '/text_encoder', torch_dtype=torch.float32).eval()
te2 = CLIPTextModelWithProjection.from_pretrained(X + '/text_encoder_2', torch_dtype=torch.float32).eval()
xbase = json.load(open(X + '/scheduler/scheduler_config.json'))
pipe = StableDiffusionXLPipeline(vae=wrap_vae(AutoencoderKL.from_pretrained(X + '/vae').eval()), text_encoder=None,
                                 text_encoder_2=None, tokenizer=None, tokenizer_2=None,
                                 unet=wrap_unet(UNet2DConditionModel.from_pretrained(X + '/unet').eval()),
                                 scheduler=EulerDiscreteScheduler.from_config(xbase), force_zeros_for_empty_prompt=True,
                                 add_watermarker=False)
xl_prompts = ['a cinematic photo of a red fox in the snow']
MICRO = dict(original_size=(512, 512), crops_coords_top_left=(0, 0), target_size=(512, 512))
xl_runs = {'euler_a_trailing1': ('EulerAncestralDiscreteScheduler', 1), 'euler_a_trailing2': ('EulerAncestralDiscreteScheduler', 2),
           'euler_trailing1': ('EulerDiscreteScheduler', 1)}
folder = OUT + '/sdxl_turbo'; os.makedirs(folder + '/scheduler', exist_ok=True)
H, Wd, seed = 32, 32, 31
fj = {'pipeline_class': 'StableDiffusionXLPipeline', 'models': '../../sdxl_tiny',
      'pipeline': {'prompts': xl_prompts, 'height': H, 'width': Wd, 'guidance_scale': 0.0, 'seed': seed,
                   'generator': f"torch.Generator('cpu').manual_seed({seed}) created once per run",
                   'original_size': list(MICRO['original_size']), 'crops_coords_top_left': list(MICRO['crops_coords_top_left']),
                   'target_size': list(MICRO['target_size']), 'num_images_per_prompt': 1, 'runs': {}}}
for name, (cls, steps) in xl_runs.items():
    R.reset()
    pipe.scheduler = scheduler(cls, xbase, **TRAIL)
    i1 = torch.tensor([xl_ids(p, 49407) for p in xl_prompts]); i2 = torch.tensor([xl_ids(p, 0) for p in xl_prompts])
    with torch.no_grad():
        o1 = te1(i1, output_hidden_states=True); o2 = te2(i2, output_hidden_states=True)
        pe = torch.cat([o1.hidden_states[-2], o2.hidden_states[-2]], -1); pooled = o2.text_embeds
        g = torch.Generator('cpu').manual_seed(seed)
        img = pipe(prompt_embeds=pe, pooled_prompt_embeds=pooled, guidance_scale=0.0, num_inference_steps=steps,
                   height=H, width=Wd, generator=g, output_type='pt', **MICRO).images
    s = pipe.scheduler
    T = {'prompt_ids_1': i1, 'prompt_ids_2': i2, 'prompt_embeds': pe, 'pooled_prompt_embeds': pooled,
         'cfg.prompt_embeds': R.unet[0]['ctx'], 'cfg.text_embeds': R.unet[0]['added']['text_embeds'],
         'cfg.time_ids': R.unet[0]['added']['time_ids'], 'initial_noise': R.noise[0],
         'initial_latents': R.noise[0] * s.init_noise_sigma}
    record_steps(T, False)
    finish_image(T, img)
    save_file({k: v.clone().contiguous() for k, v in T.items()}, f'{folder}/pipeline_{name}.safetensors')
    json.dump(plain_config(s), open(f'{folder}/scheduler/{name}.json', 'w'), indent=1)
    fj['pipeline']['runs'][name] = {'steps': steps, 'scheduler_config': f'scheduler/{name}.json', 'timesteps': timesteps_of(s),
                                    'sigmas': [float(x) for x in s.sigmas], 'init_noise_sigma': float(s.init_noise_sigma)}
json.dump(fj, open(folder + '/fewstep.json', 'w'), indent=1)
print('done')
