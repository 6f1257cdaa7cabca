// txt2img loop (diffusers 0.27 StableDiffusionPipeline.__call__ semantics).
#include "unet/pipeline/pipeline.h"
#include "unet/pipeline/hires.h"

#include "cache/io/atomic_file.h"
#include "cache/io/error.h"
#include "cache/util/strings.h"
#include "cache/util/heap.h"
#include "cache/util/memory.h"

#define STB_IMAGE_WRITE_STATIC
#define STB_IMAGE_WRITE_IMPLEMENTATION
#include <stb_image_write.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

namespace anchor::unet {

using torch::Tensor;

namespace {
double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The noise level of loop steps begin .. num_loop_steps - 1 (DenoiseController::set_noise_levels): the sampler's own
// sigmas where it has them, else sqrt((1 - abar_t) / abar_t) at the step's timestep (abar interpolated linearly
// between training steps for a fractional one, the index clamped to the training range).
std::vector<double> loop_noise_levels(const Scheduler& sched, const SchedulerConfig& cfg, int begin) {
    const auto sig = sched.model_sigmas();
    const auto abar = make_alphas_cumprod(cfg).to(torch::kDouble).contiguous();
    const double* a = abar.data_ptr<double>();
    const int64_t N = abar.numel();
    std::vector<double> out;
    for (int i = begin; i < sched.num_loop_steps(); ++i) {
        if (size_t(i) < sig.size()) {
            out.push_back(sig[size_t(i)]);
            continue;
        }
        const double t = std::clamp(sched.timestep(i), 0.0, double(N - 1));
        const int64_t lo = int64_t(std::floor(t)), hi = std::min(lo + 1, N - 1);
        const double ab = a[lo] + (t - double(lo)) * (a[hi] - a[lo]);
        out.push_back(std::sqrt((1.0 - ab) / ab));
    }
    return out;
}
} // namespace

double InjectedNoise::gain(PredictionType prediction, double sigma) {
    if (!(sigma > 0)) return 0.0;
    switch (prediction) {
    case PredictionType::Epsilon:
        return std::sqrt(sigma * sigma + 1.0) / sigma;
    case PredictionType::VPrediction:
        return 1.0 / sigma;
    case PredictionType::Sample:
        return 0.0;
    }
    return 0.0;
}

Tensor FullDenoiser::predict(UNet2DConditionModelImpl& unet, const Tensor& x, const Tensor& t, const UNetCond& ctx, int,
                             const Tensor& stem) {
    if (cuda_graphs_ && !stem.defined() && UNetStepGraph::applies(unet, x, ctx)) {
        if (!graph_ || graph_->model() != &unet) graph_ = std::make_unique<UNetStepGraph>(unet);
        return graph_->forward(x, t, ctx);
    }
    return unet.forward(x, t, ctx, nullptr, stem);
}

Txt2ImgPipeline::Txt2ImgPipeline(SDModels& models) : m_(models) {
    if (!m_.unet) throw Error("txt2img needs a UNet");
}

SchedulerConfig Txt2ImgPipeline::scheduler_config() const {
    SchedulerConfig c = m_.scheduler_config_path.empty() ? SchedulerConfig{}
                                                         : SchedulerConfig::from_json_file(m_.scheduler_config_path);
    // A single file's prediction type (its family's, or the v-prediction test's) or the --prediction option.
    if (m_.prediction.source != PredictionSource::SchedulerConfig) c.prediction_type = m_.prediction.type;
    return c;
}

SchedulerConfig Txt2ImgPipeline::with_params(SchedulerConfig c, const Txt2ImgParams& p) {
    if (p.schedule) c.schedule = p.schedule;
    if (p.timestep_spacing) c.timestep_spacing = *p.timestep_spacing;
    return c;
}

SchedulerConfig Txt2ImgPipeline::scheduler_config(const Txt2ImgParams& p) const {
    return with_params(scheduler_config(), p);
}

Txt2ImgParams Txt2ImgPipeline::resolved(Txt2ImgParams p) const {
    const int size = int(m_.unet->config().sample_size) * m_.vae_scale_factor();
    // The default (CPU) follows the UNet: a pipeline whose UNet was loaded onto a GPU runs its jobs there.
    if (p.device.is_cpu()) p.device = m_.unet->conv_in->weight.device();
    if (p.device.is_cuda() && p.device.index() < 0) p.device = torch::Device(torch::kCUDA, 0);
    if (p.init.enabled() && (p.width == 0 || p.height == 0)) {
        // diffusers' get_default_height_width: the init image's size, rounded down to a multiple of the VAE factor.
        const int f = m_.vae_scale_factor();
        const auto [w, h] = p.init.size();
        if (p.width == 0) p.width = w - w % f;
        if (p.height == 0) p.height = h - h % f;
    }
    if (!p.control.empty() && (p.width == 0 || p.height == 0)) {
        // diffusers' ControlNet pipeline: the control image's size, rounded down to a multiple of the VAE factor.
        const int f = m_.vae_scale_factor();
        const auto [w, h] = control_image_size(p.control.front());
        if (p.width == 0) p.width = w - w % f;
        if (p.height == 0) p.height = h - h % f;
    }
    if (p.width == 0) p.width = size;
    if (p.height == 0) p.height = size;
    return p;
}

namespace {

// The img2img / inpaint part of validate(): inputs readable, sizes, strength, the UNet kind.
void validate_init(const Txt2ImgParams& p, const SDModels& m) {
    const auto& in = p.init;
    const int64_t unet_channels = m.unet->config().in_channels;
    if (!in.enabled()) {
        if (in.inpaint()) throw ParamError("mask", "a mask needs an init image (init_image)");
        if (unet_channels == 9)
            throw ParamError("init_image", "this UNet has 9 input channels (an inpainting model): give an init image "
                                           "and a mask");
        return;
    }
    if (in.init_latents.defined()) { // given latents: shaped as the output's, no mask
        const int f = m.vae_scale_factor();
        const auto& z = in.init_latents;
        (void)strength_schedule(p.steps, in.strength);
        if (in.inpaint()) throw ParamError("mask", "a mask needs an init image, not init latents");
        if (z.dim() != 4 || !m.vae || z.size(1) != m.vae->config().latent_channels || z.size(2) * f != p.height ||
            z.size(3) * f != p.width || unet_channels != z.size(1))
            throw ParamError("init_image", "init latents " + c10::str(z.sizes()) + " do not fit a " +
                                               wxh(p.width, p.height) + " output of this model");
        const int64_t batch = int64_t(p.prompts.size()) * p.images_per_prompt;
        if (z.size(0) > batch || batch % z.size(0) != 0)
            throw ParamError("init_image", std::to_string(z.size(0)) + " init latents for a batch of " +
                                               std::to_string(batch) + " images");
        return;
    }
    // strength, readable files, pixel shapes, mask size, the counts against the batch
    const auto [iw, ih] = in.validate(p.steps, int64_t(p.prompts.size()) * p.images_per_prompt);
    const int f = m.vae_scale_factor();
    if (iw < f || ih < f)
        throw ParamError("init_image",
                         "the init image is " + wxh(iw, ih) + ", smaller than the VAE factor " + std::to_string(f));
    if (!m.vae) throw ParamError("init_image", "img2img needs the VAE to encode the init image");
    if (unet_channels == 9 && !in.inpaint())
        throw ParamError("mask", "this UNet has 9 input channels (an inpainting model): it needs a mask");
    if (unet_channels != 4 && unet_channels != 9)
        throw ParamError("init_image", "img2img / inpaint need a UNet with 4 or 9 input channels, this one has " +
                                           std::to_string(unet_channels));
    if (m.vae->config().latent_channels + (unet_channels == 9 ? 5 : 0) != unet_channels)
        throw ParamError("init_image", "the VAE has " + std::to_string(m.vae->config().latent_channels) +
                                           " latent channels, the UNet " + std::to_string(unet_channels) +
                                           " input channels");
}
} // namespace

namespace {
// SDXL's own parameters (Txt2ImgParams: prompts_2, the micro-conditioning), refused on other families.
void validate_sdxl(const Txt2ImgParams& p, const SDModels& m) {
    const bool sdxl = m.unet->config().text_time();
    const std::pair<const char*, bool> only_sdxl[] = {{"prompts_2", !p.prompts_2.empty()},
                                                      {"negative_prompts_2", !p.negative_prompts_2.empty()},
                                                      {"original_size", bool(p.original_size)},
                                                      {"target_size", bool(p.target_size)},
                                                      {"crop", p.crop != std::array<int, 2>{0, 0}},
                                                      {"negative_original_size", bool(p.negative_original_size)},
                                                      {"negative_target_size", bool(p.negative_target_size)},
                                                      {"negative_crop", p.negative_crop != std::array<int, 2>{0, 0}}};
    for (const auto& [field, given] : only_sdxl)
        if (given && !sdxl)
            throw ParamError(field, "is SDXL conditioning; this model is " + enum_name(sd_family_table(), m.family));
    if (!sdxl) return;
    for (const auto* v : {&p.original_size, &p.target_size, &p.negative_original_size, &p.negative_target_size})
        if (*v && ((**v)[0] <= 0 || (**v)[1] <= 0))
            throw ParamError(v == &p.original_size            ? "original_size"
                             : v == &p.target_size            ? "target_size"
                             : v == &p.negative_original_size ? "negative_original_size"
                                                              : "negative_target_size",
                             "sizes must be positive, got " + std::to_string((**v)[1]) + "x" +
                                 std::to_string((**v)[0]));
    for (const auto& [field, v] : {std::pair{"prompts_2", &p.prompts_2}, {"negative_prompts_2", &p.negative_prompts_2}})
        if (v->size() > 1 && v->size() != p.prompts.size())
            throw ParamError(field, std::to_string(v->size()) + " entries for " + std::to_string(p.prompts.size()) +
                                        " prompts (give one for all, or one per prompt)");
    if (p.prompt_embeds.defined()) {
        if (!p.pooled_prompt_embeds.defined() || p.pooled_prompt_embeds.size(0) != p.prompt_embeds.size(0))
            throw ParamError("pooled_prompt_embeds",
                             "an SDXL UNet needs the pooled text embeddings (one row per prompt_embeds row)");
        return;
    }
    if (!m.text_encoder || !m.text_encoder_2)
        throw ParamError("prompt_embeds", "this SDXL model lacks a text encoder (text_encoder and text_encoder_2 are "
                                          "both needed): give the text conditioning");
    const int layers =
        std::min(m.text_encoder->config().num_hidden_layers, m.text_encoder_2->config().num_hidden_layers);
    if (p.clip_skip < 0 || p.clip_skip > layers - 1)
        throw ParamError("clip_skip", "must be in [0, " + std::to_string(layers - 1) +
                                          "] for SDXL (counted from the penultimate layer), got " +
                                          std::to_string(p.clip_skip));
}
} // namespace

int64_t Txt2ImgPipeline::estimate_peak_bytes(const Txt2ImgParams& p_in) const {
    const Txt2ImgParams p = resolved(p_in);
    const int f = m_.vae_scale_factor();
    const double B = double(p.prompts.size()) * std::max(p.images_per_prompt, 1),
                 rows = B * (p.guidance_scale > 1.0 ? 2.0 : 1.0);
    const double h = double(p.height) / f, w = double(p.width) / f;
    // UNet: the skip connections of every down level are alive at once ((layers + 1) maps per level, SD's layout),
    // plus ~6 working maps of the widest level; the attention score buffer is chunked to <= 256 MiB.
    const auto& uc = m_.unet->config();
    double skips = 0, widest = 0;
    for (int i = 0; i < uc.num_levels(); ++i) {
        const double px = (h / double(1 << i)) * (w / double(1 << i));
        skips += double(uc.layers_per_block[size_t(i)] + 1) * uc.block_out_channels[size_t(i)] * px;
        widest = std::max(widest, uc.block_out_channels[size_t(i)] * px);
    }
    const double unet = rows * 4.0 * (skips + 6.0 * widest) + 256.0 * (1 << 20);
    // VAE decoder: ~4 maps of its largest level (the full-size one holds the fewest channels).
    if (!m_.vae || !p.decode) return int64_t(unet);
    const auto& vc = m_.vae->config();
    double vae = 0;
    const int nl = int(vc.block_out_channels.size());
    for (int i = 0; i < nl; ++i) {
        // Decoder level i runs at 1/2^i of the image with block_out_channels[i] channels, fed by level i + 1's.
        const double scale = double(1 << i), ch = std::max(vc.block_out_channels[size_t(i)],
                                                           vc.block_out_channels[size_t(std::min(i + 1, nl - 1))]);
        // Tiled: one tile's maps at a time (vae_tiling.h).
        const double th = p.vae_tiling.enabled ? std::min(p.height, p.vae_tiling.tile_sample_size) : p.height,
                     tw = p.vae_tiling.enabled ? std::min(p.width, p.vae_tiling.tile_sample_size) : p.width;
        vae = std::max(vae, ch * (th / scale) * (tw / scale));
    }
    vae *= B * 4.0 * 4.0;
    return int64_t(std::max(unet, vae));
}

void Txt2ImgPipeline::validate(const Txt2ImgParams& p_in) const {
    if (!m_.released.empty()) {
        std::string what;
        for (const auto& r : m_.released) what += (what.empty() ? "" : ", ") + r;
        throw Error("weights released after their last use (free_params): " + what + "; load the model again");
    }
    if (p_in.steps < 1) throw ParamError("steps", "must be >= 1, got " + std::to_string(p_in.steps));
    (void)effective_eta(p_in.sampler, p_in.eta);                    // ParamError("eta")
    (void)effective_schedule(p_in.sampler, scheduler_config(p_in)); // ParamError("schedule")
    if (p_in.sampler == SamplerKind::FlowMatchEuler) // a rectified-flow step needs a velocity model (SD 3)
        throw ParamError("sampler", "flow_match_euler is SD 3's flow-matching sampler; this UNet predicts " +
                                        enum_name(prediction_type_table(), scheduler_config(p_in).prediction_type));
    const Txt2ImgParams p = resolved(p_in);
    const int f = m_.vae_scale_factor();
    validate_init(p, m_);
    validate_hires(p, f);
    if (p.vae_tiling.enabled) p.vae_tiling.validate(f);
    if (p.width <= 0 || p.height <= 0 || p.width % f != 0 || p.height % f != 0)
        throw ParamError(p.width <= 0 || p.width % f != 0 ? "width" : "height",
                         "width and height must be positive multiples of " + std::to_string(f) +
                             " (the VAE factor of this model), got " + std::to_string(p.width) + "x" +
                             std::to_string(p.height));
    if (p.prompts.empty()) throw ParamError("prompts", "no prompt");
    if (p.images_per_prompt < 1)
        throw ParamError("images_per_prompt", "must be >= 1, got " + std::to_string(p.images_per_prompt));
    if (p.negative_prompts.size() > 1 && p.negative_prompts.size() != p.prompts.size())
        throw ParamError("negative_prompts", std::to_string(p.negative_prompts.size()) + " entries for " +
                                                 std::to_string(p.prompts.size()) +
                                                 " prompts (give one for all, or one per prompt)");
    if (!std::isfinite(p.guidance_scale) || p.guidance_scale < 0)
        throw ParamError("guidance_scale", "must be a finite number >= 0, got " + std::to_string(p.guidance_scale));
    // Refuse sizes this machine cannot hold before allocating anything (estimate_peak_bytes says what is counted).
    // A batch that does not fit is the batch size's fault, one image that does not fit the size's.
    const int64_t rows = int64_t(p.prompts.size()) * p.images_per_prompt;
    const std::string size = std::to_string(p.width) + "x" + std::to_string(p.height);
    check_fits_memory(rows > 1 ? "images_per_prompt" : "width", double(estimate_peak_bytes(p)),
                      rows > 1 ? "a batch of " + std::to_string(rows) + " " + size + " images" : "a " + size + " image",
                      rows > 1 ? "choose a smaller batch size" : "choose a smaller width/height");
    if (p.cuda_graphs && !(p.device.is_cuda() && kernels::CudaGraph::available()))
        throw ParamError("cuda_graphs", std::string("needs a CUDA device in a build with LibTorch >= 2 and CUDA (") +
                                            (kernels::CudaGraph::available() ? "this build has them" : "this build has none") +
                                            "), the job runs on " + p.device.str());
    if (!p.device.is_cpu() && !(p.device.is_cuda() && torch::cuda::is_available()))
        throw ParamError("device", "'" + p.device.str() + "' is not available to this LibTorch (CUDA " +
                                       (torch::cuda::is_available() ? "present" : "absent") + ")");
    if (m_.unet->conv_in->weight.device() != p.device)
        throw ParamError("device",
                         "the UNet is on " + m_.unet->conv_in->weight.device().str() + ", not " + p.device.str());
    if (!p.prompt_embeds.defined() && !m_.text_encoder)
        throw ParamError("prompt_embeds", "the models have no text encoder: give the text conditioning");
    if (p.vae_decoder == VaeDecoder::Taesd && p.decode && !m_.taesd)
        throw ParamError("vae_decoder", "taesd: no TAESD is loaded with the model (attach_taesd)");
    if (p.decode && !m_.vae && p.vae_decoder == VaeDecoder::Full) throw ParamError("decode", "the models have no VAE: decode = false returns latents");
    validate_sdxl(p, m_);
    validate_control(p.control, m_.unet->config(), int64_t(p.prompts.size()));
    if (!m_.text_encoder) return;
    if (!p.prompt_embeds.defined())
        check_prompt_syntax(p.prompt_syntax, {&p.prompts, &p.negative_prompts, &p.prompts_2, &p.negative_prompts_2});
    if (!p.prompt_embeds.defined()) check_embeddings(p);
    if (!m_.unet->config().text_time() &&
        (p.clip_skip < 0 || p.clip_skip >= m_.text_encoder->config().num_hidden_layers))
        throw ParamError("clip_skip", "must be in [0, " +
                                          std::to_string(m_.text_encoder->config().num_hidden_layers - 1) + "], got " +
                                          std::to_string(p.clip_skip));
}

std::vector<int> Txt2ImgPipeline::embeddings_used(const Txt2ImgParams& p) const {
    std::vector<int> used;
    if (!p.embeddings || p.embeddings->empty() || !m_.text_encoder) return used;
    const auto names = p.embeddings->lookup(m_.tokenizer);
    PromptChunkOptions o;
    o.embeddings = &names;
    o.chunk_length = m_.text_encoder->config().max_position_embeddings - 2;
    const auto negatives = negatives_of(p);
    for (const auto* list : {&p.prompts, &negatives, &p.prompts_2, &p.negative_prompts_2})
        for (const auto& text : *list) {
            const auto parsed = p.prompt_syntax == PromptSyntax::A1111 ? parse_prompt_attention(text)
                                                                       : std::vector<PromptFragment>{{text, 1.0}};
            for (int i : chunk_prompt(m_.tokenizer, parsed, o).embeddings_used)
                if (std::find(used.begin(), used.end(), i) == used.end()) used.push_back(i);
        }
    return used;
}

std::vector<std::string> Txt2ImgPipeline::negatives_of(const Txt2ImgParams& p) {
    if (p.negative_prompts.empty()) return std::vector<std::string>(p.prompts.size(), "");
    if (p.negative_prompts.size() == 1) return std::vector<std::string>(p.prompts.size(), p.negative_prompts[0]);
    return p.negative_prompts;
}

void Txt2ImgPipeline::check_embeddings(const Txt2ImgParams& p) const {
    const auto used = embeddings_used(p);
    if (used.empty()) return;
    const auto& e = p.embeddings->items().at(size_t(used[0]));
    if (p.prompt_syntax == PromptSyntax::Plain)
        throw ParamError("prompt_syntax", "the prompt names the textual-inversion embedding '" + e.name +
                                              "': embeddings are read under a1111 syntax only (plain is diffusers' "
                                              "text as is)");
    std::vector<int64_t> widths{m_.text_encoder->config().hidden_size};
    if (m_.text_encoder_2) widths.push_back(m_.text_encoder_2->config().hidden_size);
    for (int i : used)
        for (size_t k = 0; k < widths.size(); ++k) (void)p.embeddings->items().at(size_t(i)).for_encoder(k, widths);
}

Tensor Txt2ImgPipeline::prompt_ids(const std::vector<std::string>& prompts, std::vector<std::string>* warnings) const {
    return prompt_ids(m_.tokenizer, m_.text_encoder->config().max_position_embeddings, prompts, warnings);
}

Tensor Txt2ImgPipeline::prompt_ids(const ClipTokenizer& tok, int max_len, const std::vector<std::string>& prompts,
                                   std::vector<std::string>* warnings) {
    std::vector<Tensor> rows;
    for (const auto& text : prompts) {
        auto t = tok.tokenize(text, max_len);
        if (t.truncated && warnings)
            warnings->push_back("prompt has " + std::to_string(t.num_bpe_tokens) + " tokens, only the first " +
                                std::to_string(max_len - 2) + " are used: \"" +
                                (text.size() > 60 ? text.substr(0, 57) + "..." : text) + "\"");
        rows.push_back(torch::tensor(t.ids, torch::kLong).unsqueeze(0));
    }
    return torch::cat(rows, 0);
}

std::vector<ChunkedPrompt> Txt2ImgPipeline::prompt_chunks(const std::vector<std::string>& prompts) const {
    return prompt_chunks(m_.tokenizer, m_.text_encoder->config().max_position_embeddings, prompts);
}

std::vector<ChunkedPrompt> Txt2ImgPipeline::prompt_chunks(const ClipTokenizer& tok, int max_len,
                                                          const std::vector<std::string>& prompts,
                                                          const std::vector<TokenEmbedding>* embeddings) {
    PromptChunkOptions o;
    o.chunk_length = max_len - 2;
    o.embeddings = embeddings;
    std::vector<ChunkedPrompt> out;
    for (const auto& text : prompts) out.push_back(chunk_prompt(tok, parse_prompt_attention(text), o));
    return out;
}

namespace {
// The textual-inversion side of one encoding: p's embeddings, the widths of the model's text encoders (one entry, or
// SDXL's two), the names as a tokenizer reads them and the splices of a chunk's fixes.
class PipelineEmbeddings {
public:
    PipelineEmbeddings(const Txt2ImgParams& p, std::vector<int64_t> widths)
        : db_(p.embeddings.get()), widths_(std::move(widths)) {}
    std::vector<TokenEmbedding> lookup(const ClipTokenizer& tok) const {
        return db_ ? db_->lookup(tok) : std::vector<TokenEmbedding>{};
    }
    // Row b's fixes -> the vectors at positions offset + 1 (after the bos); Error when an embedding does not fit.
    std::vector<TokenSplice> splices(const std::vector<std::vector<ChunkFix>>& fixes, size_t encoder) const {
        std::vector<TokenSplice> out;
        for (size_t b = 0; b < fixes.size(); ++b)
            for (const auto& f : fixes[b])
                out.push_back({int64_t(b), int64_t(f.offset) + 1,
                               db_->items().at(size_t(f.index)).for_encoder(encoder, widths_)});
        return out;
    }

private:
    const EmbeddingDatabase* db_;
    std::vector<int64_t> widths_;
};
} // namespace

namespace {
// `v` broadcast to as many entries as `fallback` the way negative_prompts is (empty: `fallback`; one entry: for
// all).
std::vector<std::string> broadcast(const std::vector<std::string>& v, const std::vector<std::string>& fallback) {
    if (v.empty()) return fallback;
    if (v.size() == 1) return std::vector<std::string>(fallback.size(), v[0]);
    return v;
}

// One SDXL encoder's conditioning of a list of prompts. Plain: the diffusers tokenization (77 ids, truncated);
// A1111: chunks of 75 tokens padded to `chunks`, emphasis per encoder (as A1111's per-embedder wrappers), the pooled
// embedding of the first chunk (A1111's zs[0].pooled).
ClipConditioning encode_sdxl_side(ClipTextModelImpl& te, const ClipTokenizer& tok,
                                  const std::vector<std::string>& prompts, PromptSyntax syntax, int clip_skip,
                                  size_t chunks, std::vector<std::string>* warnings, const PipelineEmbeddings& ti,
                                  size_t encoder) {
    const int max_len = te.config().max_position_embeddings;
    if (syntax == PromptSyntax::Plain)
        return te.encode_penultimate(Txt2ImgPipeline::prompt_ids(tok, max_len, prompts, warnings), clip_skip);
    Tensor pooled;
    const SplicingChunkEncoder enc = [&](const Tensor& ids, const std::vector<std::vector<ChunkFix>>& fixes) {
        auto c = te.encode_penultimate(ids, clip_skip, ti.splices(fixes, encoder));
        if (!pooled.defined()) pooled = c.pooled;
        return c.hidden;
    };
    const auto names = ti.lookup(tok);
    auto hidden = encode_chunked(Txt2ImgPipeline::prompt_chunks(tok, max_len, prompts, &names),
                                 empty_chunk(tok, max_len - 2), enc, chunks);
    return {hidden, pooled};
}
} // namespace

Tensor Txt2ImgPipeline::sdxl_time_ids(const Txt2ImgParams& p, int64_t images, bool cfg) const {
    const std::array<int, 2> out{p.height, p.width};
    auto ids = [&](const std::optional<std::array<int, 2>>& orig, const std::array<int, 2>& crop,
                   const std::optional<std::array<int, 2>>& target) {
        const auto o = orig.value_or(out), t = target.value_or(out);
        return torch::tensor(std::vector<float>{float(o[0]), float(o[1]), float(crop[0]), float(crop[1]), float(t[0]),
                                                float(t[1])})
            .unsqueeze(0);
    };
    auto pos = ids(p.original_size, p.crop, p.target_size);
    if (!cfg) return pos.repeat({images, 1});
    auto neg = p.negative_original_size && p.negative_target_size
                   ? ids(p.negative_original_size, p.negative_crop, p.negative_target_size)
                   : pos;
    return torch::cat({neg, pos}, 0).repeat({images, 1});
}

UNetCond Txt2ImgPipeline::encode_conditioning(const Txt2ImgParams& p, bool cfg, std::vector<std::string>* warnings) {
    const int64_t images = int64_t(p.prompts.size()) * p.images_per_prompt;
    if (!m_.unet->config().text_time())
        return {p.prompt_embeds.defined() ? p.prompt_embeds : encode_prompts(p, cfg, warnings)};
    auto time_ids = sdxl_time_ids(p, images, cfg);
    if (p.prompt_embeds.defined()) return {p.prompt_embeds, p.pooled_prompt_embeds, time_ids};
    torch::NoGradGuard ng;
    auto& te1 = *m_.text_encoder;
    auto& te2 = *m_.text_encoder_2;
    const auto prompts_2 = broadcast(p.prompts_2, p.prompts);
    const bool zeros = p.negative_prompts.empty() && m_.force_zeros_for_empty_prompt;
    const auto neg = negatives_of(p), neg_2 = broadcast(p.negative_prompts_2, neg);
    // A1111: every row of both batches padded to the same number of chunks, on both encoders.
    const PipelineEmbeddings ti(p, {te1.config().hidden_size, te2.config().hidden_size});
    size_t k = 1;
    if (p.prompt_syntax == PromptSyntax::A1111) {
        std::vector<const std::vector<std::string>*> lists{&p.prompts, &prompts_2};
        if (cfg && !zeros) lists.insert(lists.end(), {&neg, &neg_2});
        const auto names = ti.lookup(m_.tokenizer);
        for (const auto* l : lists)
            for (const auto& c : prompt_chunks(m_.tokenizer, te1.config().max_position_embeddings, *l, &names))
                k = std::max(k, c.chunks.size());
    }
    auto side = [&](ClipTextModelImpl& te, const ClipTokenizer& tok, const std::vector<std::string>& v, int skip,
                    size_t encoder) {
        return encode_sdxl_side(te, tok, v, p.prompt_syntax, skip, k, warnings, ti, encoder);
    };
    auto c1 = side(te1, m_.tokenizer, p.prompts, p.clip_skip, 0),
         c2 = side(te2, m_.tokenizer_2, prompts_2, p.clip_skip, 1);
    auto context = torch::cat({c1.hidden, c2.hidden}, -1), pooled = c2.pooled;
    const int64_t n = p.images_per_prompt;
    if (n > 1) context = context.repeat_interleave(n, 0), pooled = pooled.repeat_interleave(n, 0);
    if (!cfg) return {context, pooled, time_ids};
    Tensor ucontext, upooled;
    if (zeros) {
        ucontext = torch::zeros_like(context), upooled = torch::zeros_like(pooled);
    } else {
        // diffusers 0.27 encodes the negative prompt with hidden_states[-2] whatever clip_skip is; A1111 skips on
        // both sides.
        const int skip = p.prompt_syntax == PromptSyntax::Plain ? 0 : p.clip_skip;
        auto u1 = side(te1, m_.tokenizer, neg, skip, 0), u2 = side(te2, m_.tokenizer_2, neg_2, skip, 1);
        ucontext = torch::cat({u1.hidden, u2.hidden}, -1), upooled = u2.pooled;
        if (n > 1) ucontext = ucontext.repeat_interleave(n, 0), upooled = upooled.repeat_interleave(n, 0);
    }
    return {torch::cat({ucontext, context}, 0), torch::cat({upooled, pooled}, 0), time_ids};
}

Tensor Txt2ImgPipeline::encode_prompts(const Txt2ImgParams& p, bool cfg, std::vector<std::string>* warnings) {
    torch::NoGradGuard ng;
    const int64_t n = p.images_per_prompt;
    Tensor cond, uncond;
    if (p.prompt_syntax == PromptSyntax::Plain) {
        cond = m_.text_encoder->encode(prompt_ids(p.prompts, warnings), p.clip_skip);
        if (cfg) uncond = m_.text_encoder->encode(prompt_ids(negatives_of(p), warnings), p.clip_skip);
    } else {
        // A1111: the prompts and the negative prompts are two batches padded to the same number of chunks.
        const int max_len = m_.text_encoder->config().max_position_embeddings;
        const PipelineEmbeddings ti(p, {m_.text_encoder->config().hidden_size});
        const auto names = ti.lookup(m_.tokenizer);
        const auto pc = prompt_chunks(m_.tokenizer, max_len, p.prompts, &names);
        const auto nc = cfg ? prompt_chunks(m_.tokenizer, max_len, negatives_of(p), &names)
                            : std::vector<ChunkedPrompt>{};
        size_t k = 1;
        for (const auto* v : {&pc, &nc})
            for (const auto& c : *v) k = std::max(k, c.chunks.size());
        const auto empty = empty_chunk(m_.tokenizer, max_len - 2);
        const SplicingChunkEncoder enc = [&](const Tensor& ids, const std::vector<std::vector<ChunkFix>>& fixes) {
            return m_.text_encoder->encode(ids, p.clip_skip, ti.splices(fixes, 0));
        };
        cond = encode_chunked(pc, empty, enc, k);
        if (cfg) uncond = encode_chunked(nc, empty, enc, k);
    }
    if (n > 1) cond = cond.repeat_interleave(n, 0);
    if (!cfg) return cond;
    if (n > 1) uncond = uncond.repeat_interleave(n, 0);
    return torch::cat({uncond, cond}, 0);
}

Tensor Txt2ImgPipeline::step(Scheduler& sched, int i, const Tensor& latents, const UNetCond& context, double guidance,
                             bool cfg, DenoiseController& ctl, torch::Generator& gen, StepRecord* rec,
                             const Tensor& extra, int ctl_step) {
    c10::InferenceMode guard;
    const double tv = sched.timestep(i);
    auto x = cfg ? torch::cat({latents, latents}, 0) : latents;
    auto model_input = sched.scale_model_input(x, i);
    // 9-channel inpainting UNet: [scaled latents, mask, masked image latents]; only the latents are scaled.
    if (extra.defined()) model_input = torch::cat({model_input, extra.to(model_input.scalar_type())}, 1);
    const auto dev = context.context.device();
    InjectedNoise injected;
    injected.present = sched.injected_noise().defined();
    if (ctl.wants_injected_noise() && injected.present) {
        const auto& n = sched.injected_noise();
        auto part = sched.scale_model_input(cfg ? torch::cat({n, n}, 0) : n, i).to(model_input.scalar_type());
        if (extra.defined()) part = torch::cat({part, torch::zeros_like(extra, part.options())}, 1);
        injected.part = part.to(dev);
        injected.carry = sched.scale_model_input(torch::ones({1}), i).item<double>() * sched.injected_carry();
    }
    injected.prediction = sched.prediction_type();
    ctl.set_injected_noise(injected);
    auto t = torch::tensor(tv, torch::kFloat).reshape({}).to(dev);
    // .to(CPU) waits for the device: the one synchronisation per step
    auto noise_pred = ctl.predict(*m_.unet, model_input.to(dev), t, context, ctl_step < 0 ? i : ctl_step)
                          .to(torch::kCPU, latents.scalar_type());
    Tensor guided = cfg ? cfg_combine(noise_pred, guidance) : noise_pred;
    auto next = sched.step(guided, i, latents, &gen);
    if (rec) {
        rec->index = i;
        rec->timestep = tv;
        rec->model_input = model_input;
        rec->noise_pred = noise_pred;
        rec->guided_noise_pred = guided;
        rec->latents = next;
    }
    return next;
}

InitLatents Txt2ImgPipeline::prepare_init(const Txt2ImgParams& p, Scheduler& sched, int64_t images,
                                          torch::Generator& gen) {
    c10::InferenceMode guard;
    InitLatents in;
    const bool inpaint = p.init.inpaint();
    in.unet9 = m_.unet->config().in_channels == 9;
    // get_timesteps: the loop starts at t_start * order (2 for the two-call samplers Heun / KDPM2).
    in.begin = strength_schedule(p.steps, p.init.strength).t_start * sched.order();
    sched.set_begin_index(in.begin);
    const int f = m_.vae_scale_factor();
    const double sf = m_.vae->config().scaling_factor;
    const int64_t C = m_.vae->config().latent_channels;
    const auto f32 = torch::TensorOptions().dtype(torch::kFloat);
    if (!p.init.init_latents.defined())
        in.init_image = preprocess_image(p.init.rgb_batch(), p.width, p.height); // [N, 3, H, W]
    // The N given images (or masked images) to the batch of `images`: diffusers tiles, cat([x] * (images / N)) in
    // img2img's prepare_latents and x.repeat(images / N, 1, 1, 1) in the inpaint pipeline (the same order).
    auto tile = [&](const Tensor& x) { return x.size(0) < images ? x.repeat({images / x.size(0), 1, 1, 1}) : x; };
    // retrieve_latents(vae.encode(x), generator): the posterior *sampled*, mean + std * randn(generator) with one draw
    // of the whole [N, C, h, w] (the N images as one VAE batch), times scaling_factor, then tiled to the batch.
    auto encode = [&](const Tensor& x, Tensor& mean, Tensor& stdv, Tensor& noise) {
        auto d = vae_encode(*m_.vae, x, p.vae_tiling);
        mean = d.mean.to(torch::kCPU, torch::kFloat);
        stdv = d.std.to(torch::kCPU, torch::kFloat);
        noise = torch::randn(mean.sizes(), gen, f32);
        return tile(sf * (mean + stdv * noise));
    };
    // img2img always encodes; inpaint skips it only for a 9-channel UNet at strength 1 (diffusers' prepare_latents:
    // return_image_latents for 4 channels, or an add_noise start).
    const bool strength_max = p.init.strength == 1.0;
    if (p.init.init_latents.defined()) // diffusers' prepare_latents for a 4-channel image: those, no encode
        in.image_latents = tile(p.init.init_latents.to(torch::kCPU, torch::kFloat));
    else if (!inpaint || !in.unet9 || !strength_max)
        in.image_latents = encode(in.init_image, in.image_encode_mean, in.image_encode_std, in.image_encode_noise);
    in.noise = torch::randn({images, C, p.height / f, p.width / f}, gen, f32);
    // img2img never starts from pure noise; inpaint does at strength 1 (times init_noise_sigma, as txt2img).
    in.latents = inpaint && strength_max ? in.noise * sched.init_noise_sigma()
                                         : sched.add_noise(in.image_latents, in.noise, in.begin);
    if (!inpaint) return in;
    in.mask_condition = preprocess_mask(p.init.grey_batch(), p.width, p.height); // [M, 1, H, W]
    // The repaint area set to 0 (mid-grey); N images and M masks broadcast as torch does (N == M or one of them 1).
    in.masked_image = in.init_image * (in.mask_condition < 0.5);
    in.mask = tile(latent_mask(in.mask_condition, f));
    // Encoded (and the generator drawn from) for both UNet kinds, as diffusers' prepare_mask_latents.
    in.masked_image_latents =
        encode(in.masked_image, in.masked_image_encode_mean, in.masked_image_encode_std, in.masked_image_encode_noise);
    return in;
}

Tensor Txt2ImgPipeline::blend_inpaint(const InitLatents& in, const Scheduler& sched, int i, const Tensor& latents,
                                      StepRecord* rec) const {
    // The noise level of the next loop step (Euler-type schedulers: their step index, already advanced by step()).
    auto proper =
        i + 1 < sched.num_loop_steps() ? sched.add_noise(in.image_latents, in.noise, i + 1) : in.image_latents;
    auto out = (1 - in.mask) * proper + in.mask * latents;
    if (rec) {
        rec->scheduler_output = latents;
        rec->init_latents_proper = proper;
        rec->latents = out;
    }
    return out;
}

std::vector<Tensor> Txt2ImgPipeline::decode(const Tensor& latents, VaeDecoder with, const VaeTiling& tiling) {
    c10::InferenceMode guard;
    Tensor decoded;
    if (with == VaeDecoder::Taesd) {
        if (!m_.taesd) throw ParamError("vae_decoder", "taesd: no TAESD is loaded with the model");
        const auto w = m_.taesd->decoder->layers->parameters().front();
        decoded = m_.taesd->decode_latents(latents.to(w.device(), w.scalar_type()));
    } else if (m_.vae->config().force_upcast && m_.vae->decoder->conv_in->bias.scalar_type() != torch::kFloat) {
        // diffusers' upcast_vae: decode in float32, then back to the VAE's dtype for the next call.
        const auto vae_dtype = m_.vae->decoder->conv_in->bias.scalar_type(); // SD 3 VAEs have no post_quant_conv
        m_.vae->to(torch::kFloat);
        decoded = vae_decode(*m_.vae, m_.vae->config().unscale_latents(latents.to(torch::kFloat)), tiling);
        m_.vae->to(vae_dtype);
    } else {
        decoded = vae_decode(*m_.vae, m_.vae->config().unscale_latents(latents), tiling);
    }
    decoded = decoded.to(torch::kCPU, torch::kFloat); // the VAE may be on a GPU (--device cuda)
    auto image = (decoded / 2 + 0.5).clamp(0, 1);
    auto u8 = (image.permute({0, 2, 3, 1}) * 255).round().to(torch::kUInt8).contiguous();
    return {decoded, image, u8};
}

std::vector<BatchJob> plan_batches(const std::vector<std::string>& prompts, int batch_size, int batch_count,
                                   int64_t seed) {
    if (prompts.empty()) throw ParamError("prompts", "no prompt");
    if (batch_size < 1) throw ParamError("batch_size", "must be >= 1, got " + std::to_string(batch_size));
    if (batch_count < 1) throw ParamError("batch_count", "must be >= 1, got " + std::to_string(batch_count));
    std::vector<BatchJob> jobs;
    int next = 0;
    auto add = [&](std::vector<std::string> group, int per_prompt, int first_prompt) {
        for (int k = 0; k < batch_count; ++k) {
            BatchJob j{group, per_prompt, seed + int64_t(jobs.size()), next, k, first_prompt};
            next += j.images();
            jobs.push_back(std::move(j));
        }
    };
    if (prompts.size() == 1) {
        add(prompts, batch_size, 0);
    } else {
        for (size_t i = 0; i < prompts.size(); i += size_t(batch_size))
            add(std::vector<std::string>(prompts.begin() + long(i),
                                         prompts.begin() + long(std::min(prompts.size(), i + size_t(batch_size)))),
                1, int(i));
    }
    return jobs;
}

Tensor cfg_combine(const Tensor& noise_pred, double guidance) {
    auto uc = noise_pred.chunk(2, 0);
    return uc[0] + guidance * (uc[1] - uc[0]);
}

Txt2ImgResult Txt2ImgPipeline::run(const Txt2ImgParams& p_in, DenoiseController* ctl_in, const ProgressFn& progress,
                                   const StepFn& on_step, const SchedulerConfig* sched_cfg) {
    if (p_in.hires.enabled) return run_hires(*this, p_in, ctl_in, progress, on_step, sched_cfg); // both passes
    const Txt2ImgParams p = resolved(p_in);
    validate(p);
    c10::InferenceMode guard;
    FullDenoiser full(p.cuda_graphs);
    DenoiseController& ctl = ctl_in ? *ctl_in : full;
    Txt2ImgResult r;
    // LCM UNets take the guidance scale as an input, the embedding of w = guidance_scale - 1 (Luo et al. 2023, sec.
    // 4.2; diffusers' LatentConsistencyModelPipeline), instead of a classifier-free guidance batch.
    const int64_t w_dim = m_.unet->config().time_cond_proj_dim;
    const bool cfg = p.guidance_scale > 1.0 && w_dim == 0;
    auto t0 = std::chrono::steady_clock::now();
    if (progress) progress({0, p.steps, 0.0, true, ProgressPhase::Encode});
    if (!p.prompt_embeds.defined())
        for (int i : embeddings_used(p)) {
            const auto& e = p.embeddings->items().at(size_t(i));
            // A1111 strips ':' and ',' from the name so that "name: hash, ..." stays parseable.
            std::string name;
            for (char c : e.name)
                if (c != ':' && c != ',') name += c;
            r.ti_hashes.emplace_back(name, e.short_hash());
        }
    const UNetCond cond = encode_conditioning(p, cfg, &r.warnings);
    if (p.free_params) {
        if (p.init.enabled())
            release_weights(m_, {ModelPart::TextEncoders});
        else // txt2img never encodes an image
            release_weights(m_, {ModelPart::TextEncoders, ModelPart::VaeEncoder});
    }
    r.prompt_embeds = cond.context;
    r.text_embeds = cond.text_embeds;
    r.time_ids = cond.time_ids;
    r.text_s = seconds_since(t0);
    auto context = cond.to(p.device);
    if (w_dim > 0) {
        const auto w = torch::full({cond.context.size(0)}, p.guidance_scale - 1.0, torch::kFloat32);
        context.timestep_cond = guidance_scale_embedding(w, w_dim).to(p.device);
    }

    const SchedulerConfig sc = with_params(sched_cfg ? *sched_cfg : scheduler_config(), p);
    r.schedule = effective_schedule(p.sampler, sc);
    r.eta = effective_eta(p.sampler, p.eta);
    auto sched = make_scheduler(p.sampler, sc, p.eta);
    sched->set_timesteps(p.steps);
    const int f = m_.vae_scale_factor();
    const int64_t B = int64_t(p.prompts.size()) * p.images_per_prompt;
    const int64_t C = m_.unet->config().in_channels;
    torch::Generator gen = at::detail::createCPUGenerator(uint64_t(p.seed));
    Tensor latents, extra;
    if (p.init.enabled()) { // img2img / inpaint: the truncated schedule from the noised init image
        r.init = prepare_init(p, *sched, B, gen);
        r.initial_noise = r.init.noise;
        latents = r.init.latents;
        if (r.init.unet9) {
            extra = torch::cat({r.init.mask, r.init.masked_image_latents}, 1);
            if (cfg) extra = torch::cat({extra, extra}, 0);
        }
    } else {
        r.initial_noise =
            torch::randn({B, C, p.height / f, p.width / f}, gen, torch::TensorOptions().dtype(torch::kFloat));
        latents = r.initial_noise * sched->init_noise_sigma();
    }
    r.initial_latents = latents;
    const bool blend = p.init.inpaint() && !r.init.unet9;
    const int begin = r.init.begin, n = sched->num_loop_steps() - begin;
    ctl.set_noise_levels(loop_noise_levels(*sched, sc, begin));
    ctl.set_sampler_history(sched->earlier_outputs());
    const ControlRun control(p.control, p.width, p.height, B, p.images_per_prompt, cfg, n);
    ctl.begin(n, int(B));                                         // the caches see the steps that run, numbered from 0
    UNet2DConditionModelImpl::ContextKvScope prompt_kv(*m_.unet); // the prompt's cross-attention K/V, once per loop
    util::HeapScope heap; // freed blocks reused from one step to the next and by the decode (cache/util/heap.h)
    t0 = std::chrono::steady_clock::now();
    StepRecord rec;
    for (int k = 0; k < n; ++k) {
        const int i = begin + k;
        latents = step(*sched, i, latents, control.at(context, k), p.guidance_scale, cfg, ctl, gen,
                       on_step ? &rec : nullptr, extra, k);
        if (blend) latents = blend_inpaint(r.init, *sched, i, latents, on_step ? &rec : nullptr);
        // A NaN/Inf (broken weights, fp overflow) never becomes an image: stop at the step where it appears. One
        // reduction over the latents per step, negligible next to a UNet call.
        if (!torch::isfinite(latents).all().item<bool>())
            throw Error("NaN/Inf in the latents after denoising step " + std::to_string(k + 1) + " of " +
                        std::to_string(n) + "; no image is written. Check the model weights and the guidance scale");
        r.full_steps += ctl.last_step_was_full() ? 1 : 0;
        if (on_step) on_step(rec);
        if (progress) progress({k + 1, n, seconds_since(t0), ctl.last_step_was_full(), ProgressPhase::Step, latents});
    }
    r.total_steps = n;
    r.denoise_s = seconds_since(t0);
    r.final_latents = latents;
    if (p.free_params) release_weights(m_, {ModelPart::Unet});
    if (!p.decode) return r;
    if (progress) progress({n, n, r.denoise_s, true, ProgressPhase::Decode});
    t0 = std::chrono::steady_clock::now();
    auto d = decode(latents, p.vae_decoder, p.vae_tiling);
    if (!torch::isfinite(d[0]).all().item<bool>())
        throw Error("NaN/Inf in the VAE decoder output; no image is written. Check the VAE weights");
    r.decoded = d[0];
    r.image = d[1];
    r.image_uint8 = d[2];
    r.decode_s = seconds_since(t0);
    return r;
}

std::string encode_png(const Tensor& hwc, const std::vector<PngTextChunk>& text, const std::string& what) {
    auto img = hwc.to(torch::kUInt8).contiguous();
    TORCH_CHECK(img.dim() == 3 && img.size(2) == 3, "encode_png expects [H, W, 3] uint8");
    const int h = int(img.size(0)), w = int(img.size(1));
    std::string png;
    auto sink = [](void* ctx, void* data, int size) {
        static_cast<std::string*>(ctx)->append((const char*)data, size);
    };
    if (!stbi_write_png_to_func(sink, &png, w, h, 3, img.data_ptr<uint8_t>(), w * 3))
        throw Error("cannot encode PNG '" + what + "'");
    return text.empty() ? png : png_insert_text_chunks(png, text, what);
}

void write_png(const std::string& path, const Tensor& hwc, bool overwrite, const std::vector<PngTextChunk>& text) {
    write_file_atomic(path, encode_png(hwc, text, path), overwrite);
}

} // namespace anchor::unet
