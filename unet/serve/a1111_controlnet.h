// ControlNet from the A1111 API: the sd-webui-controlnet extension's `alwayson_scripts.controlnet.args`, one object per
// unit (enabled, image / {"image", "mask"}, model, weight, guidance_start, guidance_end, control_mode, module,
// processor_res, ...), read into the pipeline's ControlParams (unet/pipeline/control.h). Models are named as the
// extension lists them, "control_v11p_sd15_canny [d14c016b]": the name before the bracketed hash is looked up in the
// server's --control-net-dir (a single file by its stem, or a diffusers folder by its name), loaded once and kept.
#pragma once

#include "unet/model/checkpoint.h"
#include "unet/pipeline/control.h"

#include <nlohmann/json.hpp>

#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace anchor::unet {

class ControlNetLibrary {
public:
    ControlNetLibrary() = default;
    explicit ControlNetLibrary(std::string dir) : dir_(std::move(dir)) {}
    bool empty() const { return dir_.empty(); }
    const std::string& dir() const { return dir_; }
    // The ControlNets of the folder: name -> path (files .safetensors / .pth / .ckpt / .pt by stem, folders with a
    // config.json by name).
    std::map<std::string, std::string> models() const;
    // `model` ("NAME [hash]", "NAME", or NAME with its extension) -> its path; empty when the folder has none.
    std::string resolve(const std::string& model) const;
    // The ControlNet at `path`, loaded at its first use in the UNet's dtype, device and kernels, then kept.
    ControlNetModel get(const std::string& path, const SDModels& models);

private:
    std::string dir_;
    std::mutex mu_;
    std::map<std::string, ControlNetModel> loaded_;
};

// The enabled units of a request body's alwayson_scripts.controlnet.args (none when absent). `decode` turns a
// base64 image of field `field` into uint8 [H, W, 3] pixels. A unit that cannot run is serve::HttpError 422 naming
// its field ("alwayson_scripts.controlnet.args[1].model"): an unknown or missing model, no image, a weight or
// guidance range out of bounds, a control mode or module this engine does not run. `init_image` (uint8 [H, W, 3], an
// img2img request's first init image; undefined for txt2img) is the control image of a unit that sends none, as the
// extension's choose_input_image falls back to A1111's img2img input image.
std::vector<ControlParams>
a1111_control_units(const nlohmann::json& body, ControlNetLibrary& lib, const SDModels& models,
                    const std::function<torch::Tensor(const std::string& b64, const std::string& field)>& decode,
                    const torch::Tensor& init_image = {});

} // namespace anchor::unet
