// Loading Stable Diffusion 1.x / 2.x checkpoints: a diffusers folder (unet/, vae/, text_encoder/, tokenizer/,
// scheduler/ with config.json files; fp32/fp16 safetensors, sharded or not) or an original single-file checkpoint
// (model.diffusion_model.*, first_stage_model.*, cond_stage_model.*). Single files are read through one name table
// (diffusers name -> original name, `ldm_name`) and their configs derived from tensor shapes.
#pragma once

#include "unet/clip_text.h"
#include "unet/clip_tokenizer.h"
#include "unet/lora.h"
#include "unet/name_conversion.h"
#include "unet/sd_family.h"
#include "unet/unet_model.h"
#include "unet/vae.h"

#include <torch/torch.h>

#include <optional>
#include <string>

namespace anchor {
class WeightMap;
}

namespace anchor::unet {

struct LoadOptions {
    torch::ScalarType dtype = torch::kFloat; // compute dtype; fp16/bf16 files are converted at load
    bool text_encoder = true;
    bool unet = true;
    bool vae = true;
    // Attention arithmetic of the UNet and the VAE (kernels/attention.h). Unset: the model's own choice, the
    // "attention" of anchorcache.json in a diffusers folder (written for the models this project trains, which have
    // no reference outputs to match), else Exact, which gives the reference's bits.
    std::optional<kernels::AttentionKernel> attention;
    // LoRAs merged into the UNet and text encoder after loading, in order (unet/lora.h); ParamError("loras").
    std::vector<LoraSpec> loras;
};

// Engine settings a model folder asks for (anchorcache.json next to model_index.json); throws anchor::Error naming
// the file and field when it is malformed.
struct ModelHints {
    std::optional<kernels::AttentionKernel> attention;
};
ModelHints read_model_hints(const std::string& model_dir);

struct SDModels {
    std::string source; // the path given
    // The file that identifies the model (its SHA-256 is A1111's "Model hash"): the single-file checkpoint, or the
    // UNet's (first) weight file of a diffusers folder.
    std::string weights_file;
    std::string layout;              // "diffusers" | "single-file"
    SdFamily family = SdFamily::SD1; // from tensor shapes only (unet/sd_family.h)
    ClipTokenizer tokenizer;
    ClipTextModel text_encoder{nullptr};
    UNet2DConditionModel unet{nullptr};
    AutoencoderKL vae{nullptr};
    std::string scheduler_config_path; // diffusers scheduler/scheduler_config.json, empty when there is none
    kernels::AttentionKernel attention = kernels::AttentionKernel::Exact; // in effect (LoadOptions::attention)
    std::vector<LoraApplied> loras;                                       // merged into the weights (unet/lora.h)
    int vae_scale_factor() const { return vae ? vae->config().spatial_factor() : 8; }
};

// `path`: a diffusers folder, a single-file checkpoint (.safetensors), or a folder holding exactly one single-file
// checkpoint. Throws anchor::Error naming the file and listing every missing tensor.
SDModels load_sd_models(const std::string& path, const LoadOptions& opts = {});

// One diffusers component folder (config.json + weights: an index, model.safetensors /
// diffusion_pytorch_model.safetensors, or their .fp16 variants).
UNet2DConditionModel load_unet_folder(const std::string& dir, torch::ScalarType dtype = torch::kFloat);
AutoencoderKL load_vae_folder(const std::string& dir, torch::ScalarType dtype = torch::kFloat);
ClipTextModel load_text_encoder_folder(const std::string& dir, torch::ScalarType dtype = torch::kFloat);

} // namespace anchor::unet
