// Stable Diffusion 3 / 3.5 text-to-image: the loop of diffusers' StableDiffusion3Pipeline.__call__ (0.31), from text
// embeddings or from prompts through the two CLIP encoders and T5 (sd3_encode_prompts). Classifier-free
// guidance (Ho & Salimans 2022) runs one transformer call on the batch [negative rows; positive rows] and combines
// v = v_uncond + w (v_text - v_uncond); the scheduler is the flow-matching Euler (unet/samplers/flow_match_euler.cpp);
// the VAE decodes z / scaling_factor + shift_factor.
#pragma once

#include "unet/cache/cache_config.h"
#include "unet/cache/cache_controller.h"
#include "unet/model/clip_text.h"
#include "unet/model/clip_tokenizer.h"
#include "unet/model/lora.h"
#include "unet/model/mmdit.h"
#include "unet/model/sd_family.h"
#include "unet/model/t5_encoder.h"
#include "unet/model/t5_tokenizer.h"
#include "unet/model/vae.h"
#include "unet/pipeline/img2img.h"
#include "unet/samplers/scheduler.h"

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace anchor::unet {

class DitCacheController;

// An SD 3 diffusers pipeline folder (model_index.json, transformer/, vae/, scheduler/), a transformer folder alone, or
// an original single file (sd3.5_medium.safetensors: model.diffusion_model.joint_blocks.N..., first_stage_model.*,
// text_encoders.{clip_l,clip_g,t5xxl}.transformer.* when it has them); through the one resolver. family is SdFamily::SD3. load_t5 false leaves a
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
    std::vector<LoraApplied> loras; // merged into the weights (apply_sd3_loras, unet/model/lora_sd3.h)
    int vae_scale_factor() const { return vae ? vae->config().spatial_factor() : 8; }
};
// Throws anchor::Error naming the path and the missing part.
SD3Models load_sd3_models(const std::string& path, torch::ScalarType dtype = torch::kFloat, bool load_t5 = true);
// The same, a single file's text encoders and tokenizers from it or from `text_encoders_dir` (--text-encoders: an SD
// 3 diffusers folder or Stability's text_encoders/ folder; empty: none), load_sd3_text_encoders
// (unet/model/sd3_text_encoders.h). A folder model takes its own encoders: a non-empty dir is refused for it.
SD3Models load_sd3_models(const std::string& path, torch::ScalarType dtype, bool load_t5,
                          const std::string& text_encoders_dir);

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

// Skip-layer guidance (SD 3.5 Medium's; diffusers >= 0.32 skip_guidance_layers): at step i of n, with classifier-free
// guidance and start * n < i < stop * n, the transformer runs once more on the positive rows without the listed
// blocks, and v = v_cfg + (v_text - v_skip) * scale. No layers: off.
struct SD3SkipLayerGuidance {
    std::vector<int> layers;
    double scale = 2.8, start = 0.01, stop = 0.2;
    bool active(int step, int steps) const {
        return !layers.empty() && step > steps * start && step < steps * stop;
    }
};

// The guided velocity at latents [B, C, h, w] and timestep t; with `slg` active at step `step` of `steps`, its
// extra term. With `cache` the guided batch's transformer call is the cache mode's (unet/cache/dit_cache.h); the
// skip-layer call always runs every block but the skipped ones.
torch::Tensor sd3_guided_velocity(SD3Transformer2DModelImpl& transformer, const torch::Tensor& latents, double t,
                                  const SD3Conditioning& cond, double guidance_scale,
                                  const SD3SkipLayerGuidance& slg = {}, int step = 0, int steps = 1,
                                  DitCacheController* cache = nullptr);

// Runs every step of `scheduler` (set_timesteps already called) from `latents`; `on_step(i, guided velocity, latents
// after step i)` when given. Returns the final latents.
using SD3StepCallback = std::function<void(int, const torch::Tensor&, const torch::Tensor&)>;
torch::Tensor sd3_denoise(SD3Transformer2DModelImpl& transformer, Scheduler& scheduler, torch::Tensor latents,
                          const SD3Conditioning& cond, double guidance_scale, const SD3StepCallback& on_step = {},
                          const SD3SkipLayerGuidance& slg = {}, DitCacheController* cache = nullptr);

// The image in [0, 1] of final latents: (vae.decode(z / scaling_factor + shift_factor) / 2 + 0.5).clamp(0, 1).
torch::Tensor sd3_decode(AutoencoderKLImpl& vae, const torch::Tensor& latents);

// Whether `path` is an SD 3 / 3.5 model load_sd3_models reads: a StableDiffusion3Pipeline folder (model_index.json
// or transformer/config.json naming SD3Transformer2DModel), an SD3Transformer2DModel folder, or a single
// .safetensors file with model.diffusion_model.joint_blocks.0 (only its header is read).
bool is_sd3_model(const std::string& path);

