// The SD 3 denoising loop (unet/pipeline/sd3_pipeline.h).
#include "unet/pipeline/sd3_pipeline.h"

#include "cache/io/deferred_weights.h"
#include "cache/io/error.h"
#include "cache/io/json_config.h"
#include "cache/io/read_file.h"
#include "cache/io/model_source.h"
#include "cache/io/weight_map.h"
#include "unet/cache/dit_cache.h"
#include "unet/model/checkpoint.h"
#include "unet/model/name_conversion.h"
#include "unet/model/sd3_text_encoders.h"

#include <chrono>
#include <filesystem>
#include <tuple>

namespace anchor::unet {

namespace fs = std::filesystem;

SD3Models load_sd3_models(const std::string& path, torch::ScalarType dtype, bool load_t5) {
    return load_sd3_models(path, dtype, load_t5, "");
}

SD3Models load_sd3_models(const std::string& path, torch::ScalarType dtype, bool load_t5,
                          const std::string& text_encoders_dir) {
    // Every Linear built below is allocated in the load dtype and left for the checkpoint to fill
    // (cache/io/deferred_weights.h): a bf16 load never holds a float32 copy of the multi-GB transformer or T5.
    const DeferredWeights deferred(dtype);
    SD3Models m;
    m.source = path;
    const fs::path p(path);
    if (fs::is_directory(p) && !text_encoders_dir.empty())
        throw Error("--text-encoders '" + text_encoders_dir + "' is for single files; the folder '" + path +
                    "' brings its own text encoders");
    if (!fs::is_directory(p)) {
        // An original single file: the transformer under model.diffusion_model., the VAE under first_stage_model.
        // (LDM names), the text encoders under text_encoders.* (unet/model/sd3_text_encoders.h).
        const ModelSource src = resolve_model(path, {nullptr, "SD3 checkpoint"});
        const WeightMap file = src.load_weights();
        if (sd_family(sd_shapes_of_single_file(file)) != SdFamily::SD3)
            throw Error("'" + path + "' is not an SD 3 / 3.5 checkpoint (no model.diffusion_model.joint_blocks.0)");
        check_sd3_single_file_weights(file, path);
        const WeightMap w = sd3_transformer_weights_from_single_file(file);
        m.transformer = SD3Transformer2DModel(SD3TransformerConfig::detect_from_weights(w));
        m.transformer->load(w);
        m.transformer->eval();
        if (dtype != torch::kFloat) m.transformer->to(dtype);
        bool has_vae = false;
        for (const auto& [n, t] : file.all()) has_vae = has_vae || n.rfind("first_stage_model.", 0) == 0;
        if (has_vae) {
            VaeConfig base = detect_ldm_vae_config(file.with_prefix_stripped("first_stage_model."));
            // Not visible in shapes: the SD 3 / 3.5 VAE's latent statistics (its diffusers config.json).
            base.scaling_factor = 1.5305;
            base.shift_factor = 0.0609;
            m.vae = load_vae_file(path, base, dtype);
        }
        SD3TextEncoders te = load_sd3_text_encoders(file, path, text_encoders_dir, dtype, load_t5);
        m.text_encoder = te.text_encoder, m.text_encoder_2 = te.text_encoder_2, m.text_encoder_3 = te.text_encoder_3;
        m.tokenizer = std::move(te.tokenizer), m.tokenizer_2 = std::move(te.tokenizer_2);
        m.tokenizer_3 = std::move(te.tokenizer_3);
        const int64_t joint = m.transformer->config().joint_attention_dim;
        if (m.text_encoder_3 && m.text_encoder_3->config().d_model != joint)
            throw Error("'" + path + "': T5 width d_model " + std::to_string(m.text_encoder_3->config().d_model) +
                        " is not the transformer's joint_attention_dim " + std::to_string(joint));
        return m;
    }
    if (fs::exists(p / "config.json")) { // a transformer folder on its own
        m.transformer = load_sd3_transformer_folder(path, dtype);
        return m;
    }
    if (!fs::is_directory(p / "transformer"))
        throw Error("SD3 model folder '" + path + "' has no transformer/ (an SD3Transformer2DModel folder)");
    m.transformer = load_sd3_transformer_folder((p / "transformer").string(), dtype);
    if (fs::is_directory(p / "vae")) m.vae = load_vae_folder((p / "vae").string(), dtype);
    if (load_t5 && fs::is_directory(p / "text_encoder_3")) {
        if (!fs::is_directory(p / "tokenizer_3"))
            throw Error("SD3 model folder '" + path + "' has text_encoder_3/ but no tokenizer_3/");
        m.tokenizer_3 = T5Tokenizer::from_folder((p / "tokenizer_3").string());
        m.text_encoder_3 = load_t5_encoder_folder((p / "text_encoder_3").string(), dtype);
        const int64_t joint = m.transformer->config().joint_attention_dim;
        if (m.text_encoder_3->config().d_model != joint)
            throw Error("'" + (p / "text_encoder_3").string() + "': T5 width d_model " +
                        std::to_string(m.text_encoder_3->config().d_model) +
                        " is not the transformer's joint_attention_dim " + std::to_string(joint));
    }
    for (auto [te, tok, name, pad] : {std::tuple{&m.text_encoder, &m.tokenizer, "text_encoder", ClipTokenizer::kEos},
                                      std::tuple{&m.text_encoder_2, &m.tokenizer_2, "text_encoder_2", int64_t(0)}}) {
        if (!fs::is_directory(p / name)) continue;
        *te = load_text_encoder_folder((p / name).string(), dtype);
        if ((*te)->config().projection_dim <= 0)
            throw Error("'" + (p / name).string() + "': SD 3 needs a CLIPTextModelWithProjection (projection_dim)");
        const fs::path tdir = p / (std::string("tokenizer") + (name == std::string("text_encoder") ? "" : "_2"));
        *tok = fs::exists(tdir / "vocab.json") ? ClipTokenizer::from_folder(tdir.string()) : ClipTokenizer::bundled();
        if (!fs::exists(tdir / "vocab.json")) {
            tok->set_pad_id(pad);
            if (fs::is_directory(tdir)) tok->read_special_tokens(tdir.string());
        }
    }
    if (fs::exists(p / "scheduler" / "scheduler_config.json"))
        m.scheduler_config = (p / "scheduler" / "scheduler_config.json").string();
    return m;
}

namespace {
// One CLIP encoder's (hidden [B, 77, width], pooled [B, projection]) of `prompts`.
ClipConditioning clip_encode(ClipTextModelImpl& te, const ClipTokenizer& tok, const std::vector<std::string>& prompts) {
    std::vector<torch::Tensor> ids;
    for (const auto& p : prompts) ids.push_back(torch::tensor(tok.tokenize(p, 77).ids, torch::kLong));
    torch::NoGradGuard ng;
    return te.encode_penultimate(torch::stack(ids));
}
} // namespace

SD3Conditioning sd3_encode_prompts(SD3Models& m, const std::vector<std::string>& prompts,
                                   const std::vector<std::string>& negative_prompts, double guidance_scale,
                                   int max_sequence_length) {
    if (!m.text_encoder || !m.text_encoder_2)
        throw ParamError("model", "'" + m.source +
                                      "' has no text_encoder/ and text_encoder_2/ (CLIP with projections; a single "
                                      "file without text_encoders.clip_l / clip_g takes them from --text-encoders DIR)");
    if (!negative_prompts.empty() && negative_prompts.size() != prompts.size())
        throw ParamError("negative_prompt", std::to_string(negative_prompts.size()) + " negative prompts for " +
                                                std::to_string(prompts.size()) + " prompts");
    const int64_t joint = m.transformer->config().joint_attention_dim;
    auto encode = [&](const std::vector<std::string>& ps, torch::Tensor& embeds, torch::Tensor& pooled) {
        const auto a = clip_encode(*m.text_encoder, m.tokenizer, ps);
        const auto b = clip_encode(*m.text_encoder_2, m.tokenizer_2, ps);
        auto clip = torch::cat({a.hidden, b.hidden}, -1);
        if (clip.size(-1) > joint)
            throw Error("SD 3 text encoders: hidden widths " + std::to_string(a.hidden.size(-1)) + " + " +
                        std::to_string(b.hidden.size(-1)) + " exceed joint_attention_dim " + std::to_string(joint));
        clip = torch::constant_pad_nd(clip, {0, joint - clip.size(-1)});
        torch::Tensor t5;
        if (m.text_encoder_3) {
            std::vector<torch::Tensor> ids;
            for (const auto& p : ps)
                ids.push_back(torch::tensor(m.tokenizer_3.tokenize(p, max_sequence_length), torch::kLong));
            torch::NoGradGuard ng;
            t5 = m.text_encoder_3->forward(torch::stack(ids)).to(clip.device(), clip.scalar_type());
        } else {
            t5 = torch::zeros({clip.size(0), clip.size(1), joint}, clip.options()); // diffusers: the CLIP window
        }
        embeds = torch::cat({clip, t5}, 1);
        pooled = torch::cat({a.pooled, b.pooled}, -1);
    };
    SD3Conditioning c;
    encode(prompts, c.prompt_embeds, c.pooled);
    if (guidance_scale > 1.0)
        encode(negative_prompts.empty() ? std::vector<std::string>(prompts.size(), "") : negative_prompts,
               c.negative_prompt_embeds, c.negative_pooled);
    return c;
}

torch::Tensor sd3_guided_velocity(SD3Transformer2DModelImpl& transformer, const torch::Tensor& latents, double t,
                                  const SD3Conditioning& cond, double guidance_scale, const SD3SkipLayerGuidance& slg,
                                  int step, int steps, DitCacheController* cache) {
    const bool cfg = guidance_scale > 1.0;
    // The scheduler's latents stay float32 (diffusers keeps them in the transformer's dtype, but its step upcasts);
    // a bf16 / f16 transformer gets them in its own dtype and its velocity comes back as float32.
    const auto wdt = transformer.parameters().front().scalar_type();
    if (wdt != latents.scalar_type())
        return sd3_guided_velocity(transformer, latents.to(wdt), t, cond, guidance_scale, slg, step, steps, cache)
            .to(latents.scalar_type());
    const auto in = cfg ? torch::cat({latents, latents}, 0) : latents;
    const auto ctx = cfg ? torch::cat({cond.negative_prompt_embeds, cond.prompt_embeds}, 0) : cond.prompt_embeds;
    const auto pooled = cfg ? torch::cat({cond.negative_pooled, cond.pooled}, 0) : cond.pooled;
    const auto ts = torch::full({in.size(0)}, float(t), torch::kFloat);
    auto v = cache ? cache->forward(transformer, in, ctx, pooled, t, step) : transformer.forward(in, ctx, pooled, ts);
    if (!cfg) return v;
    auto parts = v.chunk(2, 0);
    auto guided = parts[0] + guidance_scale * (parts[1] - parts[0]);
    if (!slg.active(step, steps)) return guided;
    const auto skip = transformer.forward(latents, cond.prompt_embeds, cond.pooled,
                                          torch::full({latents.size(0)}, float(t), torch::kFloat), nullptr, slg.layers);
    return guided + (parts[1] - skip) * slg.scale;
}

torch::Tensor sd3_denoise(SD3Transformer2DModelImpl& transformer, Scheduler& scheduler, torch::Tensor latents,
                          const SD3Conditioning& cond, double guidance_scale, const SD3StepCallback& on_step,
                          const SD3SkipLayerGuidance& slg, DitCacheController* cache) {
    const int n = scheduler.num_loop_steps();
    if (cache) {
        // The cache's steps are the loop's from its first (an img2img loop starts later): step k is loop step
        // begin + k, with that step's noise level.
        const auto sig = scheduler.sigmas();
        const int b = scheduler.begin_index();
        std::vector<double> levels;
        for (int i = b; i < n && size_t(i) < sig.size(); ++i) levels.push_back(sig[size_t(i)]);
        cache->begin(n - b, levels, int(latents.size(0)), b);
    }
    for (int i = scheduler.begin_index(); i < n; ++i) {
        const auto v = sd3_guided_velocity(transformer, scheduler.scale_model_input(latents, i), scheduler.timestep(i),
                                           cond, guidance_scale, slg, i, n, cache);
        latents = scheduler.step(v, i, latents, nullptr);
        if (on_step) on_step(i, v, latents);
    }
    return latents;
}

torch::Tensor sd3_decode(AutoencoderKLImpl& vae, const torch::Tensor& latents) {
    const auto wdt = vae.parameters().front().scalar_type(); // a bf16 / f16 VAE decodes in its dtype
    return (vae.decode(vae.config().unscale_latents(latents).to(wdt)).to(torch::kFloat) / 2 + 0.5).clamp(0, 1);
}

bool is_sd3_model(const std::string& path) {
    const fs::path p(path);
    auto class_of = [](const fs::path& config) {
        if (!fs::exists(config)) return std::string();
        try {
            return JsonConfig::load(config.string(), "config").get_string("_class_name", "");
        } catch (const std::exception&) {
            return std::string();
        }
    };
    if (fs::is_directory(p))
        return class_of(p / "model_index.json") == "StableDiffusion3Pipeline" ||
               class_of(p / "transformer" / "config.json") == "SD3Transformer2DModel" ||
               class_of(p / "config.json") == "SD3Transformer2DModel";
    if (!fs::is_regular_file(p) || p.extension() != ".safetensors") return false;
    try {
        return WeightMap::load(path).has("model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight");
    } catch (const std::exception&) {
        return false;
    }
}

std::unique_ptr<Scheduler> sd3_make_scheduler(const SD3Models& m, int steps, int64_t latent_h, int64_t latent_w,
                                              double shift, double* shift_used) {
    // SD 3 / 3.5's scheduler_config.json, for a single file that brings none.
    const std::string text =
        m.scheduler_config.empty()
            ? std::string(R"({"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0})")
            : read_file(m.scheduler_config, "scheduler config");
    const std::string label = m.scheduler_config.empty() ? "SD 3 default scheduler" : m.scheduler_config;
    SchedulerConfig c = SchedulerConfig::from_json_text(text, label);
    if (sampler_from_class_name(c.class_name) != SamplerKind::FlowMatchEuler)
        throw Error("'" + label + "': the scheduler is " + c.class_name + ", not FlowMatchEulerDiscreteScheduler");
    const auto bad = unsupported_scheduler_settings(text, SamplerKind::FlowMatchEuler);
    if (!bad.empty()) throw Error("'" + label + "': " + bad.front());
    if (shift > 0) c.shift = shift;
    if (shift_used) *shift_used = c.shift;
    const int64_t patch = m.transformer->config().patch_size;
    if (c.use_dynamic_shifting) c.mu = flow_match_mu(c, (latent_h / patch) * (latent_w / patch));
    auto s = make_scheduler(SamplerKind::FlowMatchEuler, c);
    s->set_timesteps(steps);
    return s;
}

