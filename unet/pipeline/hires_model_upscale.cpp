// The hires fix's ESRGAN call site (hires.h hires_model_upscale), alone in this file so that the ESRGAN model
// (unet/model/esrgan.h, unet/pipeline/upscale.h) plugs in here: load_esrgan(model_path), then esrgan_upscale on the
// [N, 3, H, W] image in [0, 1]. This build has no ESRGAN model.
#include "cache/io/error.h"
#include "unet/pipeline/hires.h"

namespace anchor::unet {

torch::Tensor hires_model_upscale(const std::string& model_path, const torch::Tensor& rgb01) {
    (void)rgb01;
    throw Error("ESRGAN upscaler not built: --hires-upscaler '" + model_path +
                "' needs the ESRGAN model support; use latent, lanczos or another built-in upscaler");
}

} // namespace anchor::unet
