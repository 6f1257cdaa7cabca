# Noise schedules (anchor-sd --schedule) and Euler ancestral eta: reference sigmas / timesteps / loops.
#   python3 gen_noise_schedules.py OUT_DIR        (writes OUT_DIR/noise_schedules.json)
# karras: diffusers 0.27.2 itself, EulerDiscreteScheduler(use_karras_sigmas=True, timestep_spacing='linspace') (the
#   spacing whose sigmas span the model's whole range, which is where diffusers' Euler takes its Karras range from)
#   and DPMSolverMultistepScheduler(use_karras_sigmas=True).
# exponential, sgm_uniform, simple: not in diffusers 0.27.2. Computed here by an independent reimplementation of
#   ComfyUI's comfy/samplers.py formulas (and k-diffusion's get_sigmas_exponential) on diffusers' float32 model
#   sigmas, timesteps from diffusers' own EulerDiscreteScheduler._sigma_to_t.
# euler_ancestral: diffusers' EulerAncestralDiscreteScheduler loop (eta 1) with a seeded generator, and the same loop
#   written out with k-diffusion's get_ancestral_step for eta 0.5 and for eta 1 on karras sigmas.
# The fake model is gen_sched.py's: eps = 0.1 * model_input + 0.01 * t / 1000.
import json, math, os, sys
import numpy as np, torch
from diffusers import EulerDiscreteScheduler, DPMSolverMultistepScheduler, EulerAncestralDiscreteScheduler

OUT = sys.argv[1]; os.makedirs(OUT, exist_ok=True)
BASE = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule='scaled_linear', steps_offset=1,
            timestep_spacing='leading')  # SD 1.5's scheduler_config.json (the classes' own default is 'linspace')
STEPS = [1, 4, 10, 25]
ref = EulerDiscreteScheduler(**BASE)
sig = np.array(((1 - ref.alphas_cumprod) / ref.alphas_cumprod) ** 0.5)  # float32, t = 0 .. 999
log_sig = np.log(sig)
smin, smax, N = float(sig[0]), float(sig[-1]), len(sig)

def to_t(s):
    return [float(ref._sigma_to_t(np.array(x), log_sig)) for x in s]

def comfy_sigma(t):  # ModelSamplingDiscrete.sigma: log-sigma interpolation between neighbouring timesteps
    t = min(max(float(t), 0.0), N - 1.0); lo, hi = math.floor(t), math.ceil(t); w = t - lo
    return math.exp((1 - w) * float(log_sig[lo]) + w * float(log_sig[hi]))

def comfy_timestep(s):  # ModelSamplingDiscrete.timestep: nearest training timestep in log sigma
    return int(np.abs(math.log(s) - log_sig.astype(np.float64)).argmin())

schedules = []
for n in STEPS:
    e = EulerDiscreteScheduler(**dict(BASE, use_karras_sigmas=True, timestep_spacing='linspace')); e.set_timesteps(n)
    if n > 1:  # one 'linspace' step is timestep 0 alone, so diffusers' Euler range collapses to sigma(0)
        schedules.append({'schedule': 'karras', 'source': 'diffusers EulerDiscreteScheduler(use_karras_sigmas=True, '
                          "timestep_spacing='linspace')", 'steps': n, 'sigmas': [float(x) for x in e.sigmas[:-1]],
                          'timesteps': [float(x) for x in e.timesteps], 'timesteps_rounded': False})
    d = DPMSolverMultistepScheduler(**BASE, use_karras_sigmas=True); d.set_timesteps(n)
    schedules.append({'schedule': 'karras', 'source': 'diffusers DPMSolverMultistepScheduler(use_karras_sigmas=True)',
                      'steps': n, 'sigmas': [float(x) for x in d.sigmas[:-1]],
                      'timesteps': [float(x) for x in d.timesteps], 'timesteps_rounded': True})
    ex = list(np.exp(np.linspace(math.log(smax), math.log(smin), n)))
    start, end = comfy_timestep(smax), comfy_timestep(smin)
    sg = [comfy_sigma(t) for t in np.linspace(start, end, n + 1)[:-1]]
    ss = N / n
    si = [float(sig[-(1 + int(x * ss))]) for x in range(n)]
    for name, s, src in [('exponential', ex, 'reimplementation of k-diffusion get_sigmas_exponential (float64)'),
                         ('sgm_uniform', sg, 'reimplementation of ComfyUI normal_scheduler(sgm=True)'),
                         ('simple', si, 'reimplementation of ComfyUI simple_scheduler')]:
        schedules.append({'schedule': name, 'source': src, 'steps': n,
                          'sigmas': [float(x) for x in s], 'timesteps': to_t(s), 'timesteps_rounded': False})

