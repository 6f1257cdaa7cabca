// The SD 3 denoising loop (unet/pipeline/sd3_pipeline.h).
#include "unet/pipeline/sd3_pipeline.h"

#include "cache/io/error.h"
#include "cache/io/model_source.h"
#include "cache/io/weight_map.h"
#include "unet/model/checkpoint.h"
#include "unet/model/name_conversion.h"

#include <filesystem>
#include <tuple>

namespace anchor::unet {

namespace fs = std::filesystem;

SD3Models load_sd3_models(const std::string& path, torch::ScalarType dtype, bool load_t5) {
    SD3Models m;
    m.source = path;
    const fs::path p(path);
    if (!fs::is_directory(p)) {
        // An original single file: the transformer under model.diffusion_model., the VAE under first_stage_model.
        // (LDM names); text encoders it may hold are not loaded.
        const ModelSource src = resolve_model(path, {nullptr, "SD3 checkpoint"});
        const WeightMap file = src.load_weights();
        if (sd_family(sd_shapes_of_single_file(file)) != SdFamily::SD3)
            throw Error("'" + path + "' is not an SD 3 / 3.5 checkpoint (no model.diffusion_model.joint_blocks.0)");
        const WeightMap w = sd3_transformer_weights_from_single_file(file);
        m.transformer = SD3Transformer2DModel(SD3TransformerConfig::detect_from_weights(w));
        m.transformer->load(w);
        m.transformer->eval();
        if (dtype != torch::kFloat) m.transformer->to(dtype);
        bool has_vae = false;
        for (const auto& [n, t] : file.all()) has_vae = has_vae || n.rfind("first_stage_model.", 0) == 0;
        if (has_vae) {
            VaeConfig base = detect_ldm_vae_config(file.with_prefix_stripped("first_stage_model."));
            // Not visible in shapes: the SD 3 / 3.5 VAE's latent statistics (its diffusers config.json).
            base.scaling_factor = 1.5305;
            base.shift_factor = 0.0609;
            m.vae = load_vae_file(path, base, dtype);
        }
        return m;
    }
    if (fs::exists(p / "config.json")) { // a transformer folder on its own
        m.transformer = load_sd3_transformer_folder(path, dtype);
        return m;
    }
    if (!fs::is_directory(p / "transformer"))
        throw Error("SD3 model folder '" + path + "' has no transformer/ (an SD3Transformer2DModel folder)");
    m.transformer = load_sd3_transformer_folder((p / "transformer").string(), dtype);
    if (fs::is_directory(p / "vae")) m.vae = load_vae_folder((p / "vae").string(), dtype);
    if (load_t5 && fs::is_directory(p / "text_encoder_3")) {
        if (!fs::is_directory(p / "tokenizer_3"))
            throw Error("SD3 model folder '" + path + "' has text_encoder_3/ but no tokenizer_3/");
        m.tokenizer_3 = T5Tokenizer::from_folder((p / "tokenizer_3").string());
        m.text_encoder_3 = load_t5_encoder_folder((p / "text_encoder_3").string(), dtype);
        const int64_t joint = m.transformer->config().joint_attention_dim;
        if (m.text_encoder_3->config().d_model != joint)
            throw Error("'" + (p / "text_encoder_3").string() + "': T5 width d_model " +
                        std::to_string(m.text_encoder_3->config().d_model) +
                        " is not the transformer's joint_attention_dim " + std::to_string(joint));
    }
    for (auto [te, tok, name, pad] : {std::tuple{&m.text_encoder, &m.tokenizer, "text_encoder", ClipTokenizer::kEos},
                                      std::tuple{&m.text_encoder_2, &m.tokenizer_2, "text_encoder_2", int64_t(0)}}) {
        if (!fs::is_directory(p / name)) continue;
        *te = load_text_encoder_folder((p / name).string(), dtype);
        if ((*te)->config().projection_dim <= 0)
            throw Error("'" + (p / name).string() + "': SD 3 needs a CLIPTextModelWithProjection (projection_dim)");
        const fs::path tdir = p / (std::string("tokenizer") + (name == std::string("text_encoder") ? "" : "_2"));
        *tok = fs::exists(tdir / "vocab.json") ? ClipTokenizer::from_folder(tdir.string()) : ClipTokenizer::bundled();
        if (!fs::exists(tdir / "vocab.json")) {
            tok->set_pad_id(pad);
            if (fs::is_directory(tdir)) tok->read_special_tokens(tdir.string());
        }
    }
    if (fs::exists(p / "scheduler" / "scheduler_config.json"))
        m.scheduler_config = (p / "scheduler" / "scheduler_config.json").string();
    return m;
}

namespace {
// One CLIP encoder's (hidden [B, 77, width], pooled [B, projection]) of `prompts`.
ClipConditioning clip_encode(ClipTextModelImpl& te, const ClipTokenizer& tok, const std::vector<std::string>& prompts) {
    std::vector<torch::Tensor> ids;
    for (const auto& p : prompts) ids.push_back(torch::tensor(tok.tokenize(p, 77).ids, torch::kLong));
    torch::NoGradGuard ng;
    return te.encode_penultimate(torch::stack(ids));
}
} // namespace

SD3Conditioning sd3_encode_prompts(SD3Models& m, const std::vector<std::string>& prompts,
                                   const std::vector<std::string>& negative_prompts, double guidance_scale,
                                   int max_sequence_length) {
    if (!m.text_encoder || !m.text_encoder_2)
        throw ParamError("model",
                         "'" + m.source + "' has no text_encoder/ and text_encoder_2/ (CLIP with projections)");
    if (!negative_prompts.empty() && negative_prompts.size() != prompts.size())
        throw ParamError("negative_prompt", std::to_string(negative_prompts.size()) + " negative prompts for " +
                                                std::to_string(prompts.size()) + " prompts");
    const int64_t joint = m.transformer->config().joint_attention_dim;
    auto encode = [&](const std::vector<std::string>& ps, torch::Tensor& embeds, torch::Tensor& pooled) {
        const auto a = clip_encode(*m.text_encoder, m.tokenizer, ps);
        const auto b = clip_encode(*m.text_encoder_2, m.tokenizer_2, ps);
        auto clip = torch::cat({a.hidden, b.hidden}, -1);
        if (clip.size(-1) > joint)
            throw Error("SD 3 text encoders: hidden widths " + std::to_string(a.hidden.size(-1)) + " + " +
                        std::to_string(b.hidden.size(-1)) + " exceed joint_attention_dim " + std::to_string(joint));
        clip = torch::constant_pad_nd(clip, {0, joint - clip.size(-1)});
        torch::Tensor t5;
        if (m.text_encoder_3) {
            std::vector<torch::Tensor> ids;
            for (const auto& p : ps)
                ids.push_back(torch::tensor(m.tokenizer_3.tokenize(p, max_sequence_length), torch::kLong));
            torch::NoGradGuard ng;
            t5 = m.text_encoder_3->forward(torch::stack(ids)).to(clip.device(), clip.scalar_type());
        } else {
            t5 = torch::zeros({clip.size(0), clip.size(1), joint}, clip.options()); // diffusers: the CLIP window
        }
        embeds = torch::cat({clip, t5}, 1);
        pooled = torch::cat({a.pooled, b.pooled}, -1);
    };
    SD3Conditioning c;
    encode(prompts, c.prompt_embeds, c.pooled);
    if (guidance_scale > 1.0)
        encode(negative_prompts.empty() ? std::vector<std::string>(prompts.size(), "") : negative_prompts,
               c.negative_prompt_embeds, c.negative_pooled);
    return c;
}

torch::Tensor sd3_guided_velocity(SD3Transformer2DModelImpl& transformer, const torch::Tensor& latents, double t,
                                  const SD3Conditioning& cond, double guidance_scale) {
    const bool cfg = guidance_scale > 1.0;
    const auto in = cfg ? torch::cat({latents, latents}, 0) : latents;
    const auto ctx = cfg ? torch::cat({cond.negative_prompt_embeds, cond.prompt_embeds}, 0) : cond.prompt_embeds;
    const auto pooled = cfg ? torch::cat({cond.negative_pooled, cond.pooled}, 0) : cond.pooled;
    const auto ts = torch::full({in.size(0)}, float(t), torch::kFloat);
    auto v = transformer.forward(in, ctx, pooled, ts);
    if (!cfg) return v;
    auto parts = v.chunk(2, 0);
    return parts[0] + guidance_scale * (parts[1] - parts[0]);
}

torch::Tensor sd3_denoise(SD3Transformer2DModelImpl& transformer, Scheduler& scheduler, torch::Tensor latents,
                          const SD3Conditioning& cond, double guidance_scale, const SD3StepCallback& on_step) {
    for (int i = scheduler.begin_index(); i < scheduler.num_loop_steps(); ++i) {
        const auto v = sd3_guided_velocity(transformer, scheduler.scale_model_input(latents, i), scheduler.timestep(i),
                                           cond, guidance_scale);
        latents = scheduler.step(v, i, latents, nullptr);
        if (on_step) on_step(i, v, latents);
    }
    return latents;
}

torch::Tensor sd3_decode(AutoencoderKLImpl& vae, const torch::Tensor& latents) {
    return (vae.decode(vae.config().unscale_latents(latents)) / 2 + 0.5).clamp(0, 1);
}

} // namespace anchor::unet
