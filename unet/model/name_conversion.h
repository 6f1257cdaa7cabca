// Name conversion between the original single-file layout of Stable Diffusion checkpoints (CompVis/LDM:
// model.diffusion_model.*, first_stage_model.*, cond_stage_model.*; ldm.modules.diffusionmodules.openaimodel UNetModel
// and ldm.modules.diffusionmodules.model Encoder/Decoder, as diffusers' scripts/convert_diffusers_to_original_stable_
// diffusion.py writes them, see tests/golden/sd/sd15_tiny_single_file/README.md) and the diffusers names the modules
// are registered under: one module, as stable-diffusion.cpp's name_conversion.cpp. The loader converts a whole file
// with it before loading (gather, convert_open_clip), the tests check its table against the golden key map.
#pragma once

#include "unet/model/sd_family.h"
#include "unet/model/unet_model.h"
#include "unet/model/vae.h"

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
// encoder uses the SD 1.x layout (`cond_stage_model.transformer.` + HF name) or SDXL's first embedder
// (`conditioner.embedders.0.transformer.` + HF name). Throws for names the table lacks.
std::string ldm_name(Component component, const std::string& diffusers_name, const UNetConfig& unet,
                     const VaeConfig& vae, SdFamily family = SdFamily::SD1);
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

// Where an OpenCLIP text tower (SD 2.x `cond_stage_model.model.*`, SDXL `conditioner.embedders.1.model.*`) keeps a
// Hugging Face CLIPTextModel(WithProjection) tensor: its name relative to the tower, the row range of the fused
// attn.in_proj_{weight,bias} (q, k, v = rows [0, h), [h, 2h), [2h, 3h) for width h), or the transposition of
// text_projection (OpenCLIP stores [hidden, projection] and applies x @ P; HF's Linear weight is P^T).
struct OpenClipSource {
    std::string name;
    int64_t row_begin = -1, row_end = -1;
    bool transposed = false;
    std::string describe() const; // "name", "name[a:b]" or "name (transposed)" (the golden key maps' notation)
};
OpenClipSource open_clip_source(const std::string& hf_name, int64_t hidden);

struct OpenClipOptions {
    // SD 2.x: LDM's FrozenOpenCLIPEmbedder conditions on the penultimate layer through the final layer norm, so
    // diffusers drops the last resblock; SDXL keeps every layer (it reads hidden_states[-2] itself).
    bool drop_last_layer = true;
    bool projection = false; // SDXL: text_projection (the pooled embedding)
};
// An OpenCLIP text tower of `file` under `prefix` -> Hugging Face names through open_clip_source.
WeightMap convert_open_clip(const WeightMap& file, const std::string& prefix, std::set<std::string>& used,
                            const OpenClipOptions& o = {});

// Where Stability's single-file MMDiT (SD 3 / 3.5, under `model.diffusion_model.`; see
// sd3_transformer_weights_from_single_file in unet/model/mmdit.h) keeps a diffusers SD3Transformer2DModel tensor: its
// name, the row range of a fused `qkv` (q, k, v = rows [0, h), [h, 2h), [2h, 3h) for the model width h), or the
// (shift, scale) halves that diffusers keeps as (scale, shift) (norm_out and the last block's norm1_context: diffusers'
// rows [0, h) are the original's [h, 2h) and the other way round). `num_layers` tells the last block. Throws for names
// the table lacks.
struct Sd3Source {
    std::string name;
    int64_t row_begin = -1, row_end = -1;
    bool swap_halves = false;
    std::string describe() const; // "name", "name[a:b]" or "name (halves swapped)"
};
Sd3Source sd3_source(const std::string& diffusers_name, int64_t width, int num_layers);

} // namespace anchor::unet
