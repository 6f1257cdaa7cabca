// The original (CompVis/LDM) single-file layout of Stable Diffusion checkpoints and its diffusers names: every
// conversion between the two lives here (see unet/model/name_conversion.h).
#include "unet/model/name_conversion.h"

#include "cache/io/error.h"
#include "cache/io/weight_map.h"
#include "unet/model/sd_family.h"

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
    if ((p[0] == "time_embedding" || p[0] == "add_embedding") && p.size() >= 3) {
        // SGM's label_emb is a Sequential(Sequential(Linear, SiLU, Linear)): SDXL's add_embedding.
        const std::string to = p[0] == "time_embedding" ? "time_embed." : "label_emb.0.";
        if (p[1] == "linear_1") return to + "0." + join(p, 2);
        if (p[1] == "linear_2") return to + "2." + join(p, 2);
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
    out.keep_files_of(file);
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

OpenClipSource open_clip_source(const std::string& hf, int64_t hidden) {
    static const std::map<std::string, std::string> top = {
        {"text_model.embeddings.token_embedding.weight", "token_embedding.weight"},
        {"text_model.embeddings.position_embedding.weight", "positional_embedding"},
        {"text_model.final_layer_norm.weight", "ln_final.weight"},
        {"text_model.final_layer_norm.bias", "ln_final.bias"}};
    if (auto it = top.find(hf); it != top.end()) return {it->second};
    if (hf == "text_projection.weight") return {"text_projection", -1, -1, true};
    static const std::map<std::string, std::string> layer = {{"layer_norm1", "ln_1"},
                                                             {"layer_norm2", "ln_2"},
                                                             {"mlp.fc1", "mlp.c_fc"},
                                                             {"mlp.fc2", "mlp.c_proj"},
                                                             {"self_attn.out_proj", "attn.out_proj"}};
    const std::string pre = "text_model.encoder.layers.";
    auto p = split(hf);
    if (hf.rfind(pre, 0) == 0 && p.size() >= 6) {
        const std::string r = "transformer.resblocks." + std::to_string(to_int(p[3], hf)) + ".";
        const std::string module = join(std::vector<std::string>(p.begin() + 4, p.end() - 1), 0), kind = p.back();
        if (auto it = layer.find(module); it != layer.end()) return {r + it->second + "." + kind};
        static const std::map<std::string, int> qkv = {
            {"self_attn.q_proj", 0}, {"self_attn.k_proj", 1}, {"self_attn.v_proj", 2}};
        if (auto it = qkv.find(module); it != qkv.end())
            return {r + "attn.in_proj_" + kind, it->second * hidden, (it->second + 1) * hidden};
    }
    throw Error("no OpenCLIP name for text encoder tensor '" + hf + "'");
}

std::string OpenClipSource::describe() const {
    if (row_begin >= 0) return name + "[" + std::to_string(row_begin) + ":" + std::to_string(row_end) + "]";
    return transposed ? name + " (transposed)" : name;
}

WeightMap convert_open_clip(const WeightMap& file, const std::string& pre, std::set<std::string>& used,
                            const OpenClipOptions& o) {
    WeightMap out;
    if (!file.has(pre + "token_embedding.weight")) return out;
    const int64_t hidden = file.shape(pre + "token_embedding.weight")[1];
    auto take = [&](const std::string& hf) {
        const OpenClipSource src = open_clip_source(hf, hidden);
        if (!file.has(pre + src.name)) return;
        auto t = file.get(pre + src.name);
        if (src.row_begin >= 0) t = t.narrow(0, src.row_begin, src.row_end - src.row_begin);
        if (src.transposed) t = t.t().contiguous();
        out.insert(hf, t, file.source(pre + src.name));
        used.insert(pre + src.name);
    };
    for (const char* n :
         {"text_model.embeddings.token_embedding.weight", "text_model.embeddings.position_embedding.weight",
          "text_model.final_layer_norm.weight", "text_model.final_layer_norm.bias"})
        take(n);
    int layers = 0;
    while (file.has(pre + "transformer.resblocks." + std::to_string(layers) + ".ln_1.weight")) ++layers;
    for (int i = 0; i < layers; ++i) {
        if (i == layers - 1 && o.drop_last_layer) { // not used by penultimate-layer conditioning
            for (const auto& [n, t] : file.all())
                if (n.rfind(pre + "transformer.resblocks." + std::to_string(i) + ".", 0) == 0) used.insert(n);
            break;
        }
        const std::string h = "text_model.encoder.layers." + std::to_string(i) + ".";
        for (const char* m : {"layer_norm1", "layer_norm2", "mlp.fc1", "mlp.fc2", "self_attn.out_proj",
                              "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"})
            for (const char* kind : {"weight", "bias"}) take(h + m + "." + kind);
    }
    if (o.projection) take("text_projection.weight");
    // Not part of the text conditioning: the contrastive head's scale, the stored causal mask (and for SD 2.x the
    // projection).
    for (const char* n : {"text_projection", "logit_scale", "attn_mask"})
        if (file.has(pre + n)) used.insert(pre + n);
    return out;
}

std::string ldm_name(Component component, const std::string& name, const UNetConfig& unet, const VaeConfig& vae,
                     SdFamily family) {
    switch (component) {
    case Component::Unet:
        return "model.diffusion_model." + unet_ldm_name(name, unet);
    case Component::Vae:
        return "first_stage_model." + vae_ldm_name(name, vae);
    case Component::TextEncoder:
        return (family == SdFamily::SDXL ? "conditioner.embedders.0.transformer." : "cond_stage_model.transformer.") +
               name;
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
