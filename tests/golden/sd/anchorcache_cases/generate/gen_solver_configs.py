# The DPM-Solver family's solver settings against diffusers 0.27.2 itself: the scheduler loop of
# ../shared/golden/sd/schedulers_more (same base config, fake model and file layout) for configurations the public set
# lacks (solver_order 1 and 3, solver_type heun / bh1, final_sigmas_type sigma_min, lower_order_final false,
# euler_at_final, UniPC's predict_x0 false and disable_corrector, Karras sigmas, v-prediction, other spacings).
# Usage: python gen_solver_configs.py ../shared/golden/sd OUT   (diffusers 0.27.2, torch)
import json, os, sys, torch
from diffusers import (DPMSolverMultistepScheduler, DPMSolverSinglestepScheduler, UniPCMultistepScheduler,
                       DEISMultistepScheduler)
from safetensors.torch import save_file
from sched_loop import fake_model_loop

G = sys.argv[1]; OUT = sys.argv[2]; os.makedirs(OUT, exist_ok=True)
src = json.load(open(G + '/schedulers_more/config.json'))
base = src['base_config']
noise_seed, anc_seed = 11, 321
noise = torch.randn((1, 4, 4, 4), generator=torch.Generator('cpu').manual_seed(noise_seed))
save_file({'initial_noise': noise}, OUT + '/common.safetensors')
M, S, U, D = DPMSolverMultistepScheduler, DPMSolverSinglestepScheduler, UniPCMultistepScheduler, DEISMultistepScheduler
SDE = {'algorithm_type': 'sde-dpmsolver++'}
RUNS = [  # name, class, overrides, steps
    ('dpmpp_2m_sde_karras_7', M, dict(SDE, use_karras_sigmas=True), 7),
    ('dpmpp_2m_sde_heun_9', M, dict(SDE, solver_type='heun'), 9),
    ('dpmpp_2m_sde_order1_5', M, dict(SDE, solver_order=1), 5),
    ('dpmpp_2m_sde_sigmamin_6', M, dict(SDE, final_sigmas_type='sigma_min', lower_order_final=False), 6),
    ('dpmpp_2m_order3_16', M, dict(solver_order=3), 16),
    ('dpmpp_2m_order3_sigmamin_8', M, dict(solver_order=3, final_sigmas_type='sigma_min'), 8),
    ('dpmpp_2m_heun_vpred_11', M, dict(solver_type='heun', prediction_type='v_prediction', timestep_spacing='trailing'), 11),
    ('dpmpp_2m_euler_final_sigmamin_17', M, dict(final_sigmas_type='sigma_min', euler_at_final=True), 17),
    ('dpmpp_2s_karras_9', S, dict(use_karras_sigmas=True), 9),
    ('dpmpp_2s_heun_sigmamin_8', S, dict(solver_type='heun', final_sigmas_type='sigma_min', lower_order_final=False), 8),
    ('dpmpp_2s_order1_5', S, dict(solver_order=1), 5),
    ('dpmpp_2s_vpred_7', S, dict(prediction_type='v_prediction'), 7),
    ('unipc_order3_12', U, dict(solver_order=3), 12),
    ('unipc_bh1_noise_7', U, dict(solver_type='bh1', predict_x0=False), 7),
    ('unipc_karras_8', U, dict(use_karras_sigmas=True), 8),
    ('unipc_dc_lof_linspace_9', U, dict(disable_corrector=[0, 3], lower_order_final=False, timestep_spacing='linspace'), 9),
    ('unipc_vpred_order1_6', U, dict(prediction_type='v_prediction', solver_order=1), 6),
    ('deis_order3_16', D, dict(solver_order=3), 16),
    ('deis_order3_8', D, dict(solver_order=3), 8),
    ('deis_karras_7', D, dict(use_karras_sigmas=True), 7),
    ('deis_linspace_vpred_10', D, dict(timestep_spacing='linspace', prediction_type='v_prediction'), 10),
    ('deis_order1_lof_5', D, dict(solver_order=1, lower_order_final=False), 5),
]
runs = []
for name, cls, over, n in RUNS:
    s = cls.from_config(base, **over)
    s.set_timesteps(n)
    gen_used = s.config.get('algorithm_type') == 'sde-dpmsolver++'
    T = fake_model_loop(s, noise, anc_seed, gen_used)
    save_file({k: v.clone().contiguous() for k, v in T.items()}, f'{OUT}/{name}.safetensors')
    j = {'scheduler': cls.__name__, 'config': dict(s.config), 'num_inference_steps': n,
         'num_loop_steps': len(s.timesteps), 'timesteps': [float(t) for t in s.timesteps],
         'timesteps_dtype': str(s.timesteps.dtype).replace('torch.', ''), 'sigmas': [float(v) for v in s.sigmas],
         'init_noise_sigma': float(s.init_noise_sigma),
         'step_kwargs': {'generator': f"torch.Generator('cpu').manual_seed({anc_seed}) created once, passed to every step"} if gen_used else {}}
    j['config'] = {k: ('-inf' if v == float('-inf') else list(v) if isinstance(v, tuple) else v)
                   for k, v in j['config'].items() if not k.startswith('_')}
    json.dump(j, open(f'{OUT}/{name}.json', 'w'), indent=1)
    runs.append({'file': name, 'scheduler': cls.__name__, 'steps': n, 'loop_steps': len(s.timesteps)})
cfg = {'base_config': base, 'fake_model': src['fake_model'], 'loop': src['loop'],
       'initial_noise': f"torch.randn((1,4,4,4), generator=torch.Generator('cpu').manual_seed({noise_seed}))",
       'ancestral_generator_seed': anc_seed, 'runs': runs}
json.dump(cfg, open(OUT + '/config.json', 'w'), indent=1)
