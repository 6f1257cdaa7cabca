# schedulers_more_seed123: the samplers of schedulers_more (DDPM, Heun, KDPM2, KDPM2 ancestral, LCM, TCD) on other step
# counts, spacings, Karras sigmas, v_prediction, LCM's original_inference_steps and TCD's gamma, from a [2, 4, 6, 8]
# noise (seed 5) and an ancestral generator seeded 123. Usage: python gen_sched_more.py <shared golden/sd> <out dir>
# (diffusers 0.27.2 on torch 1.13.1).
import json, os, sys, torch
from diffusers import (DDPMScheduler, HeunDiscreteScheduler, KDPM2DiscreteScheduler, KDPM2AncestralDiscreteScheduler,
                       LCMScheduler, TCDScheduler)
from safetensors.torch import save_file
from sched_loop import fake_model_loop
G = sys.argv[1]; OUT = sys.argv[2]; os.makedirs(OUT, exist_ok=True)
base = json.load(open(G + '/schedulers_more/config.json'))
noise_seed, anc_seed = 5, 123
cfg = {'base_config': base['base_config'], 'fake_model': base['fake_model'], 'loop': base['loop'],
       'initial_noise': f"torch.randn((2,4,6,8), generator=torch.Generator('cpu').manual_seed({noise_seed}))",
       'ancestral_generator_seed': anc_seed}
noise = torch.randn((2, 4, 6, 8), generator=torch.Generator('cpu').manual_seed(noise_seed))
save_file({'initial_noise': noise}, OUT + '/common.safetensors')
# name, class, steps, config overrides, step kwargs besides the generator, uses a generator
RUNS = [
    ('ddpm_7', DDPMScheduler, 7, {}, {}, True),
    ('ddpm_trailing_5', DDPMScheduler, 5, {'timestep_spacing': 'trailing'}, {}, True),
    ('ddpm_v_9', DDPMScheduler, 9, {'prediction_type': 'v_prediction'}, {}, True),
    ('heun_7', HeunDiscreteScheduler, 7, {}, {}, False),
    ('heun_karras_9', HeunDiscreteScheduler, 9, {'use_karras_sigmas': True}, {}, False),
    ('heun_linspace_6', HeunDiscreteScheduler, 6, {'timestep_spacing': 'linspace'}, {}, False),
    ('heun_v_5', HeunDiscreteScheduler, 5, {'prediction_type': 'v_prediction'}, {}, False),
    ('kdpm2_7', KDPM2DiscreteScheduler, 7, {}, {}, False),
    ('kdpm2_karras_8', KDPM2DiscreteScheduler, 8, {'use_karras_sigmas': True}, {}, False),
    ('kdpm2_trailing_6', KDPM2DiscreteScheduler, 6, {'timestep_spacing': 'trailing'}, {}, False),
    ('kdpm2_ancestral_5', KDPM2AncestralDiscreteScheduler, 5, {}, {}, True),
    ('kdpm2_ancestral_karras_9', KDPM2AncestralDiscreteScheduler, 9, {'use_karras_sigmas': True}, {}, True),
    ('kdpm2_ancestral_linspace_12', KDPM2AncestralDiscreteScheduler, 12, {'timestep_spacing': 'linspace'}, {}, True),
    ('lcm_3', LCMScheduler, 3, {}, {}, True),
    ('lcm_orig20_6', LCMScheduler, 6, {'original_inference_steps': 20}, {}, True),
    ('lcm_v_8', LCMScheduler, 8, {'prediction_type': 'v_prediction'}, {}, True),
    ('tcd_5', TCDScheduler, 5, {}, {}, True),
    ('tcd_gamma0_4', TCDScheduler, 4, {}, {'eta': 0.0}, True),
    ('tcd_gamma1_6', TCDScheduler, 6, {'original_inference_steps': 25}, {'eta': 1.0}, True),
]
runs = []
for name, Cls, n, over, extra, uses_gen in RUNS:
    s = Cls.from_config(base['base_config'], **over)
    s.set_timesteps(n)
    x0 = {LCMScheduler: lambda out: out.denoised, TCDScheduler: lambda out: out.pred_noised_sample}.get(Cls)
    T = fake_model_loop(s, noise, anc_seed, uses_gen, extra, x0)
    save_file({k: v.clone().contiguous() for k, v in T.items()}, f'{OUT}/{name}.safetensors')
    has_sigmas = Cls in (HeunDiscreteScheduler, KDPM2DiscreteScheduler, KDPM2AncestralDiscreteScheduler)
    step_kwargs = dict(extra)
    if uses_gen: step_kwargs['generator'] = f"torch.Generator('cpu').manual_seed({anc_seed}) created once, passed to every step"
    j = {'scheduler': Cls.__name__, 'config': dict(s.config), 'num_inference_steps': n, 'num_loop_steps': len(s.timesteps),
         'timesteps': [float(t) for t in s.timesteps], 'timesteps_dtype': str(s.timesteps.dtype).replace('torch.', ''),
         'sigmas': [float(v) for v in s.sigmas] if has_sigmas else None,
         'init_noise_sigma': float(s.init_noise_sigma), 'step_kwargs': step_kwargs}
    j['config'] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in j['config'].items() if not k.startswith('_')}
    json.dump(j, open(f'{OUT}/{name}.json', 'w'), indent=1)
    runs.append({'file': name, 'scheduler': Cls.__name__, 'steps': n, 'loop_steps': len(s.timesteps)})
cfg['runs'] = runs
json.dump(cfg, open(OUT + '/config.json', 'w'), indent=1)
