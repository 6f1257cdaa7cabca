// SD checkpoint loading. The single-file layout is the one of CompVis/LDM (ldm.modules.diffusionmodules.openaimodel
// UNetModel, ldm.modules.diffusionmodules.model Encoder/Decoder) as written by diffusers'
// scripts/convert_diffusers_to_original_stable_diffusion.py; see tests/golden/sd/sd15_tiny_single_file/README.md.
#include "unet/checkpoint.h"

#include "cache/io/error.h"
#include "cache/io/json_file.h"
#include "cache/io/model_source.h"
#include "cache/io/weight_map.h"

#include <filesystem>
#include <functional>
#include <regex>
#include <set>
#include <sstream>

namespace anchor::unet {

namespace fs = std::filesystem;

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

bool has_prefix(const WeightMap& w, const std::string& prefix) {
    for (const auto& [n, t] : w.all())
        if (n.rfind(prefix, 0) == 0) return true;
    return false;
}

std::string list(const std::vector<std::string>& v) {
    std::string s;
    for (const auto& x : v) s += "\n  " + x;
    return s;
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

template <typename M> M finish(M m, torch::ScalarType dtype) {
    m->eval();
    if (dtype != torch::kFloat) m->to(dtype);
    return m;
}

ClipTokenizer tokenizer_for(const std::string& folder, bool sd2) {
    if (!folder.empty() && fs::exists(fs::path(folder) / "vocab.json")) return ClipTokenizer::from_folder(folder);
    ClipTokenizer t = ClipTokenizer::bundled();
    if (sd2) t.set_pad_id(0); // SD 2.x (OpenCLIP) pads with 0 ("!")
    return t;
}

} // namespace

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
    c.in_channels = int(w.shape("input_blocks.0.0.weight")[1]);
    c.out_channels = int(w.shape("out.2.weight")[0]);
    c.block_out_channels.clear();
    c.down_block_types.clear();
    c.up_block_types.clear();
    c.layers_per_block.clear();
    c.transformer_layers_per_block.clear();
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
    if (cross < 0 && w.has("middle_block.1.transformer_blocks.0.attn2.to_k.weight"))
        cross = int(w.shape("middle_block.1.transformer_blocks.0.attn2.to_k.weight")[1]);
    if (cross > 0) c.cross_attention_dim = cross;
    c.use_linear_projection = linear;
    c.mid_block = w.has("middle_block.0.in_layers.0.weight");
    c.heads = default_unet_heads(c.block_out_channels, linear || cross == 1024);
    return c;
}

VaeConfig detect_ldm_vae_config(const WeightMap& w) {
    return detect_vae_config(w, "encoder.down.", ".block.");
}

namespace {
// A component folder: its weights and its config.json (or the config its shapes give).
template <typename Model, typename Config> Model load_component(const ModelSource& src, torch::ScalarType dtype) {
    auto w = src.load_weights();
    Config cfg = src.config_file.empty() ? Config::detect_from_weights(w) : Config::from_json_file(src.config_file);
    Model m(cfg);
    m->load(w);
    return finish(m, dtype);
}
ModelSource component_source(const std::string& dir) {
    if (!fs::is_directory(dir)) throw Error("model folder '" + dir + "' does not exist");
    return resolve_model(dir, {nullptr, "model component"});
}
} // namespace

UNet2DConditionModel load_unet_folder(const std::string& dir, torch::ScalarType dtype) {
    return load_component<UNet2DConditionModel, UNetConfig>(component_source(dir), dtype);
}

AutoencoderKL load_vae_folder(const std::string& dir, torch::ScalarType dtype) {
    return load_component<AutoencoderKL, VaeConfig>(component_source(dir), dtype);
}

ClipTextModel load_text_encoder_folder(const std::string& dir, torch::ScalarType dtype) {
    return load_component<ClipTextModel, ClipTextConfig>(component_source(dir), dtype);
}

