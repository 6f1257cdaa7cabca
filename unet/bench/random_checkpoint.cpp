#include "unet/bench/random_checkpoint.h"

#include "cache/io/atomic_file.h"
#include "cache/io/deferred_weights.h"
#include "cache/io/error.h"
#include "cache/io/safetensors.h"
#include "unet/bench/unet_bench.h"
#include "unet/model/clip_text.h"
#include "unet/model/name_conversion.h"
#include "unet/model/sd3_text_encoders.h"
#include "unet/model/vae.h"

#include <map>
#include <utility>

namespace anchor::unet {

void RandomCheckpointParams::validate() const {
    if (!sd3 && text_encoders)
        throw ParamError("text_encoders", "the text encoders are always written for sd1 / sdxl; the option is for "
                                          "sd3.5-medium / sd3.5-large");
    if (!sd3 && family != SdFamily::SD1 && family != SdFamily::SDXL)
        throw ParamError("family", "random checkpoints are written for sd1 and sdxl, not " +
                                       enum_name(sd_family_table(), family));
    if (dtype != torch::kHalf && dtype != torch::kFloat && dtype != torch::kBFloat16)
        throw ParamError("dtype", "must be f16, bf16 or f32");
    if (output.empty()) throw ParamError("output", "no output file");
    if (!(stddev > 0)) throw ParamError("stddev", "must be > 0");
}

namespace {

// Every parameter of `m` replaced, one at a time, by random values in `dtype` (the float32 one freed as it goes);
// returns them under `name(diffusers_name)`.
NamedTensors randomized(torch::nn::Module& m, const RandomCheckpointParams& p,
                        const std::function<std::string(const std::string&)>& name) {
    torch::NoGradGuard ng;
    NamedTensors out;
    for (auto& np : m.named_parameters(true)) {
        auto& t = np.value();
        const auto& key = np.key();
        const bool norm = key.find("norm") != std::string::npos || key.find("ln_") != std::string::npos;
        torch::Tensor v;
        if (key.size() > 5 && key.compare(key.size() - 5, 5, ".bias") == 0)
            v = torch::zeros(t.sizes(), torch::TensorOptions().dtype(p.dtype));
        else if (norm && t.dim() == 1)
            v = torch::ones(t.sizes(), torch::TensorOptions().dtype(p.dtype));
        else
            v = (torch::randn(t.sizes()) * p.stddev).to(p.dtype);
        t.set_data(torch::empty({0}));
        out.emplace_back(name(key), v);
    }
    return out;
}

ClipTextConfig clip_vit_l() {
    ClipTextConfig c; // the defaults are CLIP ViT-L/14's text tower
    return c;
}

ClipTextConfig open_clip_bigg() {
    return sd3_clip_g_config(); // OpenCLIP ViT-bigG/14's text tower with its projection: SDXL's and SD 3's
}

// A Hugging Face text encoder as an OpenCLIP tower under `prefix`: q/k/v fused into in_proj, the projection
// transposed (name_conversion.h, open_clip_source).
NamedTensors as_open_clip(NamedTensors hf, int64_t hidden, const std::string& prefix) {
    NamedTensors out;
    std::map<std::string, std::vector<std::pair<int64_t, torch::Tensor>>> fused;
    for (auto& [n, t] : hf) {
        const OpenClipSource s = open_clip_source(n, hidden);
        if (s.row_begin >= 0)
            fused[s.name].emplace_back(s.row_begin, t);
        else
            out.emplace_back(prefix + s.name, s.transposed ? t.t().contiguous() : t);
    }
    for (auto& [n, parts] : fused) {
        std::sort(parts.begin(), parts.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
        std::vector<torch::Tensor> rows;
        for (auto& [r, t] : parts) rows.push_back(t);
        out.emplace_back(prefix + n, torch::cat(rows, 0));
    }
    return out;
}

} // namespace

std::string sd3_single_file_name(const std::string& d) {
    static const std::vector<std::pair<std::string, std::string>> top = {
        {"pos_embed.pos_embed", "pos_embed"},
        {"pos_embed.proj.", "x_embedder.proj."},
        {"time_text_embed.timestep_embedder.linear_1.", "t_embedder.mlp.0."},
        {"time_text_embed.timestep_embedder.linear_2.", "t_embedder.mlp.2."},
        {"time_text_embed.text_embedder.linear_1.", "y_embedder.mlp.0."},
        {"time_text_embed.text_embedder.linear_2.", "y_embedder.mlp.2."},
        {"context_embedder.", "context_embedder."},
        {"proj_out.", "final_layer.linear."},
        {"norm_out.linear.", "final_layer.adaLN_modulation.1."}};
    static const std::vector<std::pair<std::string, std::string>> block = {
        {"attn.to_q.", "x_block.attn.qkv."},
        {"attn.to_k.", "x_block.attn.qkv."},
        {"attn.to_v.", "x_block.attn.qkv."},
        {"attn.add_q_proj.", "context_block.attn.qkv."},
        {"attn.add_k_proj.", "context_block.attn.qkv."},
        {"attn.add_v_proj.", "context_block.attn.qkv."},
        {"attn.norm_q.", "x_block.attn.ln_q."},
        {"attn.norm_k.", "x_block.attn.ln_k."},
        {"attn.norm_added_q.", "context_block.attn.ln_q."},
        {"attn.norm_added_k.", "context_block.attn.ln_k."},
        {"attn.to_out.0.", "x_block.attn.proj."},
        {"attn.to_add_out.", "context_block.attn.proj."},
        {"attn2.to_q.", "x_block.attn2.qkv."},
        {"attn2.to_k.", "x_block.attn2.qkv."},
        {"attn2.to_v.", "x_block.attn2.qkv."},
        {"attn2.norm_q.", "x_block.attn2.ln_q."},
        {"attn2.norm_k.", "x_block.attn2.ln_k."},
        {"attn2.to_out.0.", "x_block.attn2.proj."},
        {"norm1.linear.", "x_block.adaLN_modulation.1."},
        {"norm1_context.linear.", "context_block.adaLN_modulation.1."},
        {"ff.net.0.proj.", "x_block.mlp.fc1."},
        {"ff.net.2.", "x_block.mlp.fc2."},
        {"ff_context.net.0.proj.", "context_block.mlp.fc1."},
        {"ff_context.net.2.", "context_block.mlp.fc2."}};
    for (const auto& [from, to] : top)
        if (d.rfind(from, 0) == 0) return to + d.substr(from.size());
    const std::string tb = "transformer_blocks.";
    if (d.rfind(tb, 0) == 0) {
        const size_t dot = d.find('.', tb.size());
        const std::string i = d.substr(tb.size(), dot - tb.size()), rest = d.substr(dot + 1);
        for (const auto& [from, to] : block)
            if (rest.rfind(from, 0) == 0) return "joint_blocks." + i + "." + to + rest.substr(from.size());
    }
    throw Error("SD 3 transformer tensor '" + d + "' has no single-file name");
}

namespace {

// The transformer's diffusers tensors in Stability's names: q, k, v fused (rows in that order), the (scale, shift)
// rows of norm_out and of the last block's context modulation swapped back to (shift, scale).
NamedTensors sd3_transformer_as_single_file(SD3Transformer2DModelImpl& m) {
    std::map<std::string, std::vector<std::pair<int, torch::Tensor>>> fused;
    NamedTensors out;
    const std::string last = "transformer_blocks." + std::to_string(m.config().num_layers - 1) + ".norm1_context.";
    auto add = [&](const std::string& n, torch::Tensor t) {
        const std::string o = "model.diffusion_model." + sd3_single_file_name(n);
        if (o.find(".qkv.") != std::string::npos) {
            const bool k = n.find("to_k.") != std::string::npos || n.find("add_k_proj.") != std::string::npos;
            const bool v = n.find("to_v.") != std::string::npos || n.find("add_v_proj.") != std::string::npos;
            fused[o].emplace_back(k ? 1 : v ? 2 : 0, t);
            return;
        }
        if (n.rfind("norm_out.linear.", 0) == 0 || n.rfind(last, 0) == 0) {
            const auto h = t.chunk(2, 0);
            t = torch::cat({h[1], h[0]}, 0);
        }
        out.emplace_back(o, t);
    };
    for (const auto& np : m.named_parameters(true)) add(np.key(), np.value().detach());
    for (const auto& nb : m.named_buffers(true)) add(nb.key(), nb.value().detach());
    for (auto& [n, parts] : fused) {
        std::sort(parts.begin(), parts.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
        out.emplace_back(n, torch::cat({parts[0].second, parts[1].second, parts[2].second}, 0));
    }
    return out;
}

template <typename M, typename C> M sd3_random_module(const C& c, torch::ScalarType dtype, double stddev) {
    M m{nullptr};
    {
        const DeferredWeights deferred(dtype);
        m = M(c);
    }
    m->to(dtype);
    fill_random_weights(*m, stddev);
    return m;
}

NamedTensors sd3_prefixed(torch::nn::Module& m, const std::string& prefix, bool skip_projection = false) {
    NamedTensors out;
    for (const auto& np : m.named_parameters(true))
        if (!(skip_projection && np.key() == "text_projection.weight"))
            out.emplace_back(prefix + np.key(), np.value().detach());
    return out;
}

} // namespace

int64_t write_random_sd3_checkpoint(const RandomCheckpointParams& p, const RandomSd3Parts& parts,
                                    const std::function<void(const std::string&)>& log) {
    check_output_path(p.output, p.overwrite);
    torch::manual_seed(uint64_t(p.seed));
    NamedTensors all;
    auto add = [&](NamedTensors part, const std::string& what) {
        int64_t bytes = 0;
        for (const auto& [n, t] : part) bytes += t.numel() * int64_t(t.element_size());
        log(what + ": " + std::to_string(part.size()) + " tensors, " + std::to_string(bytes >> 20) + " MiB");
        for (auto& e : part) all.push_back(std::move(e));
    };
    {
        auto m = sd3_random_module<SD3Transformer2DModel>(parts.transformer, p.dtype, p.stddev);
        add(sd3_transformer_as_single_file(*m), "transformer");
    }
    if (parts.vae) {
        auto vae = sd3_random_module<AutoencoderKL>(*parts.vae, p.dtype, p.stddev);
        NamedTensors part;
        for (const auto& np : vae->named_parameters(true)) {
            auto t = np.value().detach();
            const std::string n = "first_stage_model." + vae_ldm_name(np.key(), *parts.vae);
            if (t.dim() == 2 && n.find(".mid.attn_1.") != std::string::npos) t = t.unsqueeze(-1).unsqueeze(-1);
            part.emplace_back(n, t);
        }
        add(std::move(part), "vae");
    }
    // CLIP-L without text_projection (SD 3 files have none: the identity stands in), bigG with it, T5 as HF names it.
    if (parts.clip_l) {
        auto te = sd3_random_module<ClipTextModel>(*parts.clip_l, p.dtype, p.stddev);
        add(sd3_prefixed(*te, sd3_text_encoder_prefix(Sd3TextRole::ClipL), true), "text encoder CLIP-L");
    }
    if (parts.clip_g) {
        auto te = sd3_random_module<ClipTextModel>(*parts.clip_g, p.dtype, p.stddev);
        add(sd3_prefixed(*te, sd3_text_encoder_prefix(Sd3TextRole::ClipG)), "text encoder CLIP-G (OpenCLIP bigG)");
    }
    if (parts.t5) {
        auto te = sd3_random_module<T5EncoderModel>(*parts.t5, p.dtype, p.stddev);
        add(sd3_prefixed(*te, sd3_text_encoder_prefix(Sd3TextRole::T5xxl)), "text encoder T5-XXL");
    }
    int64_t bytes = 0;
    for (const auto& [n, t] : all) bytes += t.numel() * int64_t(t.element_size());
    save_safetensors(p.output, all, {{"format", "pt"}, {"anchorcache", "random weights"}}, p.overwrite);
    return bytes;
}

int64_t write_random_checkpoint(const RandomCheckpointParams& p, const std::function<void(const std::string&)>& log) {
    p.validate();
    if (p.sd3) {
        RandomSd3Parts parts;
        parts.transformer = sd3_transformer_config_of(*p.sd3);
        parts.vae = sd3_vae_config();
        if (p.text_encoders) {
            parts.clip_l = sd3_clip_l_config();
            parts.clip_g = sd3_clip_g_config();
            parts.t5 = sd3_t5xxl_config();
        }
        return write_random_sd3_checkpoint(p, parts, log);
    }
    check_output_path(p.output, p.overwrite);
    torch::manual_seed(uint64_t(p.seed));
    const bool sdxl = p.family == SdFamily::SDXL;
    NamedTensors all;
    auto add = [&](NamedTensors part, const std::string& what) {
        int64_t bytes = 0;
        for (const auto& [n, t] : part) bytes += t.numel() * int64_t(t.element_size());
        log(what + ": " + std::to_string(part.size()) + " tensors, " + std::to_string(bytes >> 20) + " MiB");
        for (auto& e : part) all.push_back(std::move(e));
    };
    {
        const UNetConfig uc = unet_config_of_family(p.family);
        UNet2DConditionModel unet(uc);
        add(randomized(*unet, p, [&](const std::string& n) { return "model.diffusion_model." + unet_ldm_name(n, uc); }),
            "unet");
    }
    {
        VaeConfig vc; // SD's autoencoder (128/256/512/512); SDXL's has the same shapes
        if (sdxl) vc.scaling_factor = 0.13025;
        AutoencoderKL vae(vc);
        auto part =
            randomized(*vae, p, [&](const std::string& n) { return "first_stage_model." + vae_ldm_name(n, vc); });
        for (auto& [n, t] : part) // LDM's mid-block attention: 1x1 convolutions
            if (t.dim() == 2 && n.find(".mid.attn_1.") != std::string::npos) t = t.unsqueeze(-1).unsqueeze(-1);
        add(std::move(part), "vae");
    }
    {
        ClipTextModel te(clip_vit_l());
        const std::string pre = sdxl ? "conditioner.embedders.0.transformer." : "cond_stage_model.transformer.";
        add(randomized(*te, p, [&](const std::string& n) { return pre + n; }), "text encoder (CLIP ViT-L)");
    }
    if (sdxl) {
        const auto c = open_clip_bigg();
        ClipTextModel te(c);
        add(as_open_clip(randomized(*te, p, [](const std::string& n) { return n; }), c.hidden_size,
                         "conditioner.embedders.1.model."),
            "text encoder 2 (OpenCLIP ViT-bigG)");
    }
    int64_t bytes = 0;
    for (const auto& [n, t] : all) bytes += t.numel() * int64_t(t.element_size());
    save_safetensors(p.output, all, {{"format", "pt"}, {"anchorcache", "random weights"}}, p.overwrite);
    return bytes;
}

} // namespace anchor::unet
