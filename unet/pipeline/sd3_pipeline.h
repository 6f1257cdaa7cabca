// Stable Diffusion 3 / 3.5 text-to-image: the loop of diffusers' StableDiffusion3Pipeline.__call__ (0.31), from text
// embeddings or from prompts through the two CLIP encoders and T5 (sd3_encode_prompts). Classifier-free
// guidance (Ho & Salimans 2022) runs one transformer call on the batch [negative rows; positive rows] and combines
// v = v_uncond + w (v_text - v_uncond); the scheduler is the flow-matching Euler (unet/samplers/flow_match_euler.cpp);
// the VAE decodes z / scaling_factor + shift_factor.
#pragma once

#include "unet/model/clip_text.h"
#include "unet/model/clip_tokenizer.h"
#include "unet/model/mmdit.h"
#include "unet/model/sd_family.h"
#include "unet/model/t5_encoder.h"
#include "unet/model/t5_tokenizer.h"
#include "unet/model/vae.h"
#include "unet/samplers/scheduler.h"

#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

namespace anchor::unet {

// An SD 3 diffusers pipeline folder (model_index.json, transformer/, vae/, scheduler/), a transformer folder alone, or
// an original single file (sd3.5_medium.safetensors: model.diffusion_model.joint_blocks.N..., first_stage_model.*;
// its text encoders are not loaded); through the one resolver. family is SdFamily::SD3. load_t5 false leaves a
// folder's text_encoder_3/ unread (--no-t5: diffusers' zeros in its place, without T5-XXL's memory).
struct SD3Models {
    std::string source;
    SdFamily family = SdFamily::SD3;
    SD3Transformer2DModel transformer{nullptr};
    AutoencoderKL vae{nullptr};   // null when the folder has none
    std::string scheduler_config; // scheduler/scheduler_config.json, empty when there is none
    // The CLIP text encoders with projections of a pipeline folder (CLIP-L's and OpenCLIP bigG's roles) and their
    // tokenizers (tokenizer pads with <|endoftext|>, tokenizer_2 with "!" unless their configs say otherwise); null
    // when the folder has none.
    ClipTokenizer tokenizer, tokenizer_2;
    ClipTextModel text_encoder{nullptr}, text_encoder_2{nullptr};
    // T5 (text_encoder_3 / tokenizer_3, SentencePiece); null when absent or not loaded: zeros stand in for it.
    T5EncoderModel text_encoder_3{nullptr};
    T5Tokenizer tokenizer_3;
    int vae_scale_factor() const { return vae ? vae->config().spatial_factor() : 8; }
};
// Throws anchor::Error naming the path and the missing part.
SD3Models load_sd3_models(const std::string& path, torch::ScalarType dtype = torch::kFloat, bool load_t5 = true);

// The conditioning of a run: positive and negative text embeddings [B, T, joint_attention_dim] and pooled embeddings
// [B, pooled_projection_dim]. Without guidance (guidance_scale <= 1, as diffusers' do_classifier_free_guidance) the
// negative ones are not used.
struct SD3Conditioning {
    torch::Tensor prompt_embeds, pooled, negative_prompt_embeds, negative_pooled;
};

// diffusers' StableDiffusion3Pipeline.encode_prompt (0.31): per CLIP encoder the 77-token ids, the penultimate
// hidden state (no final LayerNorm) and the projected EOS embedding; the two hidden states concatenated on channels
// and zero-padded to joint_attention_dim, then T5's last hidden state of `max_sequence_length` tokens (tokenizer_3
// pads / truncates to it) or, without text_encoder_3, as many zero tokens as the CLIP window (77); pooled = the two
// projections concatenated. The negative prompts ("" when empty) likewise when guidance_scale > 1.
// ParamError("model") when the models have no text encoders.
SD3Conditioning sd3_encode_prompts(SD3Models& m, const std::vector<std::string>& prompts,
                                   const std::vector<std::string>& negative_prompts, double guidance_scale,
                                   int max_sequence_length = 256);

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
