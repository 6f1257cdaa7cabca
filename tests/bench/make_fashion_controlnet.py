# A random ControlNet for the demo model fashion-sd (diffusers ControlNetModel.from_unet, the zero convolutions and the
# conditioning embedding's conv_out drawn from N(0, 0.05) so that it moves the image) and a 32x32 edge-map control image,
# for tests/bench/controlnet_cache.sh. Run with a diffusers 0.27.2 venv: python make_fashion_controlnet.py

import torch, numpy as np
from PIL import Image
from diffusers import UNet2DConditionModel, ControlNetModel
torch.manual_seed(0)
unet = UNet2DConditionModel.from_pretrained('assets/models/fashion-sd/unet')
cn = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(8, 16, 32))
with torch.no_grad():
    for m in list(cn.controlnet_down_blocks) + [cn.controlnet_mid_block, cn.controlnet_cond_embedding.conv_out]:
        m.weight.normal_(0, 0.05); m.bias.zero_()
cn.save_pretrained('/tmp/fashion_cn')
# an edge map: the outline of a shirt-like shape on black, 32x32
img = np.zeros((32, 32, 3), np.uint8)
img[6, 8:24] = 255; img[26, 10:22] = 255; img[6:27, 10] = 255; img[6:27, 21] = 255
img[6:12, 4] = 255; img[6:12, 27] = 255; img[6, 4:9] = 255; img[6, 23:28] = 255; img[12, 4:11] = 255; img[12, 21:28] = 255
Image.fromarray(img).save('/tmp/fashion_edges.png')
print('ok')
