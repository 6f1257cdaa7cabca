# Usage (diffusers 0.27.2 venv): OUT=/tmp/controlnet_original python controlnet_original_layout.py; then
# anchor-sd -m assets/models/sd15-tiny-random --control-net $OUT/control_tiny.pth ... gives the image of the folder.
# The golden diffusers ControlNet written in the original (cldm) layout by an independent inverse mapping, checked by
# converting it back with diffusers' own single-file converter.
import json, os, re, torch
from safetensors.torch import load_file, save_file
from diffusers.loaders.single_file_utils import convert_controlnet_checkpoint
src = '/work/shared/golden/sd/controlnet_tiny/controlnet'
D = load_file(f'{src}/diffusion_pytorch_model.safetensors'); cfg = json.load(open(f'{src}/config.json'))
lpb = cfg['layers_per_block']; nb = len(cfg['block_out_channels'])
res_map = {'norm1': 'in_layers.0', 'conv1': 'in_layers.2', 'time_emb_proj': 'emb_layers.1', 'norm2': 'out_layers.0',
           'conv2': 'out_layers.3', 'conv_shortcut': 'skip_connection'}
nemb = len(cfg['conditioning_embedding_out_channels'])
def resnet_param(rest):
    mod, p = rest.rsplit('.', 1)
    return f'{res_map[mod]}.{p}'
# (diffusers name pattern, original name of the match); resnets and attentions of the down blocks are above
RULES = [
    (r'down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.*)', lambda m: f'input_blocks.{1 + int(m[1]) * (lpb + 1) + lpb}.0.op.{m[2]}'),
    (r'mid_block\.resnets\.(\d+)\.(.*)', lambda m: f'middle_block.{2 * int(m[1])}.{resnet_param(m[2])}'),
    (r'mid_block\.attentions\.0\.(.*)', lambda m: f'middle_block.1.{m[1]}'),
    (r'conv_in\.(.*)', lambda m: f'input_blocks.0.0.{m[1]}'),
    (r'time_embedding\.linear_(\d)\.(.*)', lambda m: f'time_embed.{2 * (int(m[1]) - 1)}.{m[2]}'),
    (r'controlnet_cond_embedding\.conv_in\.(.*)', lambda m: f'input_hint_block.0.{m[1]}'),
    (r'controlnet_cond_embedding\.blocks\.(\d+)\.(.*)', lambda m: f'input_hint_block.{2 * (int(m[1]) + 1)}.{m[2]}'),
    (r'controlnet_cond_embedding\.conv_out\.(.*)', lambda m: f'input_hint_block.{2 * (2 * (nemb - 1) + 1)}.{m[1]}'),
    (r'controlnet_down_blocks\.(\d+)\.(.*)', lambda m: f'zero_convs.{m[1]}.0.{m[2]}'),
    (r'controlnet_mid_block\.(.*)', lambda m: f'middle_block_out.0.{m[1]}'),
]
def to_orig(k):
    m = re.match(r'down_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.*)', k)
    if m:
        b, kind, j, rest = int(m[1]), m[2], int(m[3]), m[4]
        ib = 1 + b * (lpb + 1) + j
        if kind == 'resnets':
            return f'input_blocks.{ib}.0.{resnet_param(rest)}'
        return f'input_blocks.{ib}.1.{rest}'
    for pattern, name in RULES:
        m = re.fullmatch(pattern, k)
        if m: return name(m)
    raise KeyError(k)
O = {to_orig(k): v for k, v in D.items()}
assert len(O) == len(D)
back = convert_controlnet_checkpoint({'control_model.' + k: v.clone() for k, v in O.items()}, cfg)
# diffusers' converter hard-codes the released 4-level hint encoder (conv_out = input_hint_block.14, blocks.0..5 =
# 2..12); for this 2-level one it names the last conv (index 6) blocks.2: the same tensor.
if nemb != 4:
    for p in ('weight', 'bias'):
        back[f'controlnet_cond_embedding.conv_out.{p}'] = back.pop(f'controlnet_cond_embedding.blocks.{2 * (nemb - 1)}.{p}')
assert set(back) == set(D), (set(D) - set(back), set(back) - set(D))
assert all(torch.equal(back[k], D[k]) for k in D)
out = os.environ.get('OUT', '/tmp/controlnet_original')
os.makedirs(out, exist_ok=True)
save_file({'control_model.' + k: v for k, v in O.items()}, f'{out}/control_tiny_prefixed.safetensors')
save_file(O, f'{out}/control_tiny.safetensors')
torch.save({'state_dict': {'control_model.' + k: v for k, v in O.items()}}, f'{out}/control_tiny.pth')
print('ok: diffusers converts the original layout back to the golden tensors exactly,', len(O), 'tensors')
