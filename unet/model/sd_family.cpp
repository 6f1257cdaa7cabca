#include "unet/model/sd_family.h"

#include "cache/io/weight_map.h"

#include <algorithm>

namespace anchor::unet {

const EnumTable<SdFamily>& sd_family_table() {
    static const EnumTable<SdFamily> t = {{"sd1", SdFamily::SD1},
                                          {"sd2", SdFamily::SD2},
                                          {"sdxl", SdFamily::SDXL},
                                          {"sdxl-refiner", SdFamily::SDXLRefiner},
                                          {"sd3", SdFamily::SD3}};
    return t;
}

SdFamily sd_family(const SdShapes& s) {
    if (s.joint_blocks) return SdFamily::SD3;
    if (s.added_conditioning) return s.text_width > 0 ? SdFamily::SDXL : SdFamily::SDXLRefiner;
    if (s.open_clip_text || s.text_width == 1024 || s.cross_attention_dim == 1024 || s.linear_projection)
        return SdFamily::SD2;
    return SdFamily::SD1;
}

SdShapes sd_shapes_of_single_file(const WeightMap& w) {
    SdShapes s;
    const std::string u = "model.diffusion_model.";
    for (const char* n : {"label_emb.0.0.weight", "add_embedding.linear_1.weight"})
        if (w.has(u + n)) s.added_conditioning = true, s.added_conditioning_tensor = u + n;
    if (w.has(u + "joint_blocks.0.x_block.attn.qkv.weight")) s.joint_blocks = true;
    for (const auto& [n, t] : w.all()) {
        if (n.rfind(u, 0) != 0) continue;
        const auto pos = n.find("attn2.to_k.weight");
        if (pos != std::string::npos && s.cross_attention_dim == 0) s.cross_attention_dim = t.size(1);
        if (n.find(".proj_in.weight") != std::string::npos && t.dim() == 2) s.linear_projection = true;
    }
    const std::string hf = "cond_stage_model.transformer.", oc = "cond_stage_model.model.";
    for (const std::string emb :
         {hf + "text_model.embeddings.token_embedding.weight", hf + "embeddings.token_embedding.weight",
          std::string("conditioner.embedders.0.transformer.text_model.embeddings.token_embedding.weight")})
        if (w.has(emb)) s.text_width = w.shape(emb)[1];
    if (w.has(oc + "token_embedding.weight")) {
        s.open_clip_text = true;
        s.text_width = w.shape(oc + "token_embedding.weight")[1];
    }
    if (w.has("conditioner.embedders.1.model.token_embedding.weight"))
        s.second_text_width = w.shape("conditioner.embedders.1.model.token_embedding.weight")[1];
    if (s.added_conditioning && s.text_width == 0 && s.second_text_width == 0 &&
        w.has("conditioner.embedders.0.model.token_embedding.weight")) // refiner: only the OpenCLIP bigG encoder
        s.second_text_width = w.shape("conditioner.embedders.0.model.token_embedding.weight")[1];
    return s;
}

std::vector<int> default_unet_heads(const std::vector<int>& block_out_channels, bool heads_of_64) {
    std::vector<int> h;
    for (int c : block_out_channels) h.push_back(heads_of_64 ? std::max(1, c / 64) : 8);
    return h;
}

} // namespace anchor::unet
