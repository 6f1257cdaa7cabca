import json, os, sys, inspect, torch
from diffusers import DDIMScheduler, PNDMScheduler, EulerDiscreteScheduler, EulerAncestralDiscreteScheduler, DPMSolverMultistepScheduler, LMSDiscreteScheduler
from safetensors.torch import save_file
G = sys.argv[1]; OUT = sys.argv[2]; os.makedirs(OUT, exist_ok=True)
base = json.load(open(G + '/schedulers/config.json'))
cfg = dict(base); noise_seed, anc_seed = 5, 123
cfg['initial_noise'] = f"torch.randn((2,4,6,8), generator=torch.Generator('cpu').manual_seed({noise_seed}))"; cfg['ancestral_generator_seed'] = anc_seed
noise = torch.randn((2, 4, 6, 8), generator=torch.Generator('cpu').manual_seed(noise_seed))
sched0 = DDIMScheduler.from_config(base['base_config'])
save_file({'initial_noise': noise, 'betas': sched0.betas, 'alphas_cumprod': sched0.alphas_cumprod}, OUT + '/common.safetensors')
CLS = {'ddim': DDIMScheduler, 'pndm': PNDMScheduler, 'euler': EulerDiscreteScheduler, 'euler_ancestral': EulerAncestralDiscreteScheduler, 'dpmpp_2m': DPMSolverMultistepScheduler, 'dpmpp_2m_karras': DPMSolverMultistepScheduler, 'lms': LMSDiscreteScheduler}
runs = []
for var, n in [('euler_ancestral', 7), ('euler_ancestral', 30), ('ddim', 13), ('pndm', 9), ('euler', 15), ('dpmpp_2m', 12), ('dpmpp_2m_karras', 25), ('lms', 11)]:
    v = base['variants'][var]
    s = CLS[var].from_config(base['base_config'], **v['overrides'])
    s.set_timesteps(n)
    kw = {}
    if v['uses_generator']: gen = torch.Generator('cpu').manual_seed(anc_seed); kw['generator'] = gen; twin = torch.Generator('cpu').manual_seed(anc_seed)
    if var == 'ddim': kw['eta'] = 0.0
    T = {}
    x = noise * s.init_noise_sigma; T['sample_0'] = x
    for i, t in enumerate(s.timesteps):
        mi = s.scale_model_input(x, t); T[f'model_input.{i}'] = mi
        eps = 0.1 * mi + 0.01 * float(t) / 1000
        if v['uses_generator']: T[f'noise.{i}'] = torch.randn(x.shape, generator=twin)
        x = s.step(eps, t, x, **kw).prev_sample; T[f'prev_sample.{i}'] = x
    T['final'] = x
    name = f'{var}_{n}'
    save_file(T, f'{OUT}/{name}.safetensors')
    j = {'scheduler': v['class'], 'config': dict(s.config), 'num_inference_steps': n, 'num_loop_steps': len(s.timesteps),
         'timesteps': [float(t) for t in s.timesteps], 'timesteps_dtype': str(s.timesteps.dtype).replace('torch.', ''),
         'sigmas': [float(x) for x in s.sigmas] if hasattr(s, 'sigmas') and var not in ('ddim', 'pndm') else None,
         'init_noise_sigma': float(s.init_noise_sigma),
         'step_kwargs': ({'generator': f"torch.Generator('cpu').manual_seed({anc_seed}) created once, passed to every step"} if v['uses_generator'] else {}) | ({'eta': 0.0} if var == 'ddim' else {})}
    j['config'] = {k: ('-inf' if vv == float('-inf') else list(vv) if isinstance(vv, tuple) else vv) for k, vv in j['config'].items() if not k.startswith('_')}
    json.dump(j, open(f'{OUT}/{name}.json', 'w'), indent=1)
    runs.append({'file': name, 'scheduler': v['class'], 'steps': n, 'loop_steps': len(s.timesteps)})
cfg['runs'] = runs
json.dump(cfg, open(OUT + '/config.json', 'w'), indent=1)
