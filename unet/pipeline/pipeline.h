// txt2img with classifier-free guidance, exactly the loop of diffusers 0.27 StableDiffusionPipeline.__call__ (see
// tests/golden/sd/pipeline_tiny/README.md): uncond rows first, one batched UNet call per step, initial latents from a
// CPU generator seeded like torch.Generator('cpu').manual_seed(seed) that is also handed to the scheduler step.
//
// How the UNet is evaluated at each step is delegated to a DenoiseController, so feature caches (DeepCache and the
// anchor caches) plug in per-step decisions (full vs shallow UNet) without touching the loop.
#pragma once

#include "cache/io/png_text.h"
#include "unet/model/checkpoint.h"
#include "unet/model/unet_graph.h"
#include "unet/model/vae_tiling.h"
#include "unet/pipeline/control.h"
#include "unet/pipeline/hires_params.h"
#include "unet/pipeline/img2img.h"
#include "unet/pipeline/prompt_syntax.h"
#include "unet/samplers/scheduler.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <array>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace anchor::unet {

struct Txt2ImgParams {
    // One batch, as diffusers' `prompt=[p1, p2, ...]`: every prompt's rows in one UNet call, one generator for the
    // whole batch (initial latents [B, C, h, w] drawn at once), so image b is not the image of a run of prompt b alone.
    std::vector<std::string> prompts{""};
    // Empty: "" for every prompt (diffusers' negative_prompt=None); one entry: for every prompt; else one per prompt.
    std::vector<std::string> negative_prompts;
    int images_per_prompt = 1;   // diffusers' num_images_per_prompt: prompt b's rows repeated, images b*n .. b*n+n-1
    double guidance_scale = 7.5; // <= 1 disables classifier-free guidance (no uncond rows), as in diffusers
    int steps = 20;
    int64_t seed = 42;
    // 0 = the model's own size, unet sample_size x VAE factor (as diffusers does): 512 for SD 1.x, 768 for SD 2.x-v,
    // 64 for the golden tiny model, whose VAE factor is 2 (512 there means 256x256 latents and a 65536-token
    // attention).
    int width = 0;
    int height = 0;
    SamplerKind sampler = SamplerKind::EulerAncestral;
    // Noise schedule (scheduler.h); unset: karras when the model's scheduler_config.json sets use_karras_sigmas, else
    // default (diffusers' spacing).
    std::optional<NoiseSchedule> schedule;
    // diffusers' timestep_spacing for every sampler (few-step models such as SDXL-Turbo/Lightning want trailing);
    // unset: the model's scheduler_config.json (leading for SD 1.x/2.x and SDXL base).
    std::optional<TimestepSpacing> timestep_spacing;
    // Noise of the samplers with a noise term (ddim, euler_a); unset: the sampler's default (ddim 0, euler_a 1). Given
    // to another sampler it is a ParamError (effective_eta).
    std::optional<double> eta;
    int clip_skip = 0;
    // SDXL (diffusers StableDiffusionXLPipeline): the prompts of the second text encoder; empty = prompts (and
    // negative_prompts_2 empty = negative_prompts), broadcast like them.
    std::vector<std::string> prompts_2, negative_prompts_2;
    // SDXL micro-conditioning (Podell et al. 2023, "SDXL", sec. 2.2), in diffusers' order: sizes (height, width),
    // crop (top, left). Unset sizes: the output size. The negative ones apply only when both negative sizes are
    // given, as in diffusers; otherwise the unconditional rows get the same time ids.
    std::optional<std::array<int, 2>> original_size, target_size, negative_original_size, negative_target_size;
    std::array<int, 2> crop{0, 0}, negative_crop{0, 0};
    // How the prompt text is read (unet/pipeline/prompt_syntax.h): A1111 emphasis, BREAK and chunks of 75 tokens (the default,
    // as stable-diffusion.cpp), or plain = diffusers (the text as is, truncated to 75 tokens). A prompt without
    // emphasis or BREAK of at most 75 tokens gets the same embeddings in both.
    PromptSyntax prompt_syntax = PromptSyntax::A1111;
    // Where the UNet runs (the models must be there); the scheduler, the generator and the initial noise stay on the
    // CPU, so a seed gives the same noise on every device (as diffusers with a CPU generator). Only the CPU and a
    // CUDA device of a CUDA build. The default, CPU, resolves to the UNet's device (LoadOptions::device).
    torch::Device device = torch::kCPU;
    // Given text conditioning ([uncond rows; cond rows] with guidance): the text encoder is not used (a random-weight
    // UNet benchmark has none).
    torch::Tensor prompt_embeds;
    torch::Tensor pooled_prompt_embeds; // SDXL with prompt_embeds: the pooled embeddings, rows as prompt_embeds
    bool decode = true;                 // false: stop at the final latents (no VAE needed)
    // For one-shot runs on machines with little memory (stable-diffusion.cpp's free_params_immediately): the text
    // encoders' weights (and, without an init image, the VAE encoder's) are released once the prompts are encoded
    // and the UNet's once the loop ends, so none is resident beside the VAE decode. The models cannot run again
    // afterwards (validate refuses).
    bool free_params = false;
    // The un-cached UNet calls on a CUDA device replay a captured CUDA graph (unet/model/unet_graph.h): the same
    // kernels without the per-kernel launch cost. Needs a CUDA device in a build with LibTorch >= 2 and CUDA.
    bool cuda_graphs = false;
    // img2img (an init image) and inpaint (an init image and a mask), diffusers' StableDiffusionImg2ImgPipeline /
    // StableDiffusionInpaintPipeline: the loop runs the last steps of the schedule (strength), from the noised VAE
    // encoding of the init image. width/height 0 = the init image's size rounded down to a multiple of the VAE factor
    // (diffusers' get_default_height_width); another size resizes the image (and the mask) to it with PIL's Lanczos.
    Img2ImgParams init;
    // diffusers' vae.enable_tiling(): the decode (and img2img's encode) in overlapping tiles when the latents (image)
    // are larger than one tile, so memory follows the tile size (unet/model/vae_tiling.h).
    VaeTiling vae_tiling;
    // ControlNets (unet/pipeline/control.h, diffusers' StableDiffusionControlNetPipeline), their residuals added;
    // width/height 0 (txt2img) = the first control image's size rounded down to the VAE factor, as diffusers.
    std::vector<ControlParams> control;
    // The final image's decoder: the model's VAE, or SDModels::taesd (diffusers' AutoencoderTiny in the pipeline).
    VaeDecoder vae_decoder = VaeDecoder::Full;
    // Textual-inversion embeddings (unet/model/embeddings.h): a name of one in a prompt stands for its vectors
    // (A1111 syntax; a prompt under plain syntax that names one is a ParamError). Shared, never changed by a run.
    std::shared_ptr<const EmbeddingDatabase> embeddings;
    // A1111's hires fix (unet/pipeline/hires.h): this txt2img at width x height, then img2img at the hires target.
    HiresParams hires;
};

