#include "unet/bench/random_checkpoint.h"

#include "cache/io/atomic_file.h"
#include "cache/io/error.h"
#include "cache/io/safetensors.h"
#include "unet/model/clip_text.h"
#include "unet/model/name_conversion.h"
#include "unet/bench/unet_bench.h"
#include "unet/model/vae.h"

namespace anchor::unet {

void RandomCheckpointParams::validate() const {
    if (family != SdFamily::SD1 && family != SdFamily::SDXL)
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
    ClipTextConfig c;
    c.hidden_size = 1280;
    c.intermediate_size = 5120;
    c.num_hidden_layers = 32;
    c.num_attention_heads = 20;
    c.hidden_act = "gelu";
    c.projection_dim = 1280;
    return c;
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

int64_t write_random_checkpoint(const RandomCheckpointParams& p, const std::function<void(const std::string&)>& log) {
    p.validate();
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
