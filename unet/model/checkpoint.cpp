// SD checkpoint loading. The single-file layout is the one of CompVis/LDM (ldm.modules.diffusionmodules.openaimodel
// UNetModel, ldm.modules.diffusionmodules.model Encoder/Decoder) as written by diffusers'
// scripts/convert_diffusers_to_original_stable_diffusion.py; see tests/golden/sd/sd15_tiny_single_file/README.md.
#include "unet/model/checkpoint.h"

#include "cache/util/heap.h"
#include "cache/util/strings.h"

#include "cache/io/json_config.h"

#include "cache/io/deferred_weights.h"
#include "cache/io/error.h"
#include "cache/io/model_source.h"
#include "cache/io/weight_map.h"
#include "cache/io/yaml_lite.h"
#include "unet/model/name_conversion.h"

#include <filesystem>
#include <functional>
#include <optional>
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

template <typename M> M finish(M m, torch::ScalarType dtype) {
    m->eval();
    if (dtype != torch::kFloat) m->to(dtype);
    return m;
}

// A tokenizer folder's BPE files when it has them, else the bundled CLIP vocabulary; its pad token when its configs
// name one, else `default_pad` (SD 1.x pads with <|endoftext|>, OpenCLIP encoders with "!" = 0).
ClipTokenizer tokenizer_for(const std::string& folder, int64_t default_pad) {
    if (!folder.empty() && fs::exists(fs::path(folder) / "vocab.json")) return ClipTokenizer::from_folder(folder);
    ClipTokenizer t = ClipTokenizer::bundled();
    t.set_pad_id(default_pad);
    if (!folder.empty() && fs::is_directory(folder)) t.read_special_tokens(folder);
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
    const DeferredWeights deferred;
    return load_component<UNet2DConditionModel, UNetConfig>(component_source(dir), dtype);
}

AutoencoderKL load_vae_folder(const std::string& dir, torch::ScalarType dtype) {
    const DeferredWeights deferred;
    return load_component<AutoencoderKL, VaeConfig>(component_source(dir), dtype);
}

ClipTextModel load_text_encoder_folder(const std::string& dir, torch::ScalarType dtype) {
    return load_component<ClipTextModel, ClipTextConfig>(component_source(dir), dtype);
}

const EnumTable<torch::ScalarType>& weights_dtype_table() {
    static const EnumTable<torch::ScalarType> t = {
        {"f32", torch::kFloat}, {"f16", torch::kHalf}, {"bf16", torch::kBFloat16}};
    return t;
}

void LoadOptions::validate() const {
    if (enum_name(weights_dtype_table(), weights_dtype) == "?")
        throw ParamError("weights_dtype", "must be one of " + enum_choices(weights_dtype_table()) + ", got " +
                                              std::string(c10::toString(weights_dtype)));
    if (weights_dtype != torch::kFloat && dtype != torch::kFloat)
        throw ParamError("weights_dtype", "reduced-precision weights (" +
                                              enum_name(weights_dtype_table(), weights_dtype) +
                                              ") are upcast to a float32 compute; with compute dtype " +
                                              std::string(c10::toString(dtype)) + " keep f32");
    if (gemm && device.is_cpu())
        if (const auto why = kernels::gemm_backend_unavailable(*gemm); !why.empty()) throw ParamError("gemm", why);
    if (!device.is_cpu() &&
        !(device.is_cuda() && torch::cuda::is_available() && device.index() < int(torch::cuda::device_count())))
        throw ParamError("device", "'" + device.str() + "' is not a device of this LibTorch (CUDA devices: " +
                                       std::to_string(torch::cuda::is_available() ? torch::cuda::device_count() : 0) +
                                       ")");
    for (const auto& [on, field] : {std::pair{channels_last, "channels_last"}, {cudnn_benchmark, "cudnn_benchmark"}})
        if (on && !device.is_cuda())
            throw ParamError(field, "is for a CUDA device (cuDNN convolutions), the models load on " + device.str());
}