// The sampler's injected noise carried forward (Scheduler::injected_noise) as part of one step's model input.
struct InjectedNoise {
    // N_k scaled like the latents, rows and channels as the model input (zeros in a 9-channel UNet's extra
    // channels); undefined where the sampler has none (deterministic samplers, the first step).
    torch::Tensor part;
    // Whether the sampler injected noise into this step's input at all: set for every controller, while `part` is
    // built only for one that wants_injected_noise().
    bool present = false;
    // c_in(k) * Scheduler::injected_carry() (c_in the model-input scale of step k): the part of an earlier step s
    // carried to step k is part_s * carry_k / carry_s.
    double carry = 1.0;
    PredictionType prediction = PredictionType::Epsilon;
    // How much the model output moves per unit of white noise added to the model input with the denoised estimate
    // held fixed, at noise level sigma (the VE sigma of set_noise_levels): the input is c_in (x0 + sigma eps) with
    // c_in = 1 / sqrt(sigma^2 + 1) (Euler-type) or the VP sample sqrt(abar) x0 + sqrt(1 - abar) eps (DDIM-type), and
    // in both d eps = d input * sqrt(sigma^2 + 1) / sigma; v = alpha eps - sigma_vp x0 gives d v = d input / sigma; a
    // sample prediction does not move.
    static double gain(PredictionType prediction, double sigma);
};

