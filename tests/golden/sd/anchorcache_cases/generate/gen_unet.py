# Reference UNet forward cases with diffusers 0.27.2 (torch 1.13 CPU f32, 1 thread), layout of golden unet_sd15_tiny.
import baddbmm_fix
import json, os, sys, torch
from diffusers import UNet2DConditionModel
from safetensors.torch import save_file, load_file
torch.set_num_threads(1)

def init_random(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, mod in model.named_modules():
            for pn, p in mod.named_parameters(recurse=False):
                v = torch.randn(p.shape, generator=g) * 0.05
                if isinstance(mod, (torch.nn.GroupNorm, torch.nn.LayerNorm)) and pn == "weight": v += 1.0
                p.copy_(v.half().float())

def run_case(out, unet, B, H, W, ctx_len, seeds, ta, tb):
    os.makedirs(out, exist_ok=True)
    cad = unet.config.cross_attention_dim
    sample = torch.randn((B, unet.config.in_channels, H, W), generator=torch.Generator('cpu').manual_seed(seeds[0]))
    ehs = torch.randn((B, ctx_len, cad), generator=torch.Generator('cpu').manual_seed(seeds[1]))
    feats = {}
    hooks = []
    def hook(name, inner):
        def f(m, i, o):
            if cur[0] == 'b' and inner: return
            if isinstance(o, tuple):
                if name.startswith('down_blocks.') and name.count('.') == 1:
                    feats[cur[0] + '.' + name + '.hidden'] = o[0].clone()
                    for k, r in enumerate(o[1]): feats[cur[0] + '.' + name + f'.res_samples.{k}'] = r.clone()
                    return
                o = o[0]
            if hasattr(o, 'sample'): o = o.sample
            feats[cur[0] + '.' + name] = o.clone()
        return f
    for name, m in unet.named_modules():
        parts = name.split('.')
        if name in ('time_proj', 'time_embedding', 'conv_in', 'conv_norm_out', 'conv_out', 'mid_block'):
            hooks.append(m.register_forward_hook(hook(name, False)))
        elif len(parts) == 2 and parts[0] in ('down_blocks', 'up_blocks'):
            hooks.append(m.register_forward_hook(hook(name, False)))
        elif len(parts) == 4 and parts[0] in ('down_blocks', 'up_blocks') and parts[2] in ('resnets', 'attentions', 'downsamplers', 'upsamplers'):
            hooks.append(m.register_forward_hook(hook(name, True)))
        elif len(parts) == 3 and parts[0] == 'mid_block' and parts[1] in ('resnets', 'attentions'):
            hooks.append(m.register_forward_hook(hook(name, True)))
    cur = ['a']
    tsa = torch.tensor(ta, dtype=torch.int64)
    tsb = torch.tensor(tb, dtype=torch.int64)
    with torch.no_grad():
        a = unet(sample, tsa, encoder_hidden_states=ehs).sample
        cur[0] = 'b'
        b = unet(sample, tsb, encoder_hidden_states=ehs).sample
    save_file({'sample': sample, 'encoder_hidden_states': ehs, 'timesteps_a': tsa, 'timestep_b': tsb}, out + '/golden_inputs.safetensors')
    save_file({'a.out': a, 'b.out': b}, out + '/golden_outputs.safetensors')
    save_file(feats, out + '/golden_features.safetensors')
    json.dump({'sample': f"torch.randn(({B},{unet.config.in_channels},{H},{W}), generator=torch.Generator('cpu').manual_seed({seeds[0]}))"}, open(out + '/golden.json', 'w'))

if __name__ == '__main__':  # gen_fewstep.py imports init_random / run_case
    golden = sys.argv[1]
    OUT = sys.argv[3]
    which = sys.argv[2]
    if which == 'sd1':
        src = golden + '/unet_sd15_tiny'
        unet = UNet2DConditionModel.from_pretrained(src).eval()
        for k, (B, H, W, s, ta, tb) in enumerate([(2, 8, 8, (31, 32), [999, 500], 1), (3, 16, 16, (41, 42), [700, 300, 20], 950), (2, 8, 12, (51, 52), [13, 880], 400), (1, 8, 8, (61, 62), [640], 980)]):
            out = f'{OUT}/unet_sd1_{k}'
            os.makedirs(out, exist_ok=True)
            os.system(f'cp {src}/config.json {src}/diffusion_pytorch_model.safetensors {out}/')
            run_case(out, unet, B, H, W, 77, s, ta, tb)
    elif which == 'sd2':
        cfg = dict(sample_size=8, in_channels=4, out_channels=4,
                   down_block_types=["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
                   up_block_types=["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
                   block_out_channels=[32, 64, 64, 64], layers_per_block=2, cross_attention_dim=48,
                   attention_head_dim=[2, 4, 4, 4], norm_num_groups=32, use_linear_projection=True)
        unet = UNet2DConditionModel(**cfg).eval()
        init_random(unet, 2001)
        for k, (B, H, W, s, ta, tb) in enumerate([(2, 8, 8, (71, 72), [999, 500], 1), (2, 16, 8, (81, 82), [250, 760], 60)]):
            out = f'{OUT}/unet_sd2_{k}'
            unet.save_pretrained(out)
            run_case(out, unet, B, H, W, 77, s, ta, tb)
    elif which == 'sd2t0':
        # The SD 2.x-style UNet above (its stored weights) at timestep 0: a 0-dim 0 and a per-element batch holding 0,
        # on the 16x8 latents of unet_sd2_style and on larger 32x16 ones (argv[4]: the unet_sd2_style folder).
        src = sys.argv[4]
        unet = UNet2DConditionModel.from_pretrained(src, torch_dtype=torch.float32).eval()
        for name, (B, H, W, s, ta, tb) in {'unet_sd2_t0': (2, 16, 8, (81, 82), [0, 760], 0),
                                           'unet_sd2_t0_32x16': (3, 32, 16, (91, 92), [0, 0, 999], 0)}.items():
            out = f'{OUT}/{name}'
            os.makedirs(out, exist_ok=True)
            os.system(f'cp {src}/config.json {src}/diffusion_pytorch_model.safetensors {out}/')
            run_case(out, unet, B, H, W, 77, s, ta, tb)
