// SD checkpoint loading. The single-file layout is the one of CompVis/LDM (ldm.modules.diffusionmodules.openaimodel
// UNetModel, ldm.modules.diffusionmodules.model Encoder/Decoder) as written by diffusers'
// scripts/convert_diffusers_to_original_stable_diffusion.py; see tests/golden/sd/sd15_tiny_single_file/README.md.
#include "unet/checkpoint.h"

#include "cache/io/json_config.h"

#include "cache/io/error.h"
#include "cache/io/model_source.h"
#include "cache/io/weight_map.h"
#include "unet/name_conversion.h"

#include <filesystem>
#include <functional>
#include <regex>
#include <set>
#include <sstream>

namespace anchor::unet {

namespace fs = std::filesystem;

namespace {

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
    const ModelSource* id =
        src.layout == ModelLayout::DiffusersPipeline && src.has_component("unet") ? &src.component("unet") : &src;
    if (!id->weight_files.empty()) m.weights_file = id->weight_files.front();
    m.attention = opts.attention ? *opts.attention
                                 : (fs::is_directory(p) ? read_model_hints(path).attention : std::nullopt)
                                       .value_or(kernels::AttentionKernel::Exact);
    if (m.unet) m.unet->set_attention_kernel(m.attention);
    if (m.vae) m.vae->set_attention_kernel(m.attention);
    if (!opts.loras.empty()) apply_loras(m, opts.loras);
    return m;
}

ModelHints read_model_hints(const std::string& dir) {
    const fs::path f = fs::path(dir) / "anchorcache.json";
    if (!fs::exists(f)) return {};
    const JsonConfig j = JsonConfig::load(f.string(), "model hints");
    for (const auto& [key, value] : j.json().items())
        if (key != "attention" && key != "why") j.fail("unknown field '" + key + "' (known: attention, why)");
    ModelHints h;
    if (j.has("attention"))
        h.attention = j.get_enum("attention", kernels::attention_kernel_table(), kernels::AttentionKernel::Exact);
    return h;
}

} // namespace anchor::unet