// Per-step evaluation of the (CFG-batched) UNet.
class DenoiseController {
public:
    virtual ~DenoiseController() = default;
    virtual std::string name() const = 0;
    // Called once before the loop with the number of loop steps and the number of images in the batch (the UNet
    // batch is [uncond rows; cond rows] with guidance, image b in rows b and images + b).
    virtual void begin(int num_steps, int images) { (void)num_steps, (void)images; }
    // Called right before begin() with the noise level of every step that runs, in loop order: sigma_k =
    // sqrt((1 - abar) / abar) at the step's timestep (the sigma samplers' own sigmas; the same quantity for DDIM and
    // PNDM), so that a cache can measure distances in the schedule's own units whatever the sampler and step count.
    virtual void set_noise_levels(std::vector<double> sigmas) { (void)sigmas; }
    // Called with them: how many earlier model outputs the sampler's step combines (Scheduler::earlier_outputs).
    virtual void set_sampler_history(int earlier_outputs) { (void)earlier_outputs; }
    // Called before every predict() with the sampler's injected noise in that step's model input (InjectedNoise):
    // model_input minus its part is the deterministic part of the trajectory, which a cache may decide on.
    virtual void set_injected_noise(const InjectedNoise& noise) { (void)noise; }
    // Whether this controller reads that noise: the loop builds it (a copy of the latents per step) only then.
    virtual bool wants_injected_noise() const { return false; }
    // The noise prediction for `model_input` [2B or B, C, h, w] at loop step `step` (timestep tensor 0-dim float).
    // `stem`: conv_in(model_input) when a wrapping controller's probe computed it already (UNet forward's `stem`).
    // Every override declares the same default.
    virtual torch::Tensor predict(UNet2DConditionModelImpl& unet, const torch::Tensor& model_input,
                                  const torch::Tensor& timestep, const UNetCond& context, int step,
                                  const torch::Tensor& stem = {}) = 0;
    // Whether step `step` ran the full UNet (for logs/JSON); controllers without a cache always do.
    virtual bool last_step_was_full() const { return true; }
};

// Every step runs the full UNet.
class FullDenoiser : public DenoiseController {
public:
    explicit FullDenoiser(bool cuda_graphs = false) : cuda_graphs_(cuda_graphs) {}
    std::string name() const override { return "none"; }
    torch::Tensor predict(UNet2DConditionModelImpl& unet, const torch::Tensor& x, const torch::Tensor& t,
                          const UNetCond& ctx, int step, const torch::Tensor& stem = {}) override;
    // The CUDA graph of the calls (Txt2ImgParams::cuda_graphs), made at the first call it applies to; null otherwise.
    const UNetStepGraph* graph() const { return graph_.get(); }

private:
    bool cuda_graphs_;
    std::unique_ptr<UNetStepGraph> graph_;
};

// Everything a step produced (for golden checks and debugging).
struct StepRecord {
    int index = 0; // loop step of the scheduler (t_start + k in img2img / inpaint)
    double timestep = 0;
    torch::Tensor model_input, noise_pred, guided_noise_pred, latents; // latents: after the step
    // Inpaint with a 4-channel UNet: the scheduler's output before the blend, and the re-noised image latents blended
    // into it (latents = (1 - mask) * init_latents_proper + mask * scheduler_output).
    torch::Tensor scheduler_output, init_latents_proper;
};

