import baddbmm_fix, json, os, sys, torch
from diffusers import AutoencoderKL
from safetensors.torch import save_file, load_file
torch.set_num_threads(1)
G = sys.argv[1]
src = G + '/vae_tiny'
vae = AutoencoderKL.from_pretrained(src).eval()
for k, (B, H, W, s) in enumerate([(1, 8, 8, (31, 32, 33)), (2, 12, 8, (41, 42, 43)), (3, 6, 10, (51, 52, 53))]):
    out = f'{sys.argv[2]}/vae_{k}'; os.makedirs(out, exist_ok=True)
    os.system(f'cp {src}/config.json {src}/diffusion_pytorch_model.safetensors {out}/')
    lat = torch.randn((B, 4, H, W), generator=torch.Generator('cpu').manual_seed(s[0]))
    img = torch.rand((B, 3, 2 * H, 2 * W), generator=torch.Generator('cpu').manual_seed(s[1])) * 2 - 1
    feats = {}; cur = ['decode']
    names = {'decoder.conv_in', 'decoder.conv_norm_out', 'decoder.conv_out', 'decoder.mid_block', 'decoder.up_blocks.0', 'decoder.up_blocks.1', 'post_quant_conv',
             'encoder.conv_in', 'encoder.conv_norm_out', 'encoder.conv_out', 'encoder.down_blocks.0', 'encoder.down_blocks.1', 'encoder.mid_block', 'quant_conv'}
    for n, m in vae.named_modules():
        if n in names: m.register_forward_hook(lambda m, i, o, n=n: feats.__setitem__(cur[0] + '.' + n, (o if torch.is_tensor(o) else o[0]).clone()))
    with torch.no_grad():
        dec = vae.decode(lat).sample
        cur[0] = 'encode'
        d = vae.encode(img).latent_dist
        smp = d.sample(generator=torch.Generator('cpu').manual_seed(s[2]))
    save_file({'latent': lat, 'image': img}, out + '/golden_inputs.safetensors')
    save_file({'decode.image': dec, 'encode.moments': d.parameters, 'encode.mean': d.mean, 'encode.logvar': d.logvar, 'encode.std': d.std, 'encode.sample': smp}, out + '/golden_outputs.safetensors')
    save_file(feats, out + '/golden_features.safetensors')
    json.dump({'latent': f"torch.randn(({B},4,{H},{W}), generator=torch.Generator('cpu').manual_seed({s[0]}))",
               'encode.sample': f"latent_dist.sample(generator=torch.Generator('cpu').manual_seed({s[2]})) = mean + std * randn(mean.shape)"}, open(out + '/golden.json', 'w'), indent=1)
