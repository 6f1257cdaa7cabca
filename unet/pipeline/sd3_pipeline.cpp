// The SD 3 denoising loop (unet/pipeline/sd3_pipeline.h).
#include "unet/pipeline/sd3_pipeline.h"

#include "cache/io/error.h"
#include "cache/io/model_source.h"
#include "unet/model/checkpoint.h"

#include <filesystem>

namespace anchor::unet {

namespace fs = std::filesystem;

SD3Models load_sd3_models(const std::string& path, torch::ScalarType dtype) {
    SD3Models m;
    m.source = path;
    const fs::path p(path);
    if (!fs::is_directory(p)) throw Error("SD3 model '" + path + "' is not a folder (single-file SD3 checkpoints are not supported yet)");
    if (fs::exists(p / "config.json")) { // a transformer folder on its own
        m.transformer = load_sd3_transformer_folder(path, dtype);
        return m;
    }
    if (!fs::is_directory(p / "transformer"))
        throw Error("SD3 model folder '" + path + "' has no transformer/ (an SD3Transformer2DModel folder)");
    m.transformer = load_sd3_transformer_folder((p / "transformer").string(), dtype);
    if (fs::is_directory(p / "vae")) m.vae = load_vae_folder((p / "vae").string(), dtype);
    if (fs::exists(p / "scheduler" / "scheduler_config.json"))
        m.scheduler_config = (p / "scheduler" / "scheduler_config.json").string();
    return m;
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