// What img2img / inpaint start from, each as diffusers names it (prepare_latents, prepare_mask_latents).
struct InitLatents {
    torch::Tensor init_image;                          // [N, 3, H, W] in [-1, 1], the N init images given
    torch::Tensor image_encode_mean, image_encode_std; // the posterior of init_image (when encoded), [N, 4, h, w]
    torch::Tensor image_encode_noise, image_latents;   // its randn draw; scaling_factor * sample tiled, [B, 4, h, w]
    torch::Tensor noise, latents;                      // randn [B, 4, h, w]; the loop's start
    torch::Tensor mask_condition, mask, masked_image;  // [M, 1, H, W] 0/1; [B, 1, h, w]; [max(N, M), 3, H, W]
    torch::Tensor masked_image_encode_mean, masked_image_encode_std, masked_image_encode_noise;
    torch::Tensor masked_image_latents; // [B, 4, h, w]
    int begin = 0;                      // the first loop step (t_start * order)
    bool unet9 = false;                 // a 9-channel inpainting UNet: [latents, mask, masked_image_latents] input
};

// Where a run is when it calls its progress callback: after each denoising step, and before the two long phases
// around the loop (the prompt encoding, the VAE decode), so that a callback that throws (a cancelled server job)
// stops the run there too.
enum class ProgressPhase { Step, Encode, Decode };

struct ProgressInfo {
    int step = 0; // steps done (1-based after a step)
    int total = 0;
    double elapsed_s = 0;
    bool full = true; // the cache decision of the step just done: the full UNet ran (false: a cached feature)
    ProgressPhase phase = ProgressPhase::Step;
    torch::Tensor latents; // Step: the latents after the step (previews, unet/pipeline/preview.h); else undefined
};

struct Txt2ImgResult {
    torch::Tensor initial_noise, initial_latents, prompt_embeds, final_latents;
    torch::Tensor text_embeds, time_ids; // SDXL: the UNet's added conditioning as the loop used it (CFG rows)
    InitLatents init;                    // img2img / inpaint only
    torch::Tensor decoded;               // raw VAE output [B,3,H,W]
    torch::Tensor image;                 // (decoded/2+0.5).clamp(0,1), float [B,3,H,W]
    torch::Tensor image_uint8;           // round(image*255) NHWC uint8 [B,H,W,3]
    std::vector<std::string> warnings;   // e.g. prompt truncation
    // The schedule the loop ran (effective_schedule) and its eta (effective_eta; none for samplers without a noise
    // term).
    NoiseSchedule schedule = NoiseSchedule::Default;
    std::optional<double> eta;
    int full_steps = 0, total_steps = 0;
    double text_s = 0, denoise_s = 0, decode_s = 0;
    // A1111's "TI hashes": name (':' and ',' removed) and short hash of every embedding the prompts named.
    std::vector<std::pair<std::string, std::string>> ti_hashes;
};

class Txt2ImgPipeline {
public:
    explicit Txt2ImgPipeline(SDModels& models);

    // Scheduler settings: the model's scheduler_config.json when it has one, SD 1.5's otherwise, with the prediction
    // type the loader decided for a single file or was told (SDModels::prediction).
    SchedulerConfig scheduler_config() const;
    // The same with p's schedule and timestep spacing, when p sets them.
    SchedulerConfig scheduler_config(const Txt2ImgParams& p) const;
    // p's schedule and timestep spacing over `c` (a stored configuration or the model's).
    static SchedulerConfig with_params(SchedulerConfig c, const Txt2ImgParams& p);
    // Checks width/height against the VAE factor, steps >= 1 ... (ParamError naming the field).
    // Rough peak working memory of one run at these settings (bytes, weights excluded): UNet skip connections and
    // working maps, the chunked attention buffer, the VAE decoder's widest map. validate() refuses sizes above the
    // machine's available memory with it.
    int64_t estimate_peak_bytes(const Txt2ImgParams& p) const;
    void validate(const Txt2ImgParams& p) const;
    // p with width/height 0 replaced by the model's default size.
    Txt2ImgParams resolved(Txt2ImgParams p) const;

