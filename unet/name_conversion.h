// Name conversion between the original single-file layout of Stable Diffusion checkpoints (CompVis/LDM:
// model.diffusion_model.*, first_stage_model.*, cond_stage_model.*; ldm.modules.diffusionmodules.openaimodel UNetModel
// and ldm.modules.diffusionmodules.model Encoder/Decoder, as diffusers' scripts/convert_diffusers_to_original_stable_
// diffusion.py writes them, see tests/golden/sd/sd15_tiny_single_file/README.md) and the diffusers names the modules
// are registered under: one module, as stable-diffusion.cpp's name_conversion.cpp. The loader converts a whole file
// with it before loading (gather, convert_open_clip), the tests check its table against the golden key map.
#pragma once

#include "unet/unet_model.h"
#include "unet/vae.h"

#include <functional>
#include <set>
#include <string>
#include <vector>

namespace anchor {
class WeightMap;
}

namespace anchor::unet {

enum class Component { Unet, Vae, TextEncoder };

// The original-layout name of a diffusers tensor name of `component`, for a model with the given layout; the text
// encoder uses the SD 1.x layout (`cond_stage_model.transformer.` + HF name). Throws for names the table lacks.
std::string ldm_name(Component component, const std::string& diffusers_name, const UNetConfig& unet,
                     const VaeConfig& vae);
// The same without the component prefix (model.diffusion_model. / first_stage_model.).
std::string unet_ldm_name(const std::string& diffusers_name, const UNetConfig& c);
std::string vae_ldm_name(const std::string& diffusers_name, const VaeConfig& c);

// Configs from original-layout tensor shapes (names without the `model.diffusion_model.` / `first_stage_model.`
// prefixes).
UNetConfig detect_ldm_unet_config(const WeightMap& ldm_unet);
VaeConfig detect_ldm_vae_config(const WeightMap& ldm_vae);

// A diffusers-named map for `module` from the original-layout names of `file` (`to_ldm` maps each parameter name,
// `prefix` is the component prefix): every parameter absent from the file is appended to `missing` (named by `what`,
// its expected original name and shape), every file name consumed to `used`. LDM's [C, C, 1, 1] attention
// convolutions of the VAE become diffusers' [C, C] linears.
WeightMap gather(const WeightMap& file, torch::nn::Module& module,
                 const std::function<std::string(const std::string&)>& to_ldm, const std::string& prefix,
                 const std::string& what, std::vector<std::string>& missing, std::set<std::string>& used);

// OpenCLIP text encoder (SD 2.x `cond_stage_model.model.*`) -> Hugging Face CLIPTextModel names, q/k/v split out of
// in_proj; the last resblock is dropped (LDM's FrozenOpenCLIPEmbedder uses the penultimate layer, as diffusers does).
WeightMap convert_open_clip(const WeightMap& file, const std::string& prefix, std::set<std::string>& used);

} // namespace anchor::unet
