// SD 3 / 3.5 names in name_conversion.h: diffusers' SD3Transformer2DModel tensor -> its place in Stability's
// single-file MMDiT (the table sd3_transformer_weights_from_single_file applies in the other direction; a unit test
// checks that the two agree on every tensor of a model with MMDiT-X blocks and QK norm).
#include "cache/io/error.h"
#include "unet/model/name_conversion.h"

#include <map>

namespace anchor::unet {

std::string Sd3Source::describe() const {
    if (row_begin >= 0) return name + "[" + std::to_string(row_begin) + ":" + std::to_string(row_end) + "]";
    return swap_halves ? name + " (halves swapped)" : name;
}

Sd3Source sd3_source(const std::string& diffusers_name, int64_t width, int num_layers) {
    auto fail = [&]() -> Sd3Source {
        throw Error("SD 3 name conversion: no original-layout name for '" + diffusers_name + "'");
    };
    if (diffusers_name == "pos_embed.pos_embed") return {"pos_embed"};
    const auto dot = diffusers_name.rfind('.');
    if (dot == std::string::npos) return fail();
    const std::string stem = diffusers_name.substr(0, dot), sfx = diffusers_name.substr(dot);
    if (sfx != ".weight" && sfx != ".bias") return fail();
    // The layers outside the blocks.
    static const std::map<std::string, std::string> outer = {
        {"pos_embed.proj", "x_embedder.proj"},
        {"time_text_embed.timestep_embedder.linear_1", "t_embedder.mlp.0"},
        {"time_text_embed.timestep_embedder.linear_2", "t_embedder.mlp.2"},
        {"time_text_embed.text_embedder.linear_1", "y_embedder.mlp.0"},
        {"time_text_embed.text_embedder.linear_2", "y_embedder.mlp.2"},
        {"context_embedder", "context_embedder"},
        {"proj_out", "final_layer.linear"}};
    if (const auto it = outer.find(stem); it != outer.end()) return {it->second + sfx};
    // AdaLayerNormContinuous reads (scale, shift); the original final layer stores (shift, scale).
    if (stem == "norm_out.linear") return {"final_layer.adaLN_modulation.1" + sfx, -1, -1, true};
    const std::string blocks = "transformer_blocks.";
    if (stem.rfind(blocks, 0) != 0) return fail();
    const auto idot = stem.find('.', blocks.size());
    if (idot == std::string::npos) return fail();
    const std::string index = stem.substr(blocks.size(), idot - blocks.size());
    if (index.empty() || index.find_first_not_of("0123456789") != std::string::npos) return fail();
    const int block = std::stoi(index);
    const std::string rest = stem.substr(idot + 1);
    const std::string o = "joint_blocks." + index + ".", c = o + "context_block.";
    // Fused qkv: q, k, v are consecutive row ranges of the model width.
    static const std::map<std::string, std::pair<std::string, int>> fused = {
        {"attn.to_q", {"x_block.attn.qkv", 0}},          {"attn.to_k", {"x_block.attn.qkv", 1}},
        {"attn.to_v", {"x_block.attn.qkv", 2}},          {"attn.add_q_proj", {"context_block.attn.qkv", 0}},
        {"attn.add_k_proj", {"context_block.attn.qkv", 1}}, {"attn.add_v_proj", {"context_block.attn.qkv", 2}},
        {"attn2.to_q", {"x_block.attn2.qkv", 0}},        {"attn2.to_k", {"x_block.attn2.qkv", 1}},
        {"attn2.to_v", {"x_block.attn2.qkv", 2}}};
    if (const auto it = fused.find(rest); it != fused.end())
        return {o + it->second.first + sfx, it->second.second * width, (it->second.second + 1) * width};
    static const std::map<std::string, std::string> same = {
        {"attn.norm_q", "x_block.attn.ln_q"},
        {"attn.norm_k", "x_block.attn.ln_k"},
        {"attn.norm_added_q", "context_block.attn.ln_q"},
        {"attn.norm_added_k", "context_block.attn.ln_k"},
        {"attn.to_out.0", "x_block.attn.proj"},
        {"attn.to_add_out", "context_block.attn.proj"},
        {"attn2.norm_q", "x_block.attn2.ln_q"},
        {"attn2.norm_k", "x_block.attn2.ln_k"},
        {"attn2.to_out.0", "x_block.attn2.proj"},
        {"norm1.linear", "x_block.adaLN_modulation.1"},
        {"ff.net.0.proj", "x_block.mlp.fc1"},
        {"ff.net.2", "x_block.mlp.fc2"},
        {"ff_context.net.0.proj", "context_block.mlp.fc1"},
        {"ff_context.net.2", "context_block.mlp.fc2"}};
    if (const auto it = same.find(rest); it != same.end()) return {o + it->second + sfx};
    // The last block's context stream keeps no tokens (context_pre_only): its modulation is an
    // AdaLayerNormContinuous, (scale, shift) in diffusers, (shift, scale) in the original.
    if (rest == "norm1_context.linear")
        return {c + "adaLN_modulation.1" + sfx, -1, -1, block == num_layers - 1};
    return fail();
}

} // namespace anchor::unet