int sd3_img2img_start(int steps, double strength) {
    if (!(strength > 0.0) || strength > 1.0)
        throw ParamError("strength", "must be in (0, 1], got " + std::to_string(strength));
    const double init_timestep = std::min(double(steps) * strength, double(steps));
    const int t_start = int(std::max(double(steps) - init_timestep, 0.0));
    if (steps - t_start < 1)
        throw ParamError("strength", "strength " + std::to_string(strength) + " at " + std::to_string(steps) +
                                         " steps leaves no step to run");
    return t_start;
}

torch::Tensor sd3_img2img_latents(AutoencoderKLImpl& vae, const torch::Tensor& image, int64_t batch,
                                  const Scheduler& scheduler, int begin, torch::Generator& gen,
                                  torch::Tensor* image_latents, torch::Tensor* noise) {
    torch::NoGradGuard ng;
    const auto w = vae.parameters().front();
    const auto d = vae.encode(image.to(w.device(), w.scalar_type()));
    const auto f32 = torch::TensorOptions().dtype(torch::kFloat);
    const auto mean = d.mean.to(torch::kCPU, torch::kFloat), stdv = d.std.to(torch::kCPU, torch::kFloat);
    const auto z = mean + stdv * torch::randn(mean.sizes(), gen, f32);
    auto latents = (z - vae.config().shift_factor) * vae.config().scaling_factor;
    if (batch % latents.size(0) != 0)
        throw ParamError("init_image", std::to_string(latents.size(0)) + " init images for a batch of " +
                                           std::to_string(batch));
    if (latents.size(0) < batch) latents = torch::cat(std::vector<torch::Tensor>(size_t(batch / latents.size(0)), latents), 0);
    const auto n = torch::randn(latents.sizes(), gen, f32);
    if (image_latents) *image_latents = latents;
    if (noise) *noise = n;
    return scheduler.add_noise(latents, n, begin);
}

