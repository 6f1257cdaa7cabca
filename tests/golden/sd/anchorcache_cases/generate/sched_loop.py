# The scheduler loop of ../shared/golden/sd/schedulers_more with its fake model (its README):
# eps = 0.1 * model_input + 0.01 * t / 1000, x = initial_noise * init_noise_sigma, then per timestep
# scale_model_input and step; samplers that draw noise get one generator seeded `anc_seed`, created once, and a twin
# generator records the noise each step draws. Shared by gen_sched_more.py and gen_solver_configs.py.
import torch


def fake_model_loop(s, noise, anc_seed, uses_gen, step_kwargs=None, denoised=None):
    """Runs scheduler `s` (set_timesteps done) from `noise`; returns the tensors a case file stores. `denoised(out)`,
    when given, is the step's x0 estimate stored as denoised.<i>."""
    kw = dict(step_kwargs or {})
    if uses_gen:
        kw['generator'] = torch.Generator('cpu').manual_seed(anc_seed)
        twin = torch.Generator('cpu').manual_seed(anc_seed)
    T = {}
    x = noise * s.init_noise_sigma
    T['sample_0'] = x
    for i, t in enumerate(s.timesteps):
        mi = s.scale_model_input(x, t)
        T[f'model_input.{i}'] = mi
        eps = 0.1 * mi + 0.01 * float(t) / 1000
        if uses_gen:
            T[f'noise.{i}'] = torch.randn(x.shape, generator=twin)
        out = s.step(eps, t, x, **kw)
        x = out.prev_sample
        T[f'prev_sample.{i}'] = x
        if denoised is not None:
            T[f'denoised.{i}'] = denoised(out)
    T['final'] = x
    return T
