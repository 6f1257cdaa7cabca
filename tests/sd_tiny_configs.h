// The tiny SD 2.x-layout model of the single-file tests: linear projections, one head per level (what shape detection
// assumes for SD 2.x: head dim 64, at least one head), an OpenCLIP-style (gelu) text encoder.
#pragma once

#include "unet/clip_text.h"
#include "unet/unet_model.h"
#include "unet/vae.h"

namespace anchor::test {

struct TinySd2Configs {
    unet::UNetConfig unet;
    unet::VaeConfig vae;
    unet::ClipTextConfig text;
};

inline TinySd2Configs tiny_sd2_configs() {
    TinySd2Configs c;
    c.unet.block_out_channels = {32, 64};
    c.unet.down_block_types = {"CrossAttnDownBlock2D", "DownBlock2D"};
    c.unet.up_block_types = {"UpBlock2D", "CrossAttnUpBlock2D"};
    c.unet.layers_per_block = {1, 1};
    c.unet.heads = {1, 1};
    c.unet.transformer_layers_per_block = {1, 1};
    c.unet.cross_attention_dim = 32;
    c.unet.use_linear_projection = true;
    c.vae.block_out_channels = {32, 64};
    c.vae.layers_per_block = 1;
    c.text.vocab_size = 1000;
    c.text.hidden_size = 32;
    c.text.intermediate_size = 40;
    c.text.num_hidden_layers = 2;
    c.text.num_attention_heads = 4;
    c.text.hidden_act = "gelu";
    return c;
}

} // namespace anchor::test