void store_weights_as(torch::nn::Module& m, torch::ScalarType dtype) {
    if (dtype == torch::kFloat) return;
    torch::NoGradGuard ng;
    auto convert = [dtype](torch::Tensor& w) { w.set_data(w.detach().to(dtype)); };
    for (const auto& sub : m.modules(true)) {
        if (auto* l = dynamic_cast<torch::nn::LinearImpl*>(sub.get()))
            convert(l->weight);
        else if (auto* c = dynamic_cast<torch::nn::Conv2dImpl*>(sub.get()))
            convert(c->weight);
    }
    util::release_free_heap(); // the float32 copies just freed, most of them under glibc's mmap threshold
}

namespace {
void release_module_weights(torch::nn::Module& m) {
    c10::InferenceMode off(false); // set_data on a parameter is refused inside inference mode
    torch::NoGradGuard ng;
    for (auto& t : m.parameters(true)) t.set_data(torch::empty({0}, t.options()));
    for (auto& t : m.buffers(true)) t.set_data(torch::empty({0}, t.options()));
}
} // namespace

void release_weights(SDModels& m, std::initializer_list<ModelPart> parts) {
    for (const ModelPart part : parts) {
        switch (part) {
        case ModelPart::TextEncoders:
            for (auto* te : {&m.text_encoder, &m.text_encoder_2})
                if (*te) release_module_weights(**te);
            m.released.push_back("text encoders");
            break;
        case ModelPart::VaeEncoder:
            if (m.vae) {
                release_module_weights(*m.vae->encoder);
                if (m.vae->quant_conv) release_module_weights(*m.vae->quant_conv);
            }
            m.released.push_back("VAE encoder");
            break;
        case ModelPart::Unet:
            if (m.unet) release_module_weights(*m.unet);
            kernels::onednn_drop_packed_weights(); // --gemm bf16's packed copies (the VAE's are made again)
            m.released.push_back("UNet");
            break;
        }
    }
    util::release_free_heap();
}

int64_t parameter_bytes(const torch::nn::Module& m) {
    int64_t n = 0;
    for (const auto& p : m.parameters(true)) n += p.numel() * int64_t(p.element_size());
    for (const auto& b : m.buffers(true)) n += b.numel() * int64_t(b.element_size());
    return n;
}

const EnumTable<std::optional<PredictionType>>& prediction_option_table() {
    static const EnumTable<std::optional<PredictionType>> t = {
        {"auto", std::nullopt}, {"eps", PredictionType::Epsilon}, {"v", PredictionType::VPrediction}};
    return t;
}

const EnumTable<PredictionSource>& prediction_source_table() {
    static const EnumTable<PredictionSource> t = {{"scheduler-config", PredictionSource::SchedulerConfig},
                                                  {"sd1-default", PredictionSource::Sd1Default},
                                                  {"detected", PredictionSource::Detected},
                                                  {"option", PredictionSource::Option},
                                                  {"original-config", PredictionSource::OriginalConfig}};
    return t;
}

double v_prediction_test(UNet2DConditionModelImpl& unet) {
    torch::NoGradGuard ng;
    const auto& c = unet.config();
    const auto x = torch::full({1, int64_t(c.in_channels), 8, 8}, 0.5);
    const auto context = torch::full({1, 2, int64_t(c.cross_attention_dim)}, 0.5);
    const auto out = unet.forward(x, torch::tensor(int64_t(999)), context).to(torch::kFloat);
    return (out - x).mean().item<double>();
}

namespace {

// What a VAE file holds besides the autoencoder: the training loss of LDM's AutoencoderKL (discriminator, logvar) and
// EMA copies; never loaded.
bool vae_training_leftover(const std::string& n) {
    return n.rfind("loss.", 0) == 0 || n.rfind("model_ema.", 0) == 0;
}

std::string vae_fit_error(const std::string& path, const std::vector<std::string>& missing,
                          const std::vector<std::string>& unexpected, const std::vector<std::string>& bad_shape) {
    std::string msg = "VAE '" + path + "' does not fit the model's VAE:";
    if (!missing.empty()) msg += "\n" + std::to_string(missing.size()) + " missing tensor(s):" + indented_list(missing);
    if (!bad_shape.empty())
        msg += "\n" + std::to_string(bad_shape.size()) + " tensor(s) with the wrong shape:" + indented_list(bad_shape);
    if (!unexpected.empty())
        msg += "\n" + std::to_string(unexpected.size()) + " unexpected tensor(s):" + indented_list(unexpected);
    return msg;
}

} // namespace