    // [uncond rows, cond rows] when guidance is on, else the cond rows only, as diffusers' encode_prompt: the prompts
    // encoded as one batch, the negative prompts (p.negative_prompts, broadcast) as another, each row repeated
    // p.images_per_prompt times. Plain syntax: [rows, 77, D], truncation warnings appended to `warnings`. A1111
    // syntax: [rows, 77 * k, D], k the most chunks of any prompt or negative prompt (the others padded with the
    // encoding of an empty chunk, A1111's pad_cond_uncond), nothing truncated.
    torch::Tensor encode_prompts(const Txt2ImgParams& p, bool cfg, std::vector<std::string>* warnings);
    // Everything the UNet is conditioned on, rows as encode_prompts. SDXL (diffusers encode_prompt): both encoders'
    // hidden states (ClipConditioning) concatenated, the pooled embedding of the second; without a negative prompt
    // and with SDXModels::force_zeros_for_empty_prompt, zeros for the unconditional rows. The time ids of
    // sdxl_time_ids. Given p.prompt_embeds (and p.pooled_prompt_embeds): those.
    UNetCond encode_conditioning(const Txt2ImgParams& p, bool cfg, std::vector<std::string>* warnings);
    // SDXL's add_time_ids for `images` images of p (resolved): [original size, crop, target size] per row; with CFG
    // cat([negative, positive]).repeat(images, 1), which is diffusers 0.27's row order (for images > 1 with distinct
    // negative ids it pairs rows differently from the embeddings; kept to give the reference's results).
    torch::Tensor sdxl_time_ids(const Txt2ImgParams& p, int64_t images, bool cfg) const;
    // The negative prompt of every prompt of p (p.negative_prompts broadcast; "" when empty).
    static std::vector<std::string> negatives_of(const Txt2ImgParams& p);
    // Token ids of the prompts of p, [B, 77] (what diffusers' tokenizer returns).
    torch::Tensor prompt_ids(const std::vector<std::string>& prompts,
                             std::vector<std::string>* warnings = nullptr) const;
    // The same with another tokenizer (SDXL's tokenizer_2) and window.
    static torch::Tensor prompt_ids(const ClipTokenizer& tok, int max_len, const std::vector<std::string>& prompts,
                                    std::vector<std::string>* warnings);
    // The A1111 chunks of every prompt (parse_prompt_attention + chunk_prompt with this model's tokenizer).
    std::vector<ChunkedPrompt> prompt_chunks(const std::vector<std::string>& prompts) const;
    static std::vector<ChunkedPrompt> prompt_chunks(const ClipTokenizer& tok, int max_len,
                                                    const std::vector<std::string>& prompts,
                                                    const std::vector<TokenEmbedding>* embeddings = nullptr);
    // The textual-inversion embeddings p's prompts and negative prompts name (indices into p.embeddings, in order of
    // first use; empty without p.embeddings). Read as A1111 syntax, or as plain text under plain syntax.
    std::vector<int> embeddings_used(const Txt2ImgParams& p) const;
    // validate()'s check of them: ParamError("prompt_syntax") under plain syntax, anchor::Error naming the file and
    // the expected and actual shapes for one made for another text encoder.
    void check_embeddings(const Txt2ImgParams& p) const;
    // One loop step from `latents` (the state before step i): fills `rec` when given and returns the new latents.
    // `extra`: channels appended to the scaled model input (a 9-channel UNet's [mask, masked image latents], CFG
    // rows); `ctl_step`: the step number the controller sees (the loop's own count, from 0; -1 = i).
    torch::Tensor step(Scheduler& sched, int i, const torch::Tensor& latents, const UNetCond& context, double guidance,
                       bool cfg, DenoiseController& ctl, torch::Generator& gen, StepRecord* rec,
                       const torch::Tensor& extra = {}, int ctl_step = -1);
    // img2img / inpaint: the begin index set on `sched` (set_timesteps done), the generator drawn from exactly as
    // diffusers does: [init image posterior sample] -> noise -> [masked image posterior sample]. `p` resolved.
    InitLatents prepare_init(const Txt2ImgParams& p, Scheduler& sched, int64_t images, torch::Generator& gen);
    // Inpaint with a 4-channel UNet, after loop step i: the blend with the image latents noised to step i + 1 (the
    // image latents themselves after the last step). Fills rec's scheduler_output / init_latents_proper.
    torch::Tensor blend_inpaint(const InitLatents& in, const Scheduler& sched, int i, const torch::Tensor& latents,
                                StepRecord* rec) const;
    // VAE decode of final latents: returns {decoded, image in [0,1], uint8 NHWC}.
    // `with` Taesd: the TAESD decoder (SDModels::taesd) on latents / its scaling_factor, as diffusers' pipelines;
    // `tiling` applies to the full VAE (diffusers' enable_tiling).
    std::vector<torch::Tensor> decode(const torch::Tensor& latents, VaeDecoder with = VaeDecoder::Full,
                                      const VaeTiling& tiling = {});

