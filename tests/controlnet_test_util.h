// ControlNet test helpers shared by tests/test_controlnet.cpp and tests/test_controlnet_img2img.cpp.
#pragma once

#include "cache/io/safetensors.h"
#include "unet/model/controlnet.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <string>

namespace anchor::test {

// `net` (made for the UNet of `unet_config`, conditioning embedding {8, 16}) as a diffusers folder under `dir`
// (config.json + diffusion_pytorch_model.safetensors); returns the folder.
inline std::string save_controlnet_folder(const unet::ControlNetModel& net, const nlohmann::json& unet_config,
                                          const std::string& dir) {
    std::filesystem::create_directories(dir);
    NamedTensors t;
    for (const auto& kv : net->named_parameters()) t.emplace_back(kv.key(), kv.value().contiguous());
    save_safetensors(dir + "/diffusion_pytorch_model.safetensors", t);
    auto j = unet_config;
    j["_class_name"] = "ControlNetModel";
    j["conditioning_embedding_out_channels"] = {8, 16};
    j.erase("up_block_types");
    j.erase("out_channels");
    std::ofstream(dir + "/config.json") << j.dump(1);
    return dir;
}

} // namespace anchor::test
