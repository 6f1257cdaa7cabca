// The original (CompVis/LDM) single-file layout of Stable Diffusion checkpoints and its diffusers names: every
// conversion between the two lives here (see unet/name_conversion.h).
#include "unet/name_conversion.h"

#include "cache/io/error.h"
#include "cache/io/weight_map.h"
#include "unet/sd_family.h"

#include <map>
#include <set>
#include <string>
#include <vector>

namespace anchor::unet {

namespace {

// Splits "a.b.c" at the first `n` dots: returns the first n parts and the rest.
std::vector<std::string> split(const std::string& s, char sep = '.') {
    std::vector<std::string> out;
    std::string cur;
    for (char c : s) {
        if (c == sep) {
            out.push_back(cur);
            cur.clear();
        } else {
            cur += c;
        }
    }
    out.push_back(cur);
    return out;
}

std::string join(const std::vector<std::string>& parts, size_t from, char sep = '.') {
    std::string out;
    for (size_t i = from; i < parts.size(); ++i) out += (i > from ? std::string(1, sep) : "") + parts[i];
    return out;
}

int to_int(const std::string& s, const std::string& name) {
    try {
        size_t pos = 0;
        int v = std::stoi(s, &pos);
        if (pos == s.size()) return v;
    } catch (...) {
    }
    throw Error("unexpected tensor name '" + name + "'");
}

std::string resnet_ldm(const std::string& rest, bool unet) {
    // diffusers ResnetBlock2D -> LDM ResBlock (UNet) / ResnetBlock (VAE)
    static const std::vector<std::pair<std::string, std::string>> unet_map = {
        {"norm1.", "in_layers.0."},  {"conv1.", "in_layers.2."},  {"time_emb_proj.", "emb_layers.1."},
        {"norm2.", "out_layers.0."}, {"conv2.", "out_layers.3."}, {"conv_shortcut.", "skip_connection."}};
    static const std::vector<std::pair<std::string, std::string>> vae_map = {{"conv_shortcut.", "nin_shortcut."}};
    for (const auto& [d, l] : unet ? unet_map : vae_map)
        if (rest.rfind(d, 0) == 0) return l + rest.substr(d.size());
    return rest;
}

// Index of the first input block of down block i (input_blocks.0 is conv_in) and of the first output block of up
// block i.
int input_block_start(const UNetConfig& c, int i) {
    int k = 1;
    for (int b = 0; b < i; ++b) k += c.layers_per_block[size_t(b)] + (b + 1 < c.num_levels() ? 1 : 0);
    return k;
}
int output_block_start(const UNetConfig& c, int i) {
    int k = 0;
    const int n = c.num_levels();
    for (int b = 0; b < i; ++b) k += c.layers_per_block[size_t(n - 1 - b)] + 1;
    return k;
}

} // namespace

std::string unet_ldm_name(const std::string& name, const UNetConfig& c) {
    auto p = split(name);
    auto fail = [&]() -> std::string { throw Error("no original-layout name for UNet tensor '" + name + "'"); };
    const std::string last = p.back();
    if (p[0] == "conv_in") return "input_blocks.0.0." + join(p, 1);
    if (p[0] == "conv_norm_out") return "out.0." + join(p, 1);
    if (p[0] == "conv_out") return "out.2." + join(p, 1);
    if (p[0] == "time_embedding" && p.size() >= 3) {
        if (p[1] == "linear_1") return "time_embed.0." + join(p, 2);
        if (p[1] == "linear_2") return "time_embed.2." + join(p, 2);
        return fail();
    }
    if (p[0] == "mid_block" && p.size() >= 4) {
        const int j = to_int(p[2], name);
        if (p[1] == "resnets")
            return "middle_block." + std::to_string(j == 0 ? 0 : 2) + "." + resnet_ldm(join(p, 3), true);
        if (p[1] == "attentions") return "middle_block.1." + join(p, 3);
        return fail();
    }
    if ((p[0] == "down_blocks" || p[0] == "up_blocks") && p.size() >= 5) {
        const int i = to_int(p[1], name), j = to_int(p[3], name);
        if (p[0] == "down_blocks") {
            const int start = input_block_start(c, i);
            if (p[2] == "resnets")
                return "input_blocks." + std::to_string(start + j) + ".0." + resnet_ldm(join(p, 4), true);
            if (p[2] == "attentions") return "input_blocks." + std::to_string(start + j) + ".1." + join(p, 4);
            if (p[2] == "downsamplers" && p[4] == "conv")
                return "input_blocks." + std::to_string(start + c.layers_per_block[size_t(i)]) + ".0.op." + join(p, 5);
            return fail();
        }
        const int start = output_block_start(c, i);
        if (p[2] == "resnets")
            return "output_blocks." + std::to_string(start + j) + ".0." + resnet_ldm(join(p, 4), true);
        if (p[2] == "attentions") return "output_blocks." + std::to_string(start + j) + ".1." + join(p, 4);
        if (p[2] == "upsamplers" && p[4] == "conv") {
            const int n = c.num_levels();
            const int layers = c.layers_per_block[size_t(n - 1 - i)] + 1;
            const bool attn = c.up_block_types[size_t(i)] == "CrossAttnUpBlock2D";
            return "output_blocks." + std::to_string(start + layers - 1) + "." + (attn ? "2" : "1") + ".conv." +
                   join(p, 5);
        }
        return fail();
    }
    (void)last;
    return fail();
}

std::string vae_ldm_name(const std::string& name, const VaeConfig& c) {
    auto p = split(name);
    auto fail = [&]() -> std::string { throw Error("no original-layout name for VAE tensor '" + name + "'"); };
    if (p[0] == "quant_conv" || p[0] == "post_quant_conv") return name;
    if ((p[0] != "encoder" && p[0] != "decoder") || p.size() < 3) return fail();
    const std::string& part = p[0];
    if (p[1] == "conv_in" || p[1] == "conv_out") return name;
    if (p[1] == "conv_norm_out") return part + ".norm_out." + join(p, 2);
    if (p[1] == "mid_block" && p.size() >= 5) {
        const int j = to_int(p[3], name);
        if (p[2] == "resnets")
            return part + ".mid.block_" + std::to_string(j + 1) + "." + resnet_ldm(join(p, 4), false);
        if (p[2] == "attentions") {
            static const std::map<std::string, std::string> attn = {
                {"group_norm", "norm"}, {"to_q", "q"}, {"to_k", "k"}, {"to_v", "v"}};
            if (attn.count(p[4])) return part + ".mid.attn_1." + attn.at(p[4]) + "." + join(p, 5);
            if (p[4] == "to_out" && p.size() >= 7 && p[5] == "0") return part + ".mid.attn_1.proj_out." + join(p, 6);
        }
        return fail();
    }
    if ((p[1] == "down_blocks" || p[1] == "up_blocks") && p.size() >= 6) {
        int i = to_int(p[2], name);
        const std::string level = part == "encoder" ? "down" : "up";
        if (part == "decoder") i = int(c.block_out_channels.size()) - 1 - i; // LDM numbers decoder levels reversed
        const std::string pre = part + "." + level + "." + std::to_string(i) + ".";
        if (p[3] == "resnets") return pre + "block." + p[4] + "." + resnet_ldm(join(p, 5), false);
        if ((p[3] == "downsamplers" || p[3] == "upsamplers") && p[5] == "conv")
            return pre + (part == "encoder" ? "downsample.conv." : "upsample.conv.") + join(p, 6);
    }
    return fail();
}

// Builds a diffusers-named map for `module` from the original-layout names in `file`, recording problems.
WeightMap gather(const WeightMap& file, torch::nn::Module& module,
                 const std::function<std::string(const std::string&)>& to_ldm, const std::string& prefix,
                 const std::string& what, std::vector<std::string>& missing, std::set<std::string>& used) {
    WeightMap out;
    for (const auto& p : module.named_parameters(true)) {
        const std::string ln = prefix + to_ldm(p.key());
        if (!file.has(ln)) {
            missing.push_back(what + " " + p.key() + " (expected '" + ln + "' " + shape_str(p.value().sizes().vec()) +
                              ")");
            continue;
        }
        auto t = file.get(ln);
        // VAE mid-block attention q/k/v/proj_out: [C,C,1,1] convolutions in LDM, [C,C] linear in diffusers.
        if (p.value().dim() == 2 && t.dim() == 4 && t.size(2) == 1 && t.size(3) == 1) t = t.flatten(1);
        out.insert(p.key(), t, file.source(ln));
        used.insert(ln);
    }
    return out;
}

// Open CLIP (SD 2.x `cond_stage_model.model.*`) -> HF CLIPTextModel names, q/k/v split out of in_proj. LDM's
// FrozenOpenCLIPEmbedder uses the penultimate layer, so the last resblock is dropped (as diffusers does).
WeightMap convert_open_clip(const WeightMap& file, const std::string& pre, std::set<std::string>& used) {
    WeightMap out;
    auto take = [&](const std::string& from, const std::string& to) {
        if (!file.has(pre + from)) return;
        out.insert(to, file.get(pre + from), file.source(pre + from));
        used.insert(pre + from);
    };
    take("token_embedding.weight", "text_model.embeddings.token_embedding.weight");
    take("positional_embedding", "text_model.embeddings.position_embedding.weight");
    take("ln_final.weight", "text_model.final_layer_norm.weight");
    take("ln_final.bias", "text_model.final_layer_norm.bias");
    int layers = 0;
    while (file.has(pre + "transformer.resblocks." + std::to_string(layers) + ".ln_1.weight")) ++layers;
    for (int i = 0; i < layers; ++i) {
        const std::string r = "transformer.resblocks." + std::to_string(i) + "."; // relative to `pre`
        const std::string h = "text_model.encoder.layers." + std::to_string(i) + ".";
        if (i == layers - 1) { // the last resblock is not used (penultimate-layer conditioning)
            for (const auto& [n, t] : file.all())
                if (n.rfind(pre + r, 0) == 0) used.insert(n);
            break;
        }
        take(r + "ln_1.weight", h + "layer_norm1.weight");
        take(r + "ln_1.bias", h + "layer_norm1.bias");
        take(r + "ln_2.weight", h + "layer_norm2.weight");
        take(r + "ln_2.bias", h + "layer_norm2.bias");
        take(r + "mlp.c_fc.weight", h + "mlp.fc1.weight");
        take(r + "mlp.c_fc.bias", h + "mlp.fc1.bias");
        take(r + "mlp.c_proj.weight", h + "mlp.fc2.weight");
        take(r + "mlp.c_proj.bias", h + "mlp.fc2.bias");
        take(r + "attn.out_proj.weight", h + "self_attn.out_proj.weight");
        take(r + "attn.out_proj.bias", h + "self_attn.out_proj.bias");
        for (const char* kind : {"weight", "bias"}) {
            const std::string n = pre + r + "attn.in_proj_" + kind;
            if (!file.has(n)) continue;
            auto qkv = file.get(n).chunk(3, 0);
            const char* names[3] = {"q_proj", "k_proj", "v_proj"};
            for (int k = 0; k < 3; ++k)
                out.insert(h + "self_attn." + names[k] + "." + kind, qkv[size_t(k)], file.source(n));
            used.insert(n);
        }
    }
    // Not part of the text encoder SD uses: projection head and logit scale.
    for (const char* n : {"text_projection", "logit_scale", "attn_mask"})
        if (file.has(pre + n)) used.insert(pre + n);
    return out;
}

std::string ldm_name(Component component, const std::string& name, const UNetConfig& unet, const VaeConfig& vae) {
    switch (component) {
    case Component::Unet:
        return "model.diffusion_model." + unet_ldm_name(name, unet);
    case Component::Vae:
        return "first_stage_model." + vae_ldm_name(name, vae);
    case Component::TextEncoder:
        return "cond_stage_model.transformer." + name;
    }
    throw Error("unknown component");
}

UNetConfig detect_ldm_unet_config(const WeightMap& w) {
    UNetConfig c;
    if (!w.has("input_blocks.0.0.weight") || !w.has("out.2.weight"))
        throw Error("UNet weights lack input_blocks.0.0.weight / out.2.weight");
    c = UNetConfig::blank(int(w.shape("input_blocks.0.0.weight")[1]), int(w.shape("out.2.weight")[0]));
    int cross = -1;
    bool linear = false;
    int layers = 0, ch = 0, depth = 1;
    bool attn = false;
    auto close = [&]() {
        c.block_out_channels.push_back(ch);
        c.layers_per_block.push_back(layers);
        c.down_block_types.push_back(attn ? "CrossAttnDownBlock2D" : "DownBlock2D");
        c.transformer_layers_per_block.push_back(attn ? depth : 1);
        layers = 0;
        attn = false;
        depth = 1;
    };
    for (int k = 1;; ++k) {
        const std::string p = "input_blocks." + std::to_string(k) + ".";
        if (w.has(p + "0.op.weight")) {
            close();
            continue;
        }
        if (!w.has(p + "0.in_layers.0.weight")) break;
        ch = int(w.shape(p + "0.out_layers.3.weight")[0]);
        ++layers;
        if (w.has(p + "1.norm.weight")) {
            attn = true;
            depth = 0;
            while (w.has(p + "1.transformer_blocks." + std::to_string(depth) + ".norm1.weight")) ++depth;
            cross = int(w.shape(p + "1.transformer_blocks.0.attn2.to_k.weight")[1]);
            linear = w.shape(p + "1.proj_in.weight").size() == 2;
        }
    }
    if (layers > 0) close();
    const int n = int(c.block_out_channels.size());
    if (n == 0) throw Error("UNet weights have no input_blocks.1 tensors");
    for (int i = 0; i < n; ++i) {
        const int start = output_block_start(c, i);
        c.up_block_types.push_back(
            w.has("output_blocks." + std::to_string(start) + ".1.norm.weight") ? "CrossAttnUpBlock2D" : "UpBlock2D");
    }
    c.finish_detection(w, "middle_block.1.transformer_blocks.0.attn2.to_k.weight", "middle_block.0.in_layers.0.weight",
                       cross, linear);
    return c;
}

VaeConfig detect_ldm_vae_config(const WeightMap& w) {
    return detect_vae_config(w, "encoder.down.", ".block.");
}

} // namespace anchor::unet
