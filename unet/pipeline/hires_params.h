// The settings of AUTOMATIC1111's "Hires. fix" (txt2img at the base size, an upscale, img2img at the target size):
// a plain struct that Txt2ImgParams holds, so that the run, its record and its infotext see it. What runs is in
// unet/pipeline/hires.h.
#pragma once

#include <string>

namespace anchor::unet {

// How the first pass's result is enlarged (A1111's hr_upscaler names in brackets).
enum class HiresUpscaler {
    // The latents through torch's interpolate (A1111's shared.latent_upscale_modes): "Latent" = bilinear,
    // "Latent (antialiased)", "Latent (bicubic)", "Latent (bicubic antialiased)", "Latent (nearest)",
    // "Latent (nearest-exact)"; align_corners off.
    Latent,
    LatentAntialiased,
    LatentBicubic,
    LatentBicubicAntialiased,
    LatentNearest,
    LatentNearestExact,
    Lanczos,       // "Lanczos": VAE decode, uint8, PIL's Lanczos resize, VAE encode
    Model,         // an ESRGAN model file (its stem is A1111's upscaler name): decode, model, Lanczos, encode
};

// ParamError fields: "hires_scale", "hires_width", "hires_height", "hires_steps", "hires_denoise",
// "hires_upscaler".
struct HiresParams {
    bool enabled = false;
    // The target: width x height x scale (A1111's hr_scale), or A1111's hr_resize_x / hr_resize_y when either is set
    // (one of them: the other follows the base aspect; both: the upscale covers them and the latents are cropped to
    // them, centred).
    double scale = 2.0;
    int width = 0, height = 0;
    int steps = 0;         // the second pass's steps (hr_second_pass_steps); 0 = the first pass's
    double denoise = 0.7;  // the second pass's strength (denoising_strength), in (0, 1]
    HiresUpscaler upscaler = HiresUpscaler::Latent;
    std::string model;     // the ESRGAN file of HiresUpscaler::Model
};

} // namespace anchor::unet