    using ProgressFn = std::function<void(const ProgressInfo&)>;
    using StepFn = std::function<void(const StepRecord&)>;
    // `sched_cfg` overrides scheduler_config() (tests with a stored scheduler configuration).
    Txt2ImgResult run(const Txt2ImgParams& p, DenoiseController* ctl = nullptr, const ProgressFn& progress = {},
                      const StepFn& on_step = {}, const SchedulerConfig* sched_cfg = nullptr);

    SDModels& models() { return m_; }
    const SDModels& models() const { return m_; }

private:
    SDModels& m_;
};

// One pipeline run of a job of many images.
struct BatchJob {
    std::vector<std::string> prompts; // Txt2ImgParams::prompts
    int images_per_prompt = 1;
    int64_t seed = 0;
    int first_image = 0; // index of the batch's first image in the job
    int repeat = 0;       // k of the batch count
    int first_prompt = 0; // index of the batch's first prompt in the job's prompts
    int images() const { return int(prompts.size()) * images_per_prompt; }
};
// The batches of a job, A1111's batch size / batch count: one prompt gives batches of `batch_size` images of it
// (images_per_prompt); several prompts (a prompts file) give consecutive groups of `batch_size` prompts, one image
// each. Every batch runs `batch_count` times; batch j of the job (in this order) has seed + j: one prompt's repeat k
// has seed + k (A1111's batch count), and with batch_size 1 prompt k of a prompts file has seed + k, the rule of
// anchor-text's prompts files (text/text_job.h).
std::vector<BatchJob> plan_batches(const std::vector<std::string>& prompts, int batch_size, int batch_count,
                                   int64_t seed);

// Classifier-free guidance (Ho & Salimans 2022) on a CFG batch [uncond rows; cond rows]: u + g * (c - u), the
// operation order of diffusers.
torch::Tensor cfg_combine(const torch::Tensor& noise_pred, double guidance);

// Writes an RGB uint8 NHWC image (one batch row) as PNG, atomically (write_file_atomic), with the text chunks
// `text` right after IHDR (metadata readers such as A1111's PNG Info look there first).
void write_png(const std::string& path, const torch::Tensor& image_uint8_hwc, bool overwrite,
               const std::vector<PngTextChunk>& text = {});
// The PNG bytes write_png writes (a server answers with them); `what` names the image in errors.
std::string encode_png(const torch::Tensor& image_uint8_hwc, const std::vector<PngTextChunk>& text = {},
                       const std::string& what = "image");

} // namespace anchor::unet
