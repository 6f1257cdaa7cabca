// Stable Diffusion 3 / 3.5 text-to-image denoising from given text embeddings: the loop of diffusers'
// StableDiffusion3Pipeline.__call__ (0.31) with prompt_embeds / pooled_prompt_embeds supplied. Classifier-free
// guidance (Ho & Salimans 2022) runs one transformer call on the batch [negative rows; positive rows] and combines
// v = v_uncond + w (v_text - v_uncond); the scheduler is the flow-matching Euler (unet/samplers/flow_match_euler.cpp);
// the VAE decodes z / scaling_factor + shift_factor. The text encoders (CLIP-L, OpenCLIP bigG, T5) are not here.
#pragma once

#include "unet/model/mmdit.h"
#include "unet/model/sd_family.h"
#include "unet/model/vae.h"
#include "unet/samplers/scheduler.h"

#include <torch/torch.h>

#include <functional>
#include <string>

namespace anchor::unet {

// An SD 3 diffusers pipeline folder (model_index.json, transformer/, vae/, scheduler/), a transformer folder alone, or
// an original single file (sd3.5_medium.safetensors: model.diffusion_model.joint_blocks.N..., first_stage_model.*;
// its text encoders are not loaded); through the one resolver. family is SdFamily::SD3.
struct SD3Models {
    std::string source;
    SdFamily family = SdFamily::SD3;
    SD3Transformer2DModel transformer{nullptr};
    AutoencoderKL vae{nullptr};   // null when the folder has none
    std::string scheduler_config; // scheduler/scheduler_config.json, empty when there is none
};
// Throws anchor::Error naming the path and the missing part.
SD3Models load_sd3_models(const std::string& path, torch::ScalarType dtype = torch::kFloat);

// The conditioning of a run: positive and negative text embeddings [B, T, joint_attention_dim] and pooled embeddings
// [B, pooled_projection_dim]. Without guidance (guidance_scale <= 1, as diffusers' do_classifier_free_guidance) the
// negative ones are not used.
struct SD3Conditioning {
    torch::Tensor prompt_embeds, pooled, negative_prompt_embeds, negative_pooled;
};

// The guided velocity at latents [B, C, h, w] and timestep t.
torch::Tensor sd3_guided_velocity(SD3Transformer2DModelImpl& transformer, const torch::Tensor& latents, double t,
                                  const SD3Conditioning& cond, double guidance_scale);

// Runs every step of `scheduler` (set_timesteps already called) from `latents`; `on_step(i, guided velocity, latents
// after step i)` when given. Returns the final latents.
using SD3StepCallback = std::function<void(int, const torch::Tensor&, const torch::Tensor&)>;
torch::Tensor sd3_denoise(SD3Transformer2DModelImpl& transformer, Scheduler& scheduler, torch::Tensor latents,
                          const SD3Conditioning& cond, double guidance_scale, const SD3StepCallback& on_step = {});

// The image in [0, 1] of final latents: (vae.decode(z / scaling_factor + shift_factor) / 2 + 0.5).clamp(0, 1).
torch::Tensor sd3_decode(AutoencoderKLImpl& vae, const torch::Tensor& latents);

} // namespace anchor::unet
