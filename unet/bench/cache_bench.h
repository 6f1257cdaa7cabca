// The cache benchmark (`anchor-sd bench-cache`): every cache mode against the first (off) in one run, same seeds,
// interleaved repeats, through the txt2img pipeline itself (no second denoising loop).
//
// * A real model: the whole pipeline over prompts x seeds; PSNR/SSIM of the images vs the first mode.
// * A random-weight UNet (random_unet_models: no download; text conditioning drawn at random, no VAE): the pipeline
//   stops at the final latents, on the CPU or a CUDA device; PSNR of the final latents vs the first mode (a
//   consistency figure, not an image-quality one).
// Per mode: full steps, analytic MACs per step (the controllers' per-step records), wall seconds min/median/max
// over the interleaved runs of the denoising loop and of the whole image (text encoder, loop, decode), and the
// speed-ups of the medians.
#pragma once

#include "unet/cache/cache_config.h"
#include "unet/model/checkpoint.h"
#include "unet/pipeline/pipeline.h"

#include <nlohmann/json.hpp>

#include <functional>
#include <string>
#include <vector>

namespace anchor::unet {

struct CacheBenchParams {
    std::vector<CacheConfig> modes;   // cache modes; the first is the reference
    Txt2ImgParams base;               // sampler, steps, guidance, size, device, seed of the first run
    std::vector<std::string> prompts; // real models: one run per prompt and seed
    int seeds = 1;                    // seeds per prompt: base.seed, base.seed + 1, ...
    int repeat = 1;                   // interleaved runs of every mode per (prompt, seed)
    void validate() const;            // ParamError naming the field
};

struct CacheBenchMode {
    std::string mode; // the mode as the user wrote it (CacheConfig::label)
    std::vector<double> wall_s;  // the denoising loop
    std::vector<double> image_s; // the whole txt2img call: prompt encoding, the loop, the VAE decode
    int full_steps = 0, total_steps = 0;
    double macs_per_step = 0;       // per sample, mean over the loop
    int64_t d2h_scalars_per_step = 0; // the most device-to-host reads of one step's cache decision (host_read)
    std::vector<double> psnr, ssim; // vs the first mode, per run (ssim empty for latents)
};

struct CacheBenchReport {
    std::string setup;
    bool images = true; // PSNR/SSIM of images (real model) or latent PSNR (random weights)
    std::vector<CacheBenchMode> modes;
    nlohmann::json to_json() const;
    std::string table() const; // the printed table (one line per mode)
};

// A UNet with random weights (and nothing else) on `device`: the SD 1.5 shapes unless `cfg` says otherwise.
SDModels random_unet_models(const UNetConfig& cfg, uint64_t seed, torch::Device device);

// Runs the benchmark; `log` hears progress lines. Random-weight models (no text encoder) get random text
// conditioning from `base.seed`.
CacheBenchReport run_cache_bench(Txt2ImgPipeline& pipe, const CacheBenchParams& p,
                                 const std::function<void(const std::string&)>& log = {});

} // namespace anchor::unet
