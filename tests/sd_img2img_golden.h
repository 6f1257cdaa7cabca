// Shared by tests/test_img2img.cpp and tests/golden_runner/check_sd_img2img.cpp: the comparisons of one img2img or
// inpaint golden run (tests/golden/sd/img2img_tiny, inpaint_tiny; diffusers 0.27.2 StableDiffusionImg2ImgPipeline /
// StableDiffusionInpaintPipeline), teacher-forced and free-running.
//
// A run is a `<run>.safetensors` holding `init_image_uint8` and `step.0.noise_pred`; its parameters come from
// config.json (top level, overridden by runs.<run>): prompts, guidance, seed, size, sampler, steps, strength, the
// UNet (runs.<run>.unet names one of "models"), the schedule the case states (t_start, timesteps, sigmas, ...). A key
// this checker does not understand, or a stated value that contradicts the engine's, fails the case naming the key.
//
// Teacher-forced: the init stage through the library's prepare_init (init image, posterior mean/std, the generator's
// draws in diffusers' order, image / masked-image latents, mask, initial latents), then every step recomputed from the
// stored values before it (as tests/sd_pipeline_golden.h). Free-running: Txt2ImgPipeline::run from the seed, compared
// with the README's suggested tolerances, widened to 2x the worst case tolerances.json measured when that is larger.
#pragma once

#include "tests/sd_pipeline_golden.h"

#include <torch/version.h>
#include "unet/pipeline/img2img.h"

#include <optional>