namespace {

SDModels load_diffusers(const ModelSource& src, const LoadOptions& o) {
    SDModels m;
    m.layout = "diffusers";
    const fs::path root(src.path);
    for (const char* sub : {"unet", "vae", "text_encoder"}) (void)src.component(sub);
    if (o.text_encoder)
        m.text_encoder = load_component<ClipTextModel, ClipTextConfig>(src.component("text_encoder"), o.dtype);
    if (o.unet) m.unet = load_component<UNet2DConditionModel, UNetConfig>(src.component("unet"), o.dtype);
    if (o.vae) m.vae = load_component<AutoencoderKL, VaeConfig>(src.component("vae"), o.dtype);
    SdShapes shapes;
    if (m.text_encoder) shapes.text_width = m.text_encoder->config().hidden_size;
    if (m.unet) {
        shapes.cross_attention_dim = m.unet->config().cross_attention_dim;
        shapes.linear_projection = m.unet->config().use_linear_projection;
    }
    m.family = sd_family(shapes);
    const bool sd2 = m.family == SdFamily::SD2;
    m.tokenizer = tokenizer_for((root / "tokenizer").string(), sd2);
    m.scheduler_config_path = src.file("scheduler_config");
    return m;
}

SDModels load_single_file(const ModelSource& src, const LoadOptions& o) {
    SDModels m;
    m.layout = "single-file";
    const std::string& path = src.path;
    auto file = src.load_weights();
    std::vector<std::string> missing;
    std::set<std::string> used;
    const std::string up = "model.diffusion_model.", vp = "first_stage_model.";
    if (!has_prefix(file, up) || !has_prefix(file, vp))
        throw Error("'" + path + "' is not a Stable Diffusion checkpoint: no '" + up + "*' / '" + vp + "*' tensors");
    const SdShapes shapes = sd_shapes_of_single_file(file);
    m.family = sd_family(shapes);
    if (m.family == SdFamily::SDXL || m.family == SdFamily::SDXLRefiner)
        throw Error("'" + path + "' is an " + enum_name(sd_family_table(), m.family) + " checkpoint (tensor '" +
                    shapes.added_conditioning_tensor +
                    "': text/time added conditioning), which this build cannot "
                    "load yet");
    UNetConfig ucfg = detect_ldm_unet_config(file.with_prefix_stripped(up));
    VaeConfig vcfg = detect_ldm_vae_config(file.with_prefix_stripped(vp));
    WeightMap uw, vw, tw;
    if (o.unet) {
        m.unet = UNet2DConditionModel(ucfg);
        uw = gather(
            file, *m.unet, [&](const std::string& n) { return unet_ldm_name(n, ucfg); }, up, "unet", missing, used);
    } else {
        for (const auto& [n, t] : file.all())
            if (n.rfind(up, 0) == 0) used.insert(n);
    }
    if (o.vae) {
        m.vae = AutoencoderKL(vcfg);
        vw = gather(
            file, *m.vae, [&](const std::string& n) { return vae_ldm_name(n, vcfg); }, vp, "vae", missing, used);
    } else {
        for (const auto& [n, t] : file.all())
            if (n.rfind(vp, 0) == 0) used.insert(n);
    }
    const std::string sd1_text = "cond_stage_model.transformer.", sd2_text = "cond_stage_model.model.";
    if (has_prefix(file, sd2_text)) {
        auto converted = convert_open_clip(file, sd2_text, used);
        if (o.text_encoder) {
            auto tcfg = ClipTextConfig::detect_from_weights(converted);
            tcfg.hidden_act = "gelu";
            m.text_encoder = ClipTextModel(tcfg);
            tw = converted;
        }
    } else if (has_prefix(file, sd1_text)) {
        // Older checkpoints store the HF text model without the `text_model.` level.
        const bool nested = has_prefix(file, sd1_text + "text_model.");
        auto text = file.with_prefix_stripped(sd1_text);
        if (!nested) text = text.renamed([](const std::string& n) { return "text_model." + n; });
        for (const auto& [n, t] : file.all())
            if (n.rfind(sd1_text, 0) == 0) used.insert(n);
        if (o.text_encoder) {
            m.text_encoder = ClipTextModel(ClipTextConfig::detect_from_weights(text));
            tw = text;
        }
    } else if (o.text_encoder) {
        missing.push_back("text encoder: no 'cond_stage_model.transformer.*' (SD 1.x) or 'cond_stage_model.model.*' "
                          "(SD 2.x) tensors");
    }
    // Tensors of the three prefixes that nothing consumed are reported (other top-level entries such as
    // model_ema.*, betas or alphas_cumprod belong to training and are ignored).
    std::vector<std::string> unexpected;
    for (const auto& [n, t] : file.all()) {
        const bool ours = n.rfind(up, 0) == 0 || n.rfind(vp, 0) == 0 || n.rfind("cond_stage_model.", 0) == 0;
        if (ours && !used.count(n)) unexpected.push_back(n);
    }
    if (!missing.empty() || !unexpected.empty()) {
        std::string msg = "'" + path + "' does not fit the Stable Diffusion layout detected from its shapes (" +
                          ucfg.describe() + "):";
        if (!missing.empty()) msg += "\n" + std::to_string(missing.size()) + " missing tensor(s):" + list(missing);
        if (!unexpected.empty())
            msg += "\n" + std::to_string(unexpected.size()) + " unexpected tensor(s):" + list(unexpected);
        throw Error(msg);
    }
    if (m.unet) {
        m.unet->load(uw);
        m.unet = finish(m.unet, o.dtype);
    }
    if (m.vae) {
        m.vae->load(vw);
        m.vae = finish(m.vae, o.dtype);
    }
    if (m.text_encoder) {
        m.text_encoder->load(tw);
        m.text_encoder = finish(m.text_encoder, o.dtype);
    }
    m.tokenizer = tokenizer_for("", m.family == SdFamily::SD2);
    return m;
}

} // namespace