AutoencoderKL load_vae_file(const std::string& path, const VaeConfig& base, torch::ScalarType dtype) {
    const ModelSource src = resolve_model(path, {nullptr, "VAE"});
    const ModelSource& vs = src.layout == ModelLayout::DiffusersPipeline ? src.component("vae") : src;
    const WeightMap file = vs.load_weights();
    const bool own_config = vs.arch == ModelArch::AutoencoderKL && !vs.config_file.empty();
    const VaeConfig cfg = own_config ? VaeConfig::from_json_file(vs.config_file) : base;
    const DeferredWeights deferred;
    AutoencoderKL vae(cfg);
    // Original (LDM) names, with or without the full checkpoint's `first_stage_model.` prefix, or diffusers names.
    const std::string prefix = has_prefix(file, "first_stage_model.") ? "first_stage_model." : "";
    const bool ldm = !prefix.empty() || has_prefix(file, "encoder.down.") || has_prefix(file, "decoder.up.");
    std::vector<std::string> missing, unexpected, bad_shape;
    std::set<std::string> used;
    WeightMap w;
    if (ldm) {
        w = gather(
            file, *vae, [&](const std::string& n) { return vae_ldm_name(n, cfg); }, prefix, "vae", missing, used);
    } else {
        for (const auto& p : vae->named_parameters(true)) {
            if (!file.has(p.key())) {
                missing.push_back("vae " + p.key() + " " + shape_str(p.value().sizes().vec()));
                continue;
            }
            w.insert(p.key(), file.get(p.key()), file.source(p.key()));
            used.insert(p.key());
        }
    }
    for (const auto& [n, t] : file.all()) {
        const bool theirs = prefix.empty() ? !vae_training_leftover(n) : n.rfind(prefix, 0) == 0;
        if (theirs && !used.count(n)) unexpected.push_back(n);
    }
    for (const auto& p : vae->named_parameters(true))
        if (w.has(p.key()) && w.shape(p.key()) != p.value().sizes().vec())
            bad_shape.push_back(
                p.key() + ": expected " + shape_str(p.value().sizes().vec()) + ", got " + shape_str(w.shape(p.key())) +
                " (" + (own_config ? "config '" + vs.config_file + "'" : std::string("the model's VAE config")) + ")");
    if (!missing.empty() || !unexpected.empty() || !bad_shape.empty())
        throw Error(vae_fit_error(path, missing, unexpected, bad_shape));
    vae->load(w);
    return finish(vae, dtype);
}

OriginalConfig read_original_config(const std::string& checkpoint) {
    OriginalConfig oc;
    const fs::path yaml = fs::path(checkpoint).replace_extension(".yaml");
    if (!fs::exists(yaml)) return oc;
    oc.path = yaml.string();
    const auto y = load_yaml_lite(oc.path);
    auto at = [&](std::initializer_list<const char*> keys) -> const nlohmann::json* {
        const nlohmann::json* j = &y;
        for (const char* k : keys) {
            if (!j->is_object() || !j->contains(k)) return nullptr;
            j = &j->at(k);
        }
        return j;
    };
    auto number = [&](const nlohmann::json* j, const std::string& field) {
        if (!j->is_number()) throw Error("'" + oc.path + "': " + field + " must be a number, got " + j->dump());
        return j->get<double>();
    };
    const nlohmann::json* params = at({"model", "params"});
    if (!params) throw Error("'" + oc.path + "' has no model.params (not an LDM/SGM model config)");
    for (const char* net : {"unet_config", "network_config"}) {
        const nlohmann::json* u = at({"model", "params", net, "params"});
        if (!u) continue;
        if (u->contains("num_head_channels"))
            oc.num_head_channels = int(number(&u->at("num_head_channels"), std::string(net) + ".num_head_channels"));
        if (u->contains("num_heads")) oc.num_heads = int(number(&u->at("num_heads"), std::string(net) + ".num_heads"));
    }
    if (params->contains("scale_factor")) oc.scale_factor = number(&params->at("scale_factor"), "scale_factor");
    if (params->value("parameterization", std::string()) == "v") oc.prediction = PredictionType::VPrediction;
    if (const auto* sc = at({"model", "params", "denoiser_config", "params", "scaling_config", "target"}))
        if (sc->is_string() && sc->get<std::string>().find("VScaling") != std::string::npos)
            oc.prediction = PredictionType::VPrediction;
    if (const auto* emb = at({"model", "params", "conditioner_config", "params", "emb_models"}); emb && emb->is_array())
        for (const auto& e : *emb)
            if (e.is_object() &&
                e.value("target", std::string()).find("ConcatTimestepEmbedderND") != std::string::npos &&
                e.contains("params") && e["params"].contains("outdim"))
                oc.addition_time_embed_dim = int(number(&e["params"]["outdim"], "emb_models[].params.outdim"));
    return oc;
}