# Euler ancestral loops on a [1, 2, 3, 3] sample.
NOISE_SEED, GEN_SEED, NA = 11, 31, 12
noise = torch.randn((1, 2, 3, 3), generator=torch.Generator('cpu').manual_seed(NOISE_SEED))

def fake_eps(mi, t):
    return 0.1 * mi + 0.01 * float(t) / 1000

a = EulerAncestralDiscreteScheduler(**BASE); a.set_timesteps(NA)
x = noise * a.init_noise_sigma; gen = torch.Generator('cpu').manual_seed(GEN_SEED)
for t in a.timesteps:
    x = a.step(fake_eps(a.scale_model_input(x, t), t), t, x, generator=gen).prev_sample
loops = [{'schedule': 'default', 'eta': 1.0, 'source': 'diffusers EulerAncestralDiscreteScheduler', 'steps': NA,
          'final': x.flatten().tolist()}]

def k_loop(sigmas, timesteps, eta, init_sigma):
    x = noise * init_sigma; gen = torch.Generator('cpu').manual_seed(GEN_SEED)
    for i, t in enumerate(timesteps):
        s, s_to = float(sigmas[i]), float(sigmas[i + 1])
        eps = fake_eps(x / (s * s + 1) ** 0.5, t)
        x0 = x - s * eps
        up = min(s_to, eta * (s_to ** 2 * (s ** 2 - s_to ** 2) / s ** 2) ** 0.5)
        down = (s_to ** 2 - up ** 2) ** 0.5
        x = x + (x - x0) / s * (down - s)
        x = x + torch.randn(x.shape, generator=gen) * up
    return x

dflt_sigmas, dflt_t = [float(v) for v in a.sigmas], [float(v) for v in a.timesteps]
x = k_loop(dflt_sigmas, dflt_t, 0.5, float(a.init_noise_sigma))
loops.append({'schedule': 'default', 'eta': 0.5, 'source': 'k-diffusion get_ancestral_step loop', 'steps': NA,
              'final': x.flatten().tolist()})
e = EulerDiscreteScheduler(**dict(BASE, use_karras_sigmas=True, timestep_spacing='linspace')); e.set_timesteps(NA)
ks = [float(v) for v in e.sigmas]
x = k_loop(ks, [float(v) for v in e.timesteps], 1.0, (ks[0] ** 2 + 1) ** 0.5)  # 'leading' init: sqrt(smax^2 + 1)
loops.append({'schedule': 'karras', 'eta': 1.0, 'source': 'k-diffusion get_ancestral_step loop', 'steps': NA,
              'final': x.flatten().tolist()})

json.dump({'about': 'reference noise schedules and Euler ancestral loops (generate/gen_noise_schedules.py)',
           'scheduler_config': BASE, 'model': 'eps = 0.1 * model_input + 0.01 * t / 1000',
           'initial_noise': f"torch.randn((1, 2, 3, 3), generator=torch.Generator('cpu').manual_seed({NOISE_SEED}))",
           'generator_seed': GEN_SEED, 'schedules': schedules, 'euler_ancestral': loops},
          open(OUT + '/noise_schedules.json', 'w'), indent=1)