SDModels load_sd_models(const std::string& path, const LoadOptions& opts) {
    fs::path p(path);
    // A folder holding exactly one single-file checkpoint is that checkpoint.
    std::string target = path;
    if (fs::is_directory(p) && !fs::exists(p / "model_index.json") && !fs::is_directory(p / "unet")) {
        std::vector<fs::path> files;
        for (const auto& e : fs::directory_iterator(p))
            if (e.path().extension() == ".safetensors") files.push_back(e.path());
        if (files.size() != 1)
            throw Error("'" + path +
                        "' is neither a diffusers folder (model_index.json, unet/, vae/, "
                        "text_encoder/) nor a folder with exactly one single-file checkpoint");
        target = files[0].string();
    }
    const ModelSource src = resolve_model(target, {nullptr, "Stable Diffusion model"});
    SDModels m = src.layout == ModelLayout::DiffusersPipeline ? load_diffusers(src, opts) : load_single_file(src, opts);
    m.source = path;
    m.attention = opts.attention ? *opts.attention
                                 : (fs::is_directory(p) ? read_model_hints(path).attention : std::nullopt)
                                       .value_or(kernels::AttentionKernel::Exact);
    if (m.unet) m.unet->set_attention_kernel(m.attention);
    if (m.vae) m.vae->set_attention_kernel(m.attention);
    return m;
}

ModelHints read_model_hints(const std::string& dir) {
    const fs::path f = fs::path(dir) / "anchorcache.json";
    if (!fs::exists(f)) return {};
    return read_json_config(f.string(), "model hints", [](const nlohmann::json& j) {
        ModelHints h;
        for (const auto& [key, value] : j.items()) {
            if (key == "attention") {
                const std::string name = value.get<std::string>();
                for (const auto& [n, k] : kernels::attention_kernel_table())
                    if (n == name) h.attention = k;
                if (!h.attention)
                    throw Error("\"attention\" is '" + name +
                                "' (choices: " + enum_choices(kernels::attention_kernel_table()) + ")");
            } else if (key != "why") {
                throw Error("unknown field \"" + key + "\" (known: attention, why)");
            }
        }
        return h;
    });
}

} // namespace anchor::unet
