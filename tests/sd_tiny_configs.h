// The tiny SD 2.x-layout model of the single-file tests, and its Open CLIP tensor names: linear projections, one head
// per level (what shape detection assumes for SD 2.x: head dim 64, at least one head), an OpenCLIP-style (gelu) text
// encoder.
#pragma once

#include "unet/model/clip_text.h"
#include "unet/model/unet_model.h"
#include "unet/model/vae.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

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

// The text encoder's tensors under Open CLIP's names (SD 2.x single files) after `oc`: fused in_proj, and one resblock
// more than the model uses (SD 2.x conditions on the penultimate layer; the copy of layer 1 is never read).
inline void add_open_clip_tensors(std::vector<std::pair<std::string, torch::Tensor>>& file, unet::ClipTextModelImpl& te,
                                  const std::string& oc) {
    auto P = [&](const std::string& n) { return te.named_parameters(true)[n].detach().clone(); };
    file.emplace_back(oc + "token_embedding.weight", P("text_model.embeddings.token_embedding.weight"));
    file.emplace_back(oc + "positional_embedding", P("text_model.embeddings.position_embedding.weight"));
    file.emplace_back(oc + "ln_final.weight", P("text_model.final_layer_norm.weight"));
    file.emplace_back(oc + "ln_final.bias", P("text_model.final_layer_norm.bias"));
    for (int i = 0; i < 3; ++i) {
        const std::string r = oc + "transformer.resblocks." + std::to_string(i) + ".";
        const std::string h = "text_model.encoder.layers." + std::to_string(std::min(i, 1)) + ".";
        for (const char* k : {"weight", "bias"}) {
            file.emplace_back(r + "ln_1." + k, P(h + "layer_norm1." + k));
            file.emplace_back(r + "ln_2." + k, P(h + "layer_norm2." + k));
            file.emplace_back(r + "mlp.c_fc." + k, P(h + "mlp.fc1." + k));
            file.emplace_back(r + "mlp.c_proj." + k, P(h + "mlp.fc2." + k));
            file.emplace_back(r + "attn.out_proj." + k, P(h + "self_attn.out_proj." + k));
            file.emplace_back(r + "attn.in_proj_" + k,
                              torch::cat({P(h + "self_attn.q_proj." + k), P(h + "self_attn.k_proj." + k),
                                          P(h + "self_attn.v_proj." + k)},
                                         0));
        }
    }
}

} // namespace anchor::test