namespace anchor::sdgolden {

// The img2img / inpaint runs of a folder: `<run>.safetensors` with init_image_uint8 and step.0.noise_pred.
inline std::vector<std::string> img2img_runs_of(const std::filesystem::path& dir) {
    std::vector<std::string> runs;
    if (!std::filesystem::is_directory(dir)) return runs;
    for (const auto& e : std::filesystem::directory_iterator(dir)) {
        if (e.path().extension() != ".safetensors") continue;
        try {
            auto f = SafeTensorsFile::open(e.path().string());
            if (f->has("step.0.noise_pred") && f->has("init_image_uint8")) runs.push_back(e.path().stem().string());
        } catch (...) {
        }
    }
    std::sort(runs.begin(), runs.end());
    return runs;
}

struct Img2ImgRunSpec {
    unet::Txt2ImgParams params;
    unet::SchedulerConfig scheduler;
    std::string unet_folder; // relative to the case's parent folder, as "models" names it
    nlohmann::json stated;   // the schedule facts the case states (t_start, timesteps, ...), checked in compare
};

namespace detail {

inline bool s_has(const nlohmann::json& j, const char* k) {
    return j.contains(k) && !j[k].is_null();
}

// "../unet_sd15_tiny (4 channels)" -> "../unet_sd15_tiny"; trailing '/' dropped.
inline std::string folder_token(const std::string& s) {
    std::string t = s.substr(0, s.find(' '));
    while (t.size() > 1 && t.back() == '/') t.pop_back();
    return t;
}

} // namespace detail

// vae_factor 0: not checked (the models are not loaded yet).
inline Img2ImgRunSpec read_img2img_spec(const nlohmann::json& cfg, const std::string& run, int vae_factor) {
    const nlohmann::json m = run_parameters(cfg, run);
    static const std::set<std::string> parameters = with_prompt_parameters(
        {"vae_scale_factor", "scheduler_base_config", "scheduler", "num_inference_steps", "strength", "t_start",
         "num_denoising_steps", "init_timestep", "all_timesteps", "timesteps", "begin_index", "order", "sigmas",
         "init_noise_sigma", "is_strength_max", "unet", "eta", "clip_skip", "generator_uses", "init_image", "init_images",
         "mask_image", "mask_images"});
    // Descriptive: how the case was made (the image and weight seeds, the forward golden's inputs, the 9-channel
    // UNet's config, checked against its folder when loaded), and what was verified when it was made.
    static const std::set<std::string> descriptive = {
        "set", "image_seed", "image_seeds", "mask_seed", "mask_seeds", "unet_inpaint_seed", "unet_golden", "unet_inpaint_config", "real_pipeline_call_vs_golden"};
    std::set<std::string> known = parameters;
    known.insert(descriptive.begin(), descriptive.end());
    Img2ImgRunSpec s;
    auto& p = s.params;
    read_prompt_parameters(m, run, known, p);
    auto need = [&](const char* k) -> const nlohmann::json& { return detail::need(m, run, k); };
    if (m.contains("eta")) p.eta = m["eta"].get<double>(); // unset: the sampler's default
    p.clip_skip = m.value("clip_skip", 0);
    p.prompt_syntax = unet::PromptSyntax::Plain; // the reference is diffusers: brackets are text
    p.steps = need("num_inference_steps").get<int>();
    p.sampler = sampler_from_class(need("scheduler").get<std::string>());
    // No size: the init image's, rounded down to the VAE factor (img2img's __call__ takes none).
    if (m.contains("height") || m.contains("width")) {
        p.height = need("height").get<int>();
        p.width = need("width").get<int>();
    }
    if (vae_factor > 0 && m.contains("vae_scale_factor") && m["vae_scale_factor"].get<int>() != vae_factor)
        throw Error("config.json: vae_scale_factor " + m["vae_scale_factor"].dump() + ", the models' VAE has " +
                    std::to_string(vae_factor));
    p.init.strength = need("strength").get<double>();
    check_scheduler_settings(need("scheduler_base_config"), p.sampler, "config.json: scheduler_base_config");
    s.scheduler = unet::SchedulerConfig::from_json_text(need("scheduler_base_config").dump(),
                                                        "config.json:scheduler_base_config");
    // The UNet: runs.<run>.unet names a folder of "models" (inpaint), else models.unet.
    const auto& models = need("models");
    if (m.contains("unet")) {
        const std::string want = detail::folder_token(m["unet"].get<std::string>());
        for (const auto& [k, v] : models.items())
            if (v.is_string() && detail::folder_token(v.get<std::string>()) == want) s.unet_folder = want;
        if (s.unet_folder.empty()) throw Error("config.json: runs." + run + ".unet '" + want + "' is not in 'models'");
    } else {
        if (!models.contains("unet"))
            throw Error("config.json: 'models' has no 'unet' and runs." + run + " names none");
        s.unet_folder = detail::folder_token(models["unet"].get<std::string>());
    }
    for (const char* k : {"t_start", "num_denoising_steps", "init_timestep", "all_timesteps", "timesteps",
                          "begin_index", "order", "sigmas", "init_noise_sigma", "is_strength_max", "generator_uses"})
        if (m.contains(k)) s.stated[k] = m[k];
    return s;
}

// Models of an img2img / inpaint case: the VAE and text encoder of "models", and the UNet the run names.
struct Img2ImgModels {
    std::map<std::string, unet::UNet2DConditionModel> unets; // by folder token
    unet::SDModels base;                                     // VAE, text encoder, tokenizer
};

// Model folders are relative to the case folder (not to its parent, as the txt2img cases'); the vocabulary is a
// vocab/ folder of the case or of an ancestor, else the bundled copy.
inline unet::SDModels models_for(Img2ImgModels& mm, const std::filesystem::path& dir, const nlohmann::json& cfg,
                                 const std::string& unet_folder) {
    namespace fs = std::filesystem;
    if (!mm.base.vae) {
        const auto& mods = cfg.at("models");
        auto folder = [&](const char* k) {
            if (!mods.contains(k) || !mods[k].is_string())
                throw Error("config.json: 'models' has no '" + std::string(k) + "'");
            return (dir / detail::folder_token(mods[k].get<std::string>())).string();
        };
        unet::SDModels m;
        m.layout = "diffusers-components";
        m.vae = unet::load_vae_folder(folder("vae"));
        m.text_encoder = unet::load_text_encoder_folder(folder("text_encoder"));
        m.tokenizer = unet::ClipTokenizer::bundled();
        for (fs::path p = dir; !p.empty() && p != p.parent_path(); p = p.parent_path())
            if (fs::exists(p / "vocab" / "bpe_simple_vocab_16e6.txt.gz")) {
                m.tokenizer =
                    unet::ClipTokenizer::from_bpe_file((p / "vocab" / "bpe_simple_vocab_16e6.txt.gz").string());
                break;
            }
        m.family = unet::SdFamily::SD1;
        mm.base = m;
    }
    if (!mm.unets.count(unet_folder))
        mm.unets.emplace(unet_folder, unet::load_unet_folder((dir / unet_folder).string()));
    unet::SDModels m = mm.base;
    m.unet = mm.unets.at(unet_folder);
    return m;
}

// Free-running tolerances: the README's suggestions, or 2x the worst tolerances.json measured for the run when
// larger (fp32 with 4 threads, float64 vs the float32 golden).
struct FreeTolerance {
    double final_latents_rel = 1e-1, image_abs = 1.5e-1;
};
inline FreeTolerance free_tolerance(const std::filesystem::path& dir, const std::string& run) {
    FreeTolerance t;
    if (!std::filesystem::exists(dir / "tolerances.json")) return t;
    const auto j = read_json_file(dir / "tolerances.json");
    for (const char* set : {"fp32_4threads", "fp64_vs_fp32_golden"}) {
        if (!j.contains(set) || !j[set].contains(run)) continue;
        const auto& r = j[set][run];
        if (r.contains("final_latents"))
            t.final_latents_rel = std::max(t.final_latents_rel, 2 * r["final_latents"].value("max_rel_to_max", 0.0));
        if (r.contains("image")) t.image_abs = std::max(t.image_abs, 2 * r["image"].value("max_abs", 0.0));
    }
    return t;
}

// The rows of `t` tiled to `rows` (diffusers' cat([x] * k) / repeat(k, 1, 1, 1)) when it has fewer and they divide;
// else `t`. A golden may store an image-batch tensor before or after it is tiled to the prompt batch.
inline torch::Tensor tile_rows(const torch::Tensor& t, int64_t rows) {
    if (!t.defined() || t.size(0) >= rows || rows % t.size(0) != 0) return t;
    std::vector<int64_t> reps(size_t(t.dim()), 1);
    reps[0] = rows / t.size(0);
    return t.repeat(reps);
}
// A comparison of an engine tensor with a golden one whose batch rows may be the image count or the batch's.
inline Comparison batch_comparison(const std::string& name, const torch::Tensor& a, const torch::Tensor& b,
                                   double atol = 1e-4, double rtol = 1e-4,
                                   Comparison::Kind kind = Comparison::Close) {
    const int64_t rows = std::max(a.size(0), b.size(0));
    return {name, tile_rows(a, rows), tile_rows(b, rows), atol, rtol, kind};
}

// Image files the case's config names for a run (top level or runs.<run>: init_image / init_images, mask_image /
// mask_images: a PNG or a list of PNGs, relative to the case folder): each must hold the pixels of the run file's
// init_image_uint8 / mask_image_uint8 row of its index.
inline void check_named_images(const std::filesystem::path& dir, const nlohmann::json& cfg, const std::string& run,
                               const unet::Img2ImgParams& in, std::vector<Comparison>& out) {
    const nlohmann::json m = run_parameters(cfg, run);
    auto files = [&](std::initializer_list<const char*> keys) {
        std::vector<std::string> v;
        for (const char* k : keys)
            if (m.contains(k) && !m[k].is_null()) {
                const auto more = detail::string_or_list(m[k], k);
                v.insert(v.end(), more.begin(), more.end());
            }
        return v;
    };
    const auto inits = files({"init_image", "init_images"});
    const auto masks = files({"mask_image", "mask_images"});
    auto check = [&](const std::vector<std::string>& names, const torch::Tensor& px, bool grey) {
        const auto batch = px.dim() == (grey ? 2 : 3) ? px.unsqueeze(0) : px;
        if (!names.empty() && int64_t(names.size()) != batch.size(0))
            throw Error("config.json: runs." + run + " names " + std::to_string(names.size()) + " " +
                        (grey ? "mask" : "init") + " image files, the run file holds " +
                        std::to_string(batch.size(0)));
        for (size_t k = 0; k < names.size(); ++k) {
            const auto path = (dir / names[k]).string();
            out.push_back({"config image file " + names[k],
                           grey ? unet::read_image_grey(path, "mask") : unet::read_image_rgb(path, "init_image"),
                           batch[int64_t(k)], 0, 0, Comparison::Exact});
        }
    };
    check(inits, in.init_pixels, false);
    if (in.mask_pixels.defined()) check(masks, in.mask_pixels, true);
    else if (!masks.empty()) throw Error("config.json: runs." + run + " names mask images, the run file has none");
}

inline std::vector<Comparison> compare_img2img_run(Img2ImgModels& mm, const std::filesystem::path& dir,
                                                   const nlohmann::json& cfg, const std::string& run) {
    using torch::Tensor;
    std::vector<Comparison> out;
    auto g = WeightMap::load((dir / (run + ".safetensors")).string());
    // The models first (the UNet the run names), then the spec again with the VAE factor checked.
    unet::SDModels models = models_for(mm, dir, cfg, read_img2img_spec(cfg, run, 0).unet_folder);
    const int f = models.vae_scale_factor();
    Img2ImgRunSpec spec = read_img2img_spec(cfg, run, f);
    auto& params = spec.params;
    // uint8 [H, W, 3] or [N, H, W, 3] (N images for the batch: one broadcast, or one per prompt image), masks [H, W]
    // or [N, H, W]: the pipeline takes both forms.
    params.init.init_pixels = g.get("init_image_uint8");
    const bool inpaint = g.has("mask_image_uint8");
    if (inpaint) params.init.mask_pixels = g.get("mask_image_uint8");
    check_named_images(dir, cfg, run, params.init, out);
    const int64_t images = int64_t(params.prompts.size()) * params.images_per_prompt;
    const bool cfg_on = params.guidance_scale > 1.0;
    unet::Txt2ImgPipeline pipe(models);
    pipe.validate(params);
    params = pipe.resolved(params); // a case without a size: the init image's
    c10::InferenceMode guard;

    compare_prompts(pipe, params, g, cfg_on, out);

    // Schedule: get_timesteps and the facts the case states.
    auto sched = unet::make_scheduler(params.sampler, spec.scheduler, params.eta);
    sched->set_timesteps(params.steps);
    torch::Generator gen = at::detail::createCPUGenerator(uint64_t(params.seed));
    const auto in = pipe.prepare_init(params, *sched, images, gen);
    const auto st = unet::strength_schedule(params.steps, params.init.strength);
    const auto all = sched->timesteps();
    const std::vector<double> run_ts(all.begin() + in.begin, all.end());
    auto f64 = [](const std::vector<double>& v) { return torch::tensor(v, torch::kFloat64); };
    auto scalar = [](double v) { return torch::tensor(std::vector<double>{v}, torch::kFloat64); };
    out.push_back({"timesteps", f64(run_ts), g.get("timesteps").to(torch::kFloat64), 0, 0, Comparison::Exact});
    if (detail::s_has(spec.stated, "timesteps"))
        out.push_back({"config timesteps", f64(run_ts), f64(spec.stated["timesteps"].get<std::vector<double>>()), 0, 0,
                       Comparison::Exact});
    out.push_back({"latent_timestep", scalar(sched->timestep(in.begin)).expand({images}),
                   g.get("latent_timestep").to(torch::kFloat64), 0, 0, Comparison::Exact});
    const auto& s = spec.stated;
    auto stated_int = [&](const char* k, double v) {
        if (s.contains(k) && !s[k].is_null())
            out.push_back({std::string("config ") + k, scalar(v), scalar(s[k].get<double>()), 0, 0, Comparison::Exact});
    };
    stated_int("t_start", st.t_start);
    stated_int("init_timestep", st.init_timestep);
    stated_int("num_denoising_steps", double(run_ts.size()));
    stated_int("order", 1);
    stated_int("begin_index", in.begin); // null for DDIM (no set_begin_index there): the same loop offset
    if (s.contains("is_strength_max"))
        out.push_back({"config is_strength_max", scalar(params.init.strength == 1.0 ? 1 : 0),
                       scalar(s["is_strength_max"].get<bool>() ? 1 : 0), 0, 0, Comparison::Exact});
    if (s.contains("all_timesteps"))
        out.push_back({"config all_timesteps", f64(all), f64(s["all_timesteps"].get<std::vector<double>>()), 0, 0,
                       Comparison::Exact});
    if (s.contains("sigmas") && !s["sigmas"].is_null())
        // Bit for bit on the reference's LibTorch (1.x); LibTorch 2's float32 linspace rounds the schedule's betas
        // differently in the last bit, so there the golden README's sigma tolerance (rtol 1e-6) applies.
#if TORCH_VERSION_MAJOR >= 2
        out.push_back({"config sigmas", f64(sched->sigmas()), f64(s["sigmas"].get<std::vector<double>>()), 0, 1e-6});
#else
        out.push_back({"config sigmas", f64(sched->sigmas()), f64(s["sigmas"].get<std::vector<double>>()), 0, 0,
                       Comparison::Exact});
#endif
    if (s.contains("init_noise_sigma"))
        out.push_back({"config init_noise_sigma", scalar(sched->init_noise_sigma()),
                       scalar(s["init_noise_sigma"].get<double>()), 0, 1e-6});
    if (s.contains("generator_uses")) { // the number of posterior samples drawn, in the stated order
        int stated = 0;
        for (const auto& u : s["generator_uses"])
            stated += u.get<std::string>().find("posterior sample") != std::string::npos ? 1 : 0;
        const int drawn = (in.image_latents.defined() ? 1 : 0) + (in.masked_image_latents.defined() ? 1 : 0);
        out.push_back(
            {"config generator_uses (posterior samples)", scalar(drawn), scalar(stated), 0, 0, Comparison::Exact});
    }

    // Init stage (prepare_latents / prepare_mask_latents), generator parity included.
    out.push_back({"init_image", in.init_image, g.get("init_image"), 0, 0, Comparison::Exact});
    const std::string enc = g.has("vae_encode_mean") ? "vae_encode_" : "image_encode_";
    if (g.has(enc + "mean")) {
        if (!in.image_latents.defined()) throw Error(run + ": the golden encodes the init image, the engine does not");
        out.push_back({enc + "mean", in.image_encode_mean, g.get(enc + "mean")});
        out.push_back({enc + "std", in.image_encode_std, g.get(enc + "std")});
        // One draw of the N images' posterior shape, as diffusers' latent_dist.sample(generator).
        out.push_back(
            {enc + "noise (generator parity)", in.image_encode_noise, g.get(enc + "noise"), 0, 0, Comparison::Exact});
        if (g.has("vae_encode_sample"))
            out.push_back({"vae_encode_sample", in.image_encode_mean + in.image_encode_std * in.image_encode_noise,
                           g.get("vae_encode_sample")});
        const std::string lat = g.has("init_latents") ? "init_latents" : "image_latents";
        out.push_back(batch_comparison(lat, in.image_latents, g.get(lat)));
    } else if (in.image_latents.defined()) {
        throw Error(run + ": the engine encodes the init image, the golden does not");
    }
    out.push_back({"noise (generator parity)", in.noise, g.get("noise"), 0, 0, Comparison::Exact});
    out.push_back({"initial_latents", in.latents, g.get("initial_latents")});
    if (inpaint) {
        out.push_back(
            batch_comparison("mask_condition", in.mask_condition, g.get("mask_condition"), 0, 0, Comparison::Exact));
        out.push_back(batch_comparison("mask", in.mask, g.get("mask"), 0, 0, Comparison::Exact));
        out.push_back(batch_comparison("masked_image", in.masked_image, g.get("masked_image"), 0, 0, Comparison::Exact));
        out.push_back({"masked_image_encode_mean", in.masked_image_encode_mean, g.get("masked_image_encode_mean")});
        out.push_back({"masked_image_encode_std", in.masked_image_encode_std, g.get("masked_image_encode_std")});
        out.push_back({"masked_image_encode_noise (generator parity)", in.masked_image_encode_noise,
                       g.get("masked_image_encode_noise"), 0, 0, Comparison::Exact});
        out.push_back(batch_comparison("masked_image_latents", in.masked_image_latents, g.get("masked_image_latents")));
    }

    // Teacher-forced steps; the stored mask / masked-image latents / image latents / noise feed the later stages.
    auto ctx = g.get("prompt_embeds");
    Tensor extra;
    if (in.unet9) {
        extra = torch::cat({tile_rows(g.get("mask"), images), tile_rows(g.get("masked_image_latents"), images)}, 1);
        if (cfg_on) extra = torch::cat({extra, extra}, 0);
    }
    unet::InitLatents golden_in = in;
    if (inpaint && !in.unet9) {
        golden_in.mask = tile_rows(g.get("mask"), images);
        golden_in.image_latents = tile_rows(g.get("image_latents"), images);
        golden_in.noise = g.get("noise");
    }
    const int n = sched->num_loop_steps() - in.begin;
    for (int k = 0; k < n; ++k) {
        const int i = in.begin + k;
        const std::string p = "step." + std::to_string(k) + ".";
        if (!g.has(p + "latents")) throw Error(run + ": no " + p + "latents for loop step " + std::to_string(k));
        auto state = k == 0 ? g.get("initial_latents") : g.get("step." + std::to_string(k - 1) + ".latents");
        auto mi = sched->scale_model_input(cfg_on ? torch::cat({state, state}, 0) : state, i);
        if (extra.defined()) mi = torch::cat({mi, extra}, 1);
        out.push_back({p + "model_input", mi, g.get(p + "model_input")});
        auto t = torch::tensor(sched->timestep(i), torch::kFloat).reshape({});
        out.push_back({p + "noise_pred", models.unet->forward(g.get(p + "model_input"), t, ctx),
                       g.get(p + "noise_pred"), 5e-3, 1e-4});
        auto guided =
            cfg_on ? unet::cfg_combine(g.get(p + "noise_pred"), params.guidance_scale) : g.get(p + "noise_pred");
        out.push_back({p + "guided_noise_pred", guided, g.get(p + "guided_noise_pred")});
        auto next = sched->step(g.get(p + "guided_noise_pred"), i, state, &gen);
        if (inpaint && !in.unet9) {
            out.push_back({p + "scheduler_output", next, g.get(p + "scheduler_output")});
            unet::StepRecord rec;
            pipe.blend_inpaint(golden_in, *sched, i, g.get(p + "scheduler_output"), &rec);
            out.push_back({p + "init_latents_proper", rec.init_latents_proper, g.get(p + "init_latents_proper")});
            out.push_back({p + "latents", rec.latents, g.get(p + "latents")});
        } else {
            out.push_back({p + "latents", next, g.get(p + "latents")});
        }
    }
    if (g.has("step." + std::to_string(n) + ".latents"))
        throw Error(run + ": the golden has more loop steps than the engine's " + std::to_string(n));

    // Free-running, through the pipeline a user runs; the PNGs the case names hold the golden image.
    auto r = pipe.run(params, nullptr, {}, {}, &spec.scheduler);
    const auto tol = free_tolerance(dir, run);
    out.push_back({"free-running initial_noise", r.initial_noise, g.get("noise"), 0, 0, Comparison::Exact});
    out.push_back({"free-running initial_latents", r.initial_latents, g.get("initial_latents")});
    out.push_back({"free-running final_latents", r.final_latents, g.get("final_latents"), tol.final_latents_rel, 0,
                   Comparison::RelMax});
    out.push_back({"free-running image", r.image, g.get("image"), tol.image_abs, 0});
    const auto rc = cfg["runs"][run];
    if (rc.contains("png")) {
        const auto pngs = detail::string_or_list(rc["png"], "png");
        const auto golden_u8 = g.get("image_uint8");
        if (int64_t(pngs.size()) > golden_u8.size(0))
            throw Error("config.json: runs." + run + ".png names " + std::to_string(pngs.size()) + " files for " +
                        std::to_string(golden_u8.size(0)) + " images");
        for (size_t j = 0; j < pngs.size(); ++j)
            out.push_back({"free-running golden file " + pngs[j], unet::read_image_rgb((dir / pngs[j]).string(), "png"),
                           golden_u8[int64_t(j)], 0, 0, Comparison::Exact});
    }
    return out;
}

// The forward golden of a UNet of the case (golden_*.safetensors with sample / timesteps / encoder_hidden_states /
// out): the UNet of "models" whose input channels match the sample's.
inline bool is_unet_forward_golden(const std::filesystem::path& p) {
    try {
        auto f = SafeTensorsFile::open(p.string());
        return f->has("sample") && f->has("timesteps") && f->has("encoder_hidden_states") && f->has("out");
    } catch (...) {
        return false;
    }
}

inline std::vector<Comparison> compare_unet_forward(Img2ImgModels& mm, const std::filesystem::path& dir,
                                                    const nlohmann::json& cfg, const std::filesystem::path& file) {
    auto g = WeightMap::load(file.string());
    const auto sample = g.get("sample");
    c10::InferenceMode guard;
    std::vector<Comparison> out;
    for (const auto& [k, v] : cfg.at("models").items()) {
        if (k == "vae" || k == "text_encoder" || !v.is_string()) continue;
        const std::string folder = detail::folder_token(v.get<std::string>());
        auto m = models_for(mm, dir, cfg, folder);
        if (m.unet->config().in_channels != sample.size(1)) continue;
        if (cfg.contains("unet_golden") && cfg["unet_golden"].contains("timesteps"))
            out.push_back({"timesteps (config unet_golden)", g.get("timesteps").to(torch::kFloat64),
                           torch::tensor(cfg["unet_golden"]["timesteps"].get<std::vector<double>>(), torch::kFloat64),
                           0, 0, Comparison::Exact});
        if (cfg.contains("unet_inpaint_config") && cfg["unet_inpaint_config"].contains("in_channels"))
            out.push_back({"in_channels (config unet_inpaint_config)",
                           torch::tensor(std::vector<double>{double(m.unet->config().in_channels)}, torch::kFloat64),
                           torch::tensor(std::vector<double>{cfg["unet_inpaint_config"]["in_channels"].get<double>()},
                                         torch::kFloat64),
                           0, 0, Comparison::Exact});
        // The README's 1e-4, or 2x the worst case tolerances.json measured for this forward ("<name>_forward":
        // float32 with 4 threads, float64 vs the float32 golden) when larger: the random 9-channel UNet's 1x1 levels
        // amplify rounding, so torch's own float32 re-runs differ by ~1e-4.
        double atol = 1e-4;
        const std::string stem = file.stem().string();
        const std::string key = (stem.rfind("golden_", 0) == 0 ? stem.substr(7) : stem) + "_forward";
        if (std::filesystem::exists(dir / "tolerances.json")) {
            const auto tj = read_json_file(dir / "tolerances.json");
            for (const char* set : {"fp32_4threads", "fp64_vs_fp32_golden"})
                if (tj.contains(set) && tj[set].contains(key))
                    atol = std::max(atol, 2 * tj[set][key].value("max_abs", 0.0));
        }
        out.push_back({folder + " out", m.unet->forward(sample, g.get("timesteps"), g.get("encoder_hidden_states")),
                       g.get("out"), atol, 1e-4});
        return out;
    }
    throw Error(file.filename().string() + ": no UNet of 'models' takes " + std::to_string(sample.size(1)) +
                " input channels");
}

} // namespace anchor::sdgolden
