// ControlNetModel with diffusers 0.27.2 semantics (models/controlnet.py; see docs/controlnet.md).
#include "unet/model/controlnet.h"
#include "unet/model/layers.h"

#include "cache/io/deferred_weights.h"
#include "cache/io/error.h"
#include "cache/io/json_config.h"
#include "cache/io/model_source.h"
#include "cache/io/weight_map.h"
#include "unet/model/name_conversion.h"
#include "unet/model/unet_perf.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <set>
#include <sstream>

namespace anchor::unet {

using torch::Tensor;

namespace {

// The UNet config of a ControlNet config.json: its blocks are a UNet's down half, so the up block types (which a
// ControlNet config lacks and nothing builds) are the mirror of the down ones, for UNetConfig's checks.
nlohmann::json as_unet_json(nlohmann::json j) {
    if (!j.contains("up_block_types") && j.contains("down_block_types") && j["down_block_types"].is_array()) {
        auto ups = nlohmann::json::array();
        for (auto it = j["down_block_types"].rbegin(); it != j["down_block_types"].rend(); ++it)
            ups.push_back(it->is_string() && it->get<std::string>() == "CrossAttnDownBlock2D" ? "CrossAttnUpBlock2D"
                                                                                              : "UpBlock2D");
        j["up_block_types"] = ups;
    }
    if (!j.contains("out_channels") && j.contains("in_channels")) j["out_channels"] = j["in_channels"];
    j.erase("_class_name");
    return j;
}

} // namespace

ControlNetConfig ControlNetConfig::from_json(const nlohmann::json& j, const std::string& source) {
    ControlNetConfig c;
    if (j.contains("_class_name") && j["_class_name"].is_string() &&
        j["_class_name"].get<std::string>() != "ControlNetModel")
        throw Error(source + ": _class_name '" + j["_class_name"].get<std::string>() + "' is not a ControlNetModel");
    c.unet = UNetConfig::from_json(as_unet_json(j), source);
    const JsonConfig f(j, source);
    c.conditioning_channels = f.get_int("conditioning_channels", 3);
    c.embedding_channels = f.get_int_list("conditioning_embedding_out_channels", c.embedding_channels);
    if (c.embedding_channels.empty())
        f.fail("conditioning_embedding_out_channels", "must not be empty", j.at("conditioning_embedding_out_channels"));
    const std::string order = f.get_string("controlnet_conditioning_channel_order", "rgb");
    if (order != "rgb" && order != "bgr")
        f.fail("controlnet_conditioning_channel_order", "must be 'rgb' or 'bgr'",
               j.at("controlnet_conditioning_channel_order"));
    c.bgr = order == "bgr";
    c.global_pool_conditions = f.get_bool("global_pool_conditions", false);
    return c;
}

ControlNetConfig ControlNetConfig::from_json_file(const std::string& path) {
    return from_json(JsonConfig::load(path, "ControlNet config").json(), path);
}

ControlNetConfig ControlNetConfig::detect_from_weights(const WeightMap& w) {
    const std::string ci = "controlnet_cond_embedding.conv_in.weight";
    if (!w.has(ci) || !w.has("conv_in.weight")) throw Error("ControlNet weights lack " + ci + " / conv_in.weight");
    // UNetConfig's detector reads conv_out for the output width, which an encoder does not have.
    WeightMap probe;
    for (const auto& [n, t] : w.all())
        if (n.rfind("down_blocks.", 0) == 0 || n.rfind("mid_block.", 0) == 0 || n == "conv_in.weight")
            probe.insert(n, torch::empty(t.sizes(), torch::kFloat), w.source(n));
    const auto in = w.shape("conv_in.weight");
    probe.insert("conv_out.weight", torch::empty({in[1], in[0], 3, 3}));
    ControlNetConfig c;
    c.unet = UNetConfig::detect_from_weights(probe);
    if (w.has("add_embedding.linear_1.weight")) {
        c.unet.projection_class_embeddings_input_dim = int(w.shape("add_embedding.linear_1.weight")[1]);
        c.unet.addition_time_embed_dim = 256; // SDXL's (diffusers' default for text_time)
    }
    c.conditioning_channels = int(w.shape(ci)[1]);
    c.embedding_channels = {int(w.shape(ci)[0])};
    for (int k = 1; w.has("controlnet_cond_embedding.blocks." + std::to_string(k) + ".weight"); k += 2)
        c.embedding_channels.push_back(
            int(w.shape("controlnet_cond_embedding.blocks." + std::to_string(k) + ".weight")[0]));
    return c;
}

ControlNetConditioningEmbeddingImpl::ControlNetConditioningEmbeddingImpl(int64_t cond_ch, const std::vector<int>& ch,
                                                                         int64_t out_ch) {
    conv_in = register_module("conv_in", conv3x3(cond_ch, ch[0]));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (size_t i = 0; i + 1 < ch.size(); ++i) {
        convs.push_back(conv3x3(ch[i], ch[i]));
        convs.push_back(conv3x3(ch[i], ch[i + 1], 2));
    }
    for (auto& c : convs) blocks->push_back(c);
    conv_out = register_module("conv_out", conv3x3(ch.back(), out_ch));
}

Tensor ControlNetConditioningEmbeddingImpl::forward(const Tensor& image) {
    auto h = torch::silu(perf::conv2d(conv_in, image, *this));
    for (auto& c : convs) h = torch::silu(perf::conv2d(c, h, *this));
    return perf::conv2d(conv_out, h, *this);
}

ControlNetModelImpl::ControlNetModelImpl(const ControlNetConfig& c)
    : UNet2DConditionModelImpl(c.unet, /*decoder=*/false), ccfg_(c) {
    const int64_t ch0 = c.unet.block_out_channels[0];
    controlnet_cond_embedding =
        register_module("controlnet_cond_embedding",
                        ControlNetConditioningEmbedding(c.conditioning_channels, c.embedding_channels, ch0));
    controlnet_down_blocks = register_module("controlnet_down_blocks", torch::nn::ModuleList());
    // One zero convolution per skip, in the skips' order (conv_in's output, each down layer, each downsampler).
    int64_t ch = ch0;
    auto add = [&](int64_t width) {
        zero_convs.push_back(make_conv2d(torch::nn::Conv2dOptions(width, width, 1)));
        controlnet_down_blocks->push_back(zero_convs.back());
    };
    add(ch);
    for (size_t i = 0; i < c.unet.block_out_channels.size(); ++i) {
        ch = c.unet.block_out_channels[i];
        for (int j = 0; j < c.unet.layers_per_block[i]; ++j) add(ch);
        if (i + 1 < c.unet.block_out_channels.size()) add(ch);
    }
    const int64_t mid = c.unet.block_out_channels.back();
    controlnet_mid_block = register_module("controlnet_mid_block", make_conv2d(torch::nn::Conv2dOptions(mid, mid, 1)));
}

SkipResiduals ControlNetModelImpl::residuals(const Tensor& sample, const Tensor& timestep, const UNetCond& cond,
                                             const Tensor& image, double scale, bool guess_mode, int skips, bool mid) {
    c10::InferenceMode guard(!is_training());
    const auto dtype = conv_in->bias.scalar_type();
    const int n = num_skips();
    skips = skips < 0 ? n : std::min(skips, n);
    if (image.dim() != 4 || image.size(0) != sample.size(0) || image.size(1) != ccfg_.conditioning_channels)
        throw Error("ControlNet: the control image batch has shape " + shape_str(image.sizes().vec()) + ", expected [" +
                    std::to_string(sample.size(0)) + ", " + std::to_string(ccfg_.conditioning_channels) + ", H, W]");
    auto img = image.to(sample.device(), dtype);
    if (ccfg_.bgr) img = img.flip({1});
    auto x = sample.to(dtype);
    auto hint = controlnet_cond_embedding->forward(img);
    auto stem = perf::conv2d(conv_in, x, *this);
    if (hint.sizes() != stem.sizes())
        throw Error("ControlNet: the control image " + shape_str(image.sizes().vec()) + " embeds to " +
                    shape_str(hint.sizes().vec()) + ", the latents to " + shape_str(stem.sizes().vec()) +
                    " (the control image must be the output image's size)");
    stem = stem + hint;
    UNetCond plain = cond;
    plain.control.reset(), plain.residuals = SkipResiduals();
    const Encoding e = encode(x, timestep, plain, stem, skips, mid);
    SkipResiduals r;
    // diffusers: logspace(-1, 0, len(down residuals) + 1) over ALL the skips, whatever part of them is computed.
    const bool pooled = ccfg_.global_pool_conditions;
    const Tensor scales = guess_mode && !pooled ? torch::logspace(-1, 0, n + 1) * scale : Tensor();
    auto scaled = [&](const Tensor& t, int k) {
        auto s = scales.defined() ? t * scales[k].to(t.device()) : t * scale;
        return pooled ? s.mean({2, 3}, /*keepdim=*/true) : s;
    };
    for (int k = 0; k < skips; ++k)
        r.down.push_back(scaled(perf::conv2d(zero_convs[size_t(k)], e.skips[size_t(k)], *this), k));
    if (mid) r.mid = scaled(perf::conv2d(controlnet_mid_block, e.mid, *this), n);
    return r;
}

std::string controlnet_mismatch(const ControlNetModelImpl& net, const UNetConfig& u) {
    const UNetConfig& c = net.control_config().unet;
    std::ostringstream os;
    auto diff = [&](const char* what, const std::string& unet, const std::string& cn) {
        if (unet != cn) os << (os.tellp() > 0 ? "; " : "") << what << " " << unet << " (the UNet's) vs " << cn;
    };
    auto list = [](const std::vector<int>& v) { return shape_str({v.begin(), v.end()}); };
    diff("block_out_channels", list(u.block_out_channels), list(c.block_out_channels));
    diff("layers_per_block", list(u.layers_per_block), list(c.layers_per_block));
    diff("cross_attention_dim", std::to_string(u.cross_attention_dim), std::to_string(c.cross_attention_dim));
    diff("in_channels", std::to_string(std::min(u.in_channels, 4)), std::to_string(c.in_channels));
    diff("added conditioning", u.text_time() ? "text_time (SDXL)" : "none",
         c.text_time() ? "text_time (SDXL)" : "none");
    diff("mid block", u.mid_block ? "yes" : "no", c.mid_block ? "yes" : "no");
    return os.str();
}

namespace {

// The original ControlNet layout (lllyasviel's cldm ControlNet: control_model.* in the released .pth files, the same
// names without the prefix in most .safetensors copies): the UNet encoder under LDM names (unet_ldm_name),
// input_hint_block.{0, 2, ..., 2m} = the conditioning embedding's conv_in, blocks, conv_out (SiLUs at the odd
// indices), zero_convs.k.0 = controlnet_down_blocks.k, middle_block_out.0 = controlnet_mid_block.
std::string controlnet_ldm_name(const std::string& n, const ControlNetConfig& c) {
    const std::string emb = "controlnet_cond_embedding.";
    if (n.rfind(emb, 0) == 0) {
        const std::string rest = n.substr(emb.size());
        const auto dot = rest.rfind('.');
        const std::string mod = rest.substr(0, dot), param = rest.substr(dot);
        int idx;
        if (mod == "conv_in")
            idx = 0;
        else if (mod == "conv_out")
            idx = 2 * int(2 * (c.embedding_channels.size() - 1) + 1);
        else
            idx = 2 * (std::stoi(mod.substr(mod.find('.') + 1)) + 1);
        return "input_hint_block." + std::to_string(idx) + param;
    }
    const std::string zc = "controlnet_down_blocks.";
    if (n.rfind(zc, 0) == 0) {
        const std::string rest = n.substr(zc.size());
        return "zero_convs." + rest.substr(0, rest.find('.')) + ".0" + rest.substr(rest.find('.'));
    }
    if (n.rfind("controlnet_mid_block.", 0) == 0) return "middle_block_out.0" + n.substr(n.find('.'));
    return unet_ldm_name(n, c.unet);
}

ControlNetModel load_original(const WeightMap& file, const std::string& prefix, const std::string& path) {
    WeightMap ldm = file.with_prefix_stripped(prefix);
    // detect_ldm_unet_config reads the output width from out.2, which an encoder does not have.
    WeightMap probe;
    for (const auto& [n, t] : ldm.all())
        if (n.rfind("input_blocks.", 0) == 0 || n.rfind("middle_block.", 0) == 0)
            probe.insert(n, torch::empty(t.sizes(), torch::kFloat), ldm.source(n));
    const auto in = ldm.shape("input_blocks.0.0.weight");
    probe.insert("out.2.weight", torch::empty({in[1], in[0], 3, 3}));
    ControlNetConfig c;
    c.unet = detect_ldm_unet_config(probe);
    if (ldm.has("label_emb.0.0.weight")) {
        c.unet.projection_class_embeddings_input_dim = int(ldm.shape("label_emb.0.0.weight")[1]);
        c.unet.addition_time_embed_dim = 256;
    }
    c.conditioning_channels = int(ldm.shape("input_hint_block.0.weight")[1]);
    c.embedding_channels = {int(ldm.shape("input_hint_block.0.weight")[0])};
    for (int k = 4; ldm.has("input_hint_block." + std::to_string(k) + ".weight") &&
                    ldm.has("input_hint_block." + std::to_string(k + 2) + ".weight");
         k += 4)
        c.embedding_channels.push_back(int(ldm.shape("input_hint_block." + std::to_string(k) + ".weight")[0]));
    ControlNetModel m(c);
    std::vector<std::string> missing;
    std::set<std::string> used;
    WeightMap w = gather(
        ldm, *m, [&](const std::string& n) { return controlnet_ldm_name(n, c); }, "", "ControlNet", missing, used);
    if (!missing.empty()) {
        std::string list;
        for (size_t i = 0; i < missing.size() && i < 8; ++i) list += (i ? ", " : "") + missing[i];
        throw Error("ControlNet '" + path + "': " + std::to_string(missing.size()) +
                    " tensors missing from the original layout: " + list + (missing.size() > 8 ? ", ..." : ""));
    }
    std::vector<std::string> unused;
    for (const auto& n : ldm.names())
        if (!used.count(n)) unused.push_back(n);
    if (!unused.empty())
        throw Error("ControlNet '" + path + "': " + std::to_string(unused.size()) + " tensors not understood, e.g. " +
                    prefix + unused.front());
    m->load(w);
    return m;
}

} // namespace

ControlNetModel load_controlnet(const std::string& path, torch::ScalarType dtype) {
    const DeferredWeights deferred;
    const ModelSource src = resolve_model(path, {nullptr, "ControlNet"});
    const WeightMap w = src.load_weights();
    ControlNetModel m{nullptr};
    if (w.has("control_model.input_hint_block.0.weight")) {
        m = load_original(w, "control_model.", path);
    } else if (w.has("input_hint_block.0.weight")) {
        m = load_original(w, "", path);
    } else {
        if (!w.has("controlnet_cond_embedding.conv_in.weight"))
            throw Error("'" + path +
                        "' is not a ControlNet: it has neither controlnet_cond_embedding.conv_in.weight "
                        "(diffusers) nor input_hint_block.0.weight (original layout)");
        const std::string cfg_file = src.config_file;
        m = ControlNetModel(cfg_file.empty() ? ControlNetConfig::detect_from_weights(w)
                                             : ControlNetConfig::from_json_file(cfg_file));
        m->load(w);
    }
    m->eval();
    if (dtype != torch::kFloat) m->to(dtype);
    return m;
}

} // namespace anchor::unet