SD3RunShape sd3_check_params(const SD3Models& m, const SD3Txt2ImgParams& p) {
    if (p.prompts.empty()) throw ParamError("prompts", "no prompt");
    if (p.steps < 1 || p.steps > 10000) throw ParamError("steps", "must be in [1, 10000], got " + std::to_string(p.steps));
    if (!m.vae) throw ParamError("model", "'" + m.source + "' has no VAE (vae/ or first_stage_model.*)");
    const auto& tc = m.transformer->config();
    const int f = m.vae_scale_factor(), unit = f * tc.patch_size;
    SD3RunShape r;
    r.width = p.width > 0 ? p.width : tc.sample_size * f;
    r.height = p.height > 0 ? p.height : tc.sample_size * f;
    const bool img2img = p.init.enabled();
    if (img2img) {
        if (p.init.inpaint()) throw ParamError("mask", "SD 3 inpainting is not implemented (img2img only)");
        Img2ImgParams files = p.init;
        files.strength = 1.0; // SD 3's own strength rule below
        const auto [iw, ih] = files.validate(p.steps, int64_t(p.prompts.size()));
        // VaeImageProcessor.get_default_height_width: the image's size rounded down to the VAE factor.
        const int w = iw - iw % f, h = ih - ih % f;
        for (auto [given, v, field] : {std::tuple{p.width, w, "width"}, std::tuple{p.height, h, "height"}})
            if (given > 0 && given != v)
                throw ParamError(field, "img2img runs at the init image's size (" + std::to_string(w) + "x" +
                                            std::to_string(h) + "), got " + std::to_string(given));
        r.width = w, r.height = h;
        r.begin = sd3_img2img_start(p.steps, p.init.strength);
    }
    for (auto [v, field] : {std::pair{r.width, "width"}, std::pair{r.height, "height"}}) {
        if (v % unit != 0)
            throw ParamError(field, "must be a multiple of " + std::to_string(unit) + " (VAE factor " +
                                        std::to_string(f) + " x patch size " + std::to_string(tc.patch_size) +
                                        "), got " + std::to_string(v));
        if (v / unit > tc.pos_embed_max_size)
            throw ParamError(field, std::to_string(v) + " exceeds the transformer's position grid (" +
                                        std::to_string(tc.pos_embed_max_size) + " patches = " +
                                        std::to_string(tc.pos_embed_max_size * unit) + " pixels)");
    }
    return r;
}

