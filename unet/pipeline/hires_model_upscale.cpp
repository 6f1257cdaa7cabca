// The hires fix's ESRGAN call site (hires.h hires_model_upscale): the RRDBNet of unet/model/esrgan.h run by
// unet/pipeline/upscale.h's tiled esrgan_upscale on the [N, 3, H, W] image in [0, 1].
#include "unet/model/esrgan.h"
#include "unet/pipeline/hires.h"
#include "unet/pipeline/upscale.h"

#include <memory>
#include <mutex>

namespace anchor::unet {

torch::Tensor hires_model_upscale(const std::string& model_path, const torch::Tensor& rgb01) {
    // One image is upscaled up to three times per pass and a batch image by image: the last model read is kept
    // (read-only weights, so concurrent callers may share it) instead of reading the file for every call.
    static std::mutex mu;
    static std::string loaded_path;
    static std::shared_ptr<const EsrganModel> loaded;
    std::shared_ptr<const EsrganModel> model;
    {
        std::lock_guard<std::mutex> lock(mu);
        if (!loaded || loaded_path != model_path) {
            loaded = std::make_shared<const EsrganModel>(load_esrgan(model_path));
            loaded_path = model_path;
        }
        model = loaded;
    }
    torch::NoGradGuard no_grad;
    return esrgan_upscale(*model, rgb01);
}

} // namespace anchor::unet