// The scheduler of a run: the folder's scheduler config (FlowMatchEulerDiscreteScheduler; SD 3's own, shift 3, when
// the model has none), `shift` > 0 replacing its shift, dynamic shifting's mu from the latents' token count
// (diffusers' calculate_shift), set_timesteps(steps).
// `shift_used`, when given, receives the shift in effect.
std::unique_ptr<Scheduler> sd3_make_scheduler(const SD3Models& m, int steps, int64_t latent_h, int64_t latent_w,
                                              double shift = -1, double* shift_used = nullptr);

// A text-to-image run as diffusers' StableDiffusion3Pipeline.__call__ with output_type "pt": the prompts' conditioning,
// initial latents randn([B, 16, H/8, W/8]) from a CPU generator seeded `seed` (torch.Generator().manual_seed), the
// flow-matching loop, the VAE decode.
struct SD3Txt2ImgParams {
    std::vector<std::string> prompts;          // one image each
    std::vector<std::string> negative_prompts; // empty: "" for each
    int steps = 28;                            // diffusers' default
    double guidance_scale = 7.0;               // <= 1: no classifier-free guidance
    int64_t seed = 0;
    int width = 0, height = 0;    // 0: the transformer's sample_size x the VAE factor (1024 for SD 3 / 3.5)
    int max_sequence_length = 256; // T5's tokens
    double shift = -1;             // > 0: replaces the scheduler config's shift
    SD3SkipLayerGuidance slg;      // off unless layers are listed
    CacheConfig cache;             // off, freq, fbcache, teacache, taylorseer (unet/cache/dit_cache.h)
    // img2img (diffusers' StableDiffusion3Img2ImgPipeline, 0.31) when init images are given: the size is the init
    // image's rounded down to the VAE factor (width / height, when given, must equal it); masks are refused.
    Img2ImgParams init;
    bool record_teacache = false; // off only: TeaCache's calibration samples into the result
};

// StableDiffusion3Img2ImgPipeline.get_timesteps: t_start = int(max(steps - steps * strength, 0)) in float64 (SD 1.x's
// pipeline truncates steps * strength first instead); the loop runs steps - t_start steps from loop step t_start.
// ParamError("strength") outside (0, 1] or when no step would run.
int sd3_img2img_start(int steps, double strength);

// prepare_latents of the img2img pipeline: the init images [N, 3, H, W] in [-1, 1] through the VAE encoder, the
// posterior sampled with one draw of `gen` (mean + std * randn), (z - shift_factor) * scaling_factor, tiled to
// `batch` (image b from init image b mod N), then a second draw `noise` of that shape and the scheduler's
// scale_noise at loop step `begin`: sigma * noise + (1 - sigma) * latents. Float32 on the CPU; `image_latents` and
// `noise`, when given, receive the two tensors.
torch::Tensor sd3_img2img_latents(AutoencoderKLImpl& vae, const torch::Tensor& image, int64_t batch,
                                  const Scheduler& scheduler, int begin, torch::Generator& gen,
                                  torch::Tensor* image_latents = nullptr, torch::Tensor* noise = nullptr);
struct SD3Txt2ImgResult {
    torch::Tensor image;       // [B, 3, H, W] in [0, 1]
    torch::Tensor image_uint8; // round(image * 255) [B, H, W, 3]
    int width = 0, height = 0;
    double shift = 0;          // the scheduler's (after any override)
    bool t5 = false;           // T5 encoded the prompts (else diffusers' zeros)
    double encode_s = 0, denoise_s = 0, decode_s = 0;
    std::vector<CacheStepLog> cache_steps; // the cache mode's per-step log
    nlohmann::json cache_log;             // DitCacheController::log_json
    std::vector<std::pair<double, double>> teacache_samples; // record_teacache: DitCacheController::teacache_samples
};
// The image size and first loop step of a run, with every check sd3_txt2img makes before any work (prompts, steps,
// VAE, the init images, the size): a server checks a request with it before queueing the run. ParamError naming
// the field.
struct SD3RunShape {
    int width = 0, height = 0;
    int begin = 0; // img2img: sd3_img2img_start; 0 otherwise
};
SD3RunShape sd3_check_params(const SD3Models& m, const SD3Txt2ImgParams& p);

// ParamError naming the field for a bad size (not a multiple of the VAE factor x patch size, or past the
// transformer's position grid), steps < 1, no prompts, or a model without text encoders or VAE. `on_step(i, n)` after
// step i of n when given.
SD3Txt2ImgResult sd3_txt2img(SD3Models& m, const SD3Txt2ImgParams& p,
                             const std::function<void(int, int)>& on_step = {});

} // namespace anchor::unet