SD3Txt2ImgResult sd3_txt2img(SD3Models& m, const SD3Txt2ImgParams& p, const std::function<void(int, int)>& on_step) {
    using clock = std::chrono::steady_clock;
    auto since = [](clock::time_point t) { return std::chrono::duration<double>(clock::now() - t).count(); };
    const SD3RunShape shape = sd3_check_params(m, p);
    const auto& tc = m.transformer->config();
    const int f = m.vae_scale_factor();
    SD3Txt2ImgResult r;
    r.width = shape.width, r.height = shape.height;
    const bool img2img = p.init.enabled();
    const int begin = shape.begin;
    DitCacheController cache(p.cache); // the mode applies to the transformer, before any work
    cache.record_teacache = p.record_teacache;
    auto t0 = clock::now();
    const auto cond = sd3_encode_prompts(m, p.prompts, p.negative_prompts, p.guidance_scale, p.max_sequence_length);
    r.t5 = bool(m.text_encoder_3);
    r.encode_s = since(t0);
    // diffusers' prepare_latents: randn_tensor on the CPU generator, float32 (img2img: the VAE posterior's draw, then
    // the noise's).
    torch::Generator gen = at::detail::createCPUGenerator(uint64_t(p.seed));
    const int64_t B = int64_t(p.prompts.size());
    auto scheduler = sd3_make_scheduler(m, p.steps, r.height / f, r.width / f, p.shift, &r.shift);
    torch::Tensor latents;
    if (img2img) {
        scheduler->set_begin_index(begin);
        latents = sd3_img2img_latents(*m.vae, preprocess_image(p.init.rgb_batch(), r.width, r.height), B, *scheduler,
                                      begin, gen);
    } else {
        latents = torch::randn({B, int64_t(tc.in_channels), r.height / f, r.width / f}, gen,
                               torch::TensorOptions().dtype(torch::kFloat));
    }
    t0 = clock::now();
    {
        torch::NoGradGuard ng;
        const auto dev = m.transformer->parameters().front().device();
        SD3Conditioning c = cond;
        for (auto* t : {&c.prompt_embeds, &c.pooled, &c.negative_prompt_embeds, &c.negative_pooled})
            if (t->defined()) *t = t->to(dev);
        latents = sd3_denoise(*m.transformer, *scheduler, latents.to(dev), c, p.guidance_scale,
                              [&](int i, const torch::Tensor&, const torch::Tensor&) {
                                  if (on_step) on_step(i, p.steps);
                              },
                              p.slg, &cache);
    }
    r.denoise_s = since(t0);
    r.cache_steps = cache.log();
    r.cache_log = cache.log_json();
    r.teacache_samples = cache.teacache_samples();
    t0 = clock::now();
    {
        torch::NoGradGuard ng;
        r.image = sd3_decode(*m.vae, latents).to(torch::kCPU, torch::kFloat);
    }
    r.image_uint8 = (r.image * 255).round().to(torch::kUInt8).permute({0, 2, 3, 1}).contiguous();
    r.decode_s = since(t0);
    return r;
}

} // namespace anchor::unet
