// AUTOMATIC1111's "Hires. fix" (modules/processing.py StableDiffusionProcessingTxt2Img: calculate_target_resolution,
// sample, sample_hr_pass): txt2img at the base size, the result enlarged (the latents interpolated, or decoded,
// resized and encoded again), then img2img at the target size with strength `denoise`, the second pass's noise drawn
// from the image's seed again. Both passes are ordinary Txt2ImgPipeline runs, so every cache mode, ControlNet, LoRA
// and sampler applies to both; the second pass is diffusers' img2img (a 4-channel `image` for the latent upscalers),
// which runs int(steps * denoise) steps of a steps-long schedule, as A1111 with img2img_fix_steps off.
#pragma once

#include "unet/pipeline/hires_params.h"
#include "unet/pipeline/infotext.h"
#include "unet/pipeline/pipeline.h"

#include <nlohmann/json.hpp>

#include <optional>
#include <string>

namespace anchor::unet {

// The sizes of a hires run, as A1111's calculate_target_resolution with the VAE factor f for its 8: the target
// int(width * scale) x int(height * scale) rounded down to a multiple of f (A1111 interpolates the latents to
// target // 8 and its VAE floors odd sizes the same way), or hr_resize_x / hr_resize_y (multiples of f); with both
// of another aspect than the base, the upscale covers the target and `crop` latent cells are cut, crop / 2 before and
// the rest after (A1111's truncate_x / truncate_y).
struct HiresPlan {
    int width = 0, height = 0;                 // the output image
    int upscale_width = 0, upscale_height = 0; // what the upscale makes (the output size plus the crop)
    int crop_x = 0, crop_y = 0;                // latent cells cut after the upscale
    int steps = 0;                             // the second pass's schedule length
};
// ParamError naming the field (hires_scale, hires_width, hires_height, hires_steps, hires_denoise) for a setting that
// cannot run: scale <= 0 or not finite, a size not a multiple of f, a target below f, denoise outside (0, 1] or
// leaving no step.
HiresPlan hires_plan(const HiresParams& h, int width, int height, int steps, int vae_factor);

// Txt2ImgPipeline::validate's part: the plan, the upscaler (an ESRGAN file readable), and no init image (the hires
// fix is txt2img's).
void validate_hires(const Txt2ImgParams& p, int vae_factor);

// What passed between the two passes (golden checks, debugging).
struct HiresStages {
    HiresPlan plan;
    torch::Tensor base_latents;         // the first pass's final latents
    torch::Tensor base_image_uint8;     // pixel upscalers: the first pass's image as A1111 makes it (truncated)
    torch::Tensor upscaled_latents;     // latent upscalers: the second pass's init latents (after the crop)
    torch::Tensor upscaled_image_uint8; // pixel upscalers: the second pass's init images [B, H, W, 3]
    int first_pass_full_steps = 0, first_pass_steps = 0;
};

// Both passes of `p` (p.hires.enabled; Txt2ImgPipeline::run calls this for such params). `ctl` serves both passes,
// each from its own begin() (a fresh cache state per pass). The result is the second pass's, with full_steps and
// total_steps, text_s, denoise_s and decode_s the sums over both passes and initial_noise the first pass's.
Txt2ImgResult run_hires(Txt2ImgPipeline& pipe, const Txt2ImgParams& p, DenoiseController* ctl = nullptr,
                        const Txt2ImgPipeline::ProgressFn& progress = {}, const Txt2ImgPipeline::StepFn& on_step = {},
                        const SchedulerConfig* sched_cfg = nullptr, HiresStages* stages = nullptr);

// The ESRGAN upscaler's call (unet/pipeline/hires_model_upscale.cpp): rgb01 [N, 3, H, W] in [0, 1] -> the model's
// output, [N, 3, s H, s W] in [0, 1].
torch::Tensor hires_model_upscale(const std::string& model_path, const torch::Tensor& rgb01);

// The --hires-upscaler names (latent, latent-antialiased, latent-bicubic, latent-bicubic-antialiased,
// latent-nearest, latent-nearest-exact, lanczos).
const EnumTable<HiresUpscaler>& hires_upscaler_table();
// A --hires-upscaler value or an A1111 name ("Latent (nearest)", "Lanczos"): a built-in one, else an ESRGAN file
// (HiresUpscaler::Model with the path).
void parse_hires_upscaler(const std::string& s, HiresParams& h);
// A1111's name of the upscaler ("Latent", "Latent (nearest)", "Lanczos", the model file's stem).
std::string hires_upscaler_a1111_name(const HiresParams& h);

// The infotext fields A1111 writes for a hires run, after the others of create_infotext's extra_generation_params
// ("Hires upscale" or "Hires resize", "Hires steps" when set, "Hires upscaler"); "Denoising strength" is set by
// infotext_of.
void add_hires_infotext(const HiresParams& h, Infotext& t);
// The hires settings an infotext names ("Hires upscale" / "Hires resize" present), with `denoise` its Denoising
// strength; notes for values it cannot use.
std::optional<HiresParams> hires_from_infotext(const Infotext& t, std::vector<std::string>& notes);
// Our JSON record's "hires" object and back.
nlohmann::json hires_record(const HiresParams& h, const HiresPlan& plan);
HiresParams hires_from_record(const nlohmann::json& j);

} // namespace anchor::unet