void OriginalConfig::apply(UNetConfig& unet, VaeConfig& vae) const {
    if (scale_factor) vae.scaling_factor = *scale_factor;
    for (size_t i = 0; i < unet.heads.size(); ++i) {
        const int ch = unet.block_out_channels[i];
        if (num_head_channels > 0) {
            if (ch % num_head_channels != 0)
                throw Error("'" + path + "': num_head_channels " + std::to_string(num_head_channels) +
                            " does not divide the " + std::to_string(ch) + " channels of UNet level " +
                            std::to_string(i));
            unet.heads[i] = ch / num_head_channels;
        } else if (num_heads > 0) {
            unet.heads[i] = num_heads;
        }
    }
}

namespace {

SDModels load_diffusers(const ModelSource& src, const LoadOptions& o) {
    SDModels m;
    m.layout = "diffusers";
    const fs::path root(src.path);
    for (const char* sub : {"unet", "vae"}) (void)src.component(sub);
    const bool te1 = src.has_component("text_encoder"), te2 = src.has_component("text_encoder_2");
    if (!te1 && !te2) (void)src.component("text_encoder"); // names the folder and what it has
    // Refuse, don't guess: a component folder without its config.json would otherwise get an architecture detected
    // from the weights and the default sample size, and run to a wrong image. (Single-file checkpoints have no
    // configs and keep their shape detection.)
    for (const char* c : {"unet", "vae", "text_encoder", "text_encoder_2"}) {
        if ((c == std::string("text_encoder") && !te1) || (c == std::string("text_encoder_2") && !te2)) continue;
        if (src.component(c).config_file.empty())
            throw ParamError("model", "'" + (root / c / "config.json").string() +
                                          "' is missing: every component of a diffusers folder needs its config "
                                          "(the architecture is not guessed from the weights)");
    }
    if (o.unet) m.unet = load_component<UNet2DConditionModel, UNetConfig>(src.component("unet"), o.dtype);
    // The family from shapes (configs are shapes written down): the UNet's and the text encoders' widths.
    SdShapes shapes;
    auto width = [&](const char* c) { return src.component(c).config.value("hidden_size", 1); };
    if (te1) shapes.text_width = width("text_encoder");
    if (te2) shapes.second_text_width = width("text_encoder_2");
    const UNetConfig ucfg = m.unet ? m.unet->config() : UNetConfig::from_json_file(src.component("unet").config_file);
    shapes.cross_attention_dim = ucfg.cross_attention_dim;
    shapes.linear_projection = ucfg.use_linear_projection;
    shapes.added_conditioning = ucfg.text_time();
    shapes.added_conditioning_tensor = "add_embedding.linear_1.weight";
    m.family = sd_family(shapes);
    if (m.family == SdFamily::SDXLRefiner)
        throw Error("'" + src.path +
                    "' is an SDXL refiner (a UNet with added conditioning and only text_encoder_2): "
                    "the refiner's aesthetic-score conditioning is not supported; use an SDXL base model");
    if (o.text_encoder && te1)
        m.text_encoder = load_component<ClipTextModel, ClipTextConfig>(src.component("text_encoder"), o.dtype);
    if (o.text_encoder && te2 && m.family == SdFamily::SDXL)
        m.text_encoder_2 = load_component<ClipTextModel, ClipTextConfig>(src.component("text_encoder_2"), o.dtype);
    if (m.text_encoder_2 && m.text_encoder_2->config().projection_dim <= 0)
        throw Error("'" + (root / "text_encoder_2").string() +
                    "': SDXL's second text encoder must be a CLIPTextModelWithProjection (config architectures, "
                    "text_projection.weight)");
    if (o.vae) m.vae = load_component<AutoencoderKL, VaeConfig>(src.component("vae"), o.dtype);
    const bool sd2 = m.family == SdFamily::SD2;
    m.tokenizer = tokenizer_for((root / "tokenizer").string(), sd2 ? 0 : ClipTokenizer::kEos);
    if (m.family == SdFamily::SDXL) m.tokenizer_2 = tokenizer_for((root / "tokenizer_2").string(), 0);
    m.force_zeros_for_empty_prompt =
        src.config.is_object() && src.config.value("force_zeros_for_empty_prompt", m.family == SdFamily::SDXL);
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
    if (m.family == SdFamily::SD3)
        throw Error("'" + path + "' is an SD 3 / 3.5 checkpoint (model.diffusion_model.joint_blocks: an MMDiT); its "
                    "single-file layout is not supported yet: use its diffusers folder (transformer/, vae/)");
    const bool sdxl = m.family == SdFamily::SDXL;
    if (m.family == SdFamily::SDXLRefiner)
        throw Error("'" + path + "' is an SDXL refiner (tensor '" + shapes.added_conditioning_tensor +
                    "': added conditioning, with only the OpenCLIP text encoder): the refiner's aesthetic-score "
                    "conditioning is not supported; use an SDXL base model");
    const OriginalConfig oc = read_original_config(path);
    UNetConfig ucfg = detect_ldm_unet_config(file.with_prefix_stripped(up));
    VaeConfig vcfg = detect_ldm_vae_config(file.with_prefix_stripped(vp));
    oc.apply(ucfg, vcfg);
    const std::string sdxl_te1 = "conditioner.embedders.0.transformer.", sdxl_te2 = "conditioner.embedders.1.model.";
    if (sdxl) {
        // SGM's label_emb input: the pooled embedding (text_projection's output width) and six time ids, each
        // embedded to addition_time_embed_dim (the yaml's ConcatTimestepEmbedderND outdim when there is one).
        const std::string le = "model.diffusion_model.label_emb.0.0.weight", proj = sdxl_te2 + "text_projection";
        if (!file.has(le) || !file.has(proj))
            throw Error("'" + path + "' is an SDXL checkpoint without '" + (file.has(le) ? proj : le) + "'");
        ucfg.projection_class_embeddings_input_dim = int(file.shape(le)[1]);
        const int64_t pooled = file.shape(proj)[1], rest = ucfg.projection_class_embeddings_input_dim - pooled;
        ucfg.addition_time_embed_dim = oc.addition_time_embed_dim > 0 ? oc.addition_time_embed_dim : int(rest / 6);
        if (rest <= 0 || rest != 6 * ucfg.addition_time_embed_dim)
            throw Error(
                "'" + path + "': label_emb takes " + std::to_string(ucfg.projection_class_embeddings_input_dim) +
                " inputs, which is not the pooled width " + std::to_string(pooled) + " plus six time-id embeddings");
        // diffusers' SDXL VAE config (sd_xl_base.yaml scale_factor; the VAE overflows in float16).
        if (!oc.scale_factor) vcfg.scaling_factor = 0.13025;
        vcfg.force_upcast = true;
        // SDXL base and its fine-tunes: 1024x1024 (diffusers' single-file default for SDXL).
        ucfg.sample_size = 1024 / vcfg.spatial_factor();
        m.force_zeros_for_empty_prompt = true;
    }
    WeightMap uw, vw, tw, tw2;
    if (o.unet) {
        // SD 2.x's v-prediction test (below) runs on float32 weights, as before any conversion.
        std::optional<DeferredWeights> float_weights;
        if (m.family == SdFamily::SD2 && !oc.prediction) float_weights.emplace(torch::kFloat);
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
    // A text encoder in Hugging Face names under `prefix` (older SD 1.x checkpoints without the `text_model.` level).
    auto hf_text = [&](const std::string& prefix) {
        const bool nested = has_prefix(file, prefix + "text_model.");
        auto text = file.with_prefix_stripped(prefix);
        if (!nested) text = text.renamed([](const std::string& n) { return "text_model." + n; });
        for (const auto& [n, t] : file.all())
            if (n.rfind(prefix, 0) == 0) used.insert(n);
        return text;
    };
    // OpenCLIP towers are gelu (ViT-H, ViT-bigG).
    auto open_clip_model = [&](const WeightMap& w) {
        auto c = ClipTextConfig::detect_from_weights(w);
        c.hidden_act = "gelu";
        return ClipTextModel(c);
    };
    const std::string sd1_text = "cond_stage_model.transformer.", sd2_text = "cond_stage_model.model.";
    if (sdxl) {
        if (!has_prefix(file, sdxl_te1) || !has_prefix(file, sdxl_te2))
            missing.push_back("text encoders: SDXL needs '" + sdxl_te1 + "*' (CLIP ViT-L) and '" + sdxl_te2 +
                              "*' (OpenCLIP ViT-bigG) tensors");
        auto t1 = hf_text(sdxl_te1);
        auto t2 = convert_open_clip(file, sdxl_te2, used, {/*drop_last_layer=*/false, /*projection=*/true});
        if (o.text_encoder && missing.empty()) {
            m.text_encoder = ClipTextModel(ClipTextConfig::detect_from_weights(t1));
            m.text_encoder_2 = open_clip_model(t2);
            tw = t1, tw2 = t2;
        }
    } else if (has_prefix(file, sd2_text)) {
        auto converted = convert_open_clip(file, sd2_text, used);
        if (o.text_encoder) m.text_encoder = open_clip_model(converted), tw = converted;
    } else if (has_prefix(file, sd1_text)) {
        auto text = hf_text(sd1_text);
        if (o.text_encoder) m.text_encoder = ClipTextModel(ClipTextConfig::detect_from_weights(text)), tw = text;
    } else if (o.text_encoder) {
        missing.push_back("text encoder: no 'cond_stage_model.transformer.*' (SD 1.x) or 'cond_stage_model.model.*' "
                          "(SD 2.x) tensors");
    }
    // Tensors of the three prefixes that nothing consumed are reported (other top-level entries such as
    // model_ema.*, betas or alphas_cumprod belong to training and are ignored).
    std::vector<std::string> unexpected;
    for (const auto& [n, t] : file.all()) {
        const bool ours = n.rfind(up, 0) == 0 || n.rfind(vp, 0) == 0 || n.rfind("cond_stage_model.", 0) == 0 ||
                          n.rfind("conditioner.", 0) == 0;
        if (ours && !used.count(n)) unexpected.push_back(n);
    }
    if (!missing.empty() || !unexpected.empty()) {
        std::string msg = "'" + path + "' does not fit the Stable Diffusion layout detected from its shapes (" +
                          ucfg.describe() + "):";
        if (!missing.empty())
            msg += "\n" + std::to_string(missing.size()) + " missing tensor(s):" + indented_list(missing);
        if (!unexpected.empty())
            msg += "\n" + std::to_string(unexpected.size()) + " unexpected tensor(s):" + indented_list(unexpected);
        throw Error(msg);
    }
    if (m.unet) {
        m.unet->load(uw);
        m.unet->eval();
        // A single file has no scheduler config: SD 1.x is epsilon; SD 2.x comes as 512-base (epsilon) and 768-v, told
        // apart by one UNet evaluation (v_prediction_test), in float32 before any dtype conversion as A1111 does. It
        // runs under --prediction too, so the record shows what the option overrode.
        m.prediction.source = PredictionSource::Sd1Default;
        if (oc.prediction) {
            m.prediction.type = *oc.prediction;
            m.prediction.source = PredictionSource::OriginalConfig;
        } else if (m.family == SdFamily::SD2) {
            m.prediction.test_mean = v_prediction_test(*m.unet);
            m.prediction.source = PredictionSource::Detected;
            if (*m.prediction.test_mean < -1.0) m.prediction.type = PredictionType::VPrediction;
        }
        if (o.prediction) {
            m.prediction.type = *o.prediction;
            m.prediction.source = PredictionSource::Option;
        }
        // Default size 768 for v-prediction, 512 otherwise, as diffusers 0.27's single-file loader
        // (loaders/single_file_utils.py, image_size) and the LDM configs (v2-inference-v.yaml: UNet image_size 96
        // latents; v2-inference.yaml: 64, this default) give it.
        if (m.family == SdFamily::SD2 && m.prediction.type == PredictionType::VPrediction) m.unet->set_sample_size(96);
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
    if (m.text_encoder_2) {
        m.text_encoder_2->load(tw2);
        m.text_encoder_2 = finish(m.text_encoder_2, o.dtype);
    }
    m.tokenizer = tokenizer_for("", m.family == SdFamily::SD2 ? 0 : ClipTokenizer::kEos);
    if (sdxl) m.tokenizer_2 = tokenizer_for("", 0);
    return m;
}

} // namespace

SDModels load_sd_models(const std::string& path, const LoadOptions& opts) {
    opts.validate();
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
    if (fs::is_directory(p / "transformer") && !fs::is_directory(p / "unet"))
        throw Error("'" + path + "' is a transformer pipeline (transformer/, no unet/): SD 3 / 3.5 folders load with "
                    "load_sd3_models (unet/pipeline/sd3_pipeline.h)");
    const ModelSource src = resolve_model(target, {nullptr, "Stable Diffusion model"});
    SDModels m;
    {
        // Layers are filled from the file, not initialised first; weights go straight into their storage dtype
        // unless LoRAs are merged into them (in float32, below).
        const DeferredWeights deferred(opts.loras.empty() ? opts.weights_dtype : torch::kFloat);
        m = src.layout == ModelLayout::DiffusersPipeline ? load_diffusers(src, opts) : load_single_file(src, opts);
    }
    m.source = path;
    const ModelSource* id =
        src.layout == ModelLayout::DiffusersPipeline && src.has_component("unet") ? &src.component("unet") : &src;
    if (!id->weight_files.empty()) m.weights_file = id->weight_files.front();
    m.attention = opts.attention ? *opts.attention
                                 : (fs::is_directory(p) ? read_model_hints(path).attention : std::nullopt)
                                       .value_or(m.unet ? default_attention_kernel(m.unet->config())
                                                        : kernels::AttentionKernel::Exact);
    m.gemm = opts.gemm.value_or(default_gemm_backend(m.attention));
    if (m.unet) m.unet->set_attention_kernel(m.attention), perf::set_gemm_backend(*m.unet, m.gemm);
    if (m.vae) m.vae->set_attention_kernel(m.attention), perf::set_gemm_backend(*m.vae, m.gemm);
    for (auto* te : {&m.text_encoder, &m.text_encoder_2})
        if (*te) (*te)->set_attention_kernel(m.attention);
    if (opts.prediction) m.prediction = {*opts.prediction, PredictionSource::Option, m.prediction.test_mean};
    if (!opts.vae_file.empty() && m.vae) {
        m.vae = load_vae_file(opts.vae_file, m.vae->config(), opts.dtype);
        m.vae->set_attention_kernel(m.attention);
        perf::set_gemm_backend(*m.vae, m.gemm);
        m.vae_file = opts.vae_file;
    }
    if (!opts.loras.empty()) apply_loras(m, opts.loras);
    // Last: LoRAs merge into the float32 weights.
    m.weights_dtype = opts.weights_dtype;
    if (m.unet) store_weights_as(*m.unet, opts.weights_dtype);
    if (m.vae) store_weights_as(*m.vae, opts.weights_dtype);
    if (m.text_encoder) store_weights_as(*m.text_encoder, opts.weights_dtype);
    // --device cuda: every network on the GPU (the tokenizer, the schedulers and the initial noise stay on the CPU,
    // so a seed gives the same image as on the CPU, as in diffusers).
    if (!opts.device.is_cpu()) {
        if (m.unet) m.unet->to(opts.device);
        if (m.vae) m.vae->to(opts.device);
        for (auto* te : {&m.text_encoder, &m.text_encoder_2})
            if (*te) (*te)->to(opts.device);
    }
    if (opts.channels_last) {
        torch::NoGradGuard ng;
        for (torch::nn::Module* net : {static_cast<torch::nn::Module*>(m.unet.get()),
                                       static_cast<torch::nn::Module*>(m.vae.get())})
            if (net)
                for (auto& w : net->parameters())
                    if (w.dim() == 4) w.set_data(w.detach().contiguous(torch::MemoryFormat::ChannelsLast));
    }
    if (opts.cudnn_benchmark) at::globalContext().setBenchmarkCuDNN(true);
    if (opts.fused_qkv && m.unet) m.unet->set_fused_qkv(true);
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
