// Golden checker for the hires fix (tests/golden/sd/hires_tiny, generate/gen_hires.py): a folder with hires.json
// naming the models, the scheduler configuration and the runs. Each run is two real diffusers 0.27.2 calls
// (StableDiffusionPipeline to latents, the upscale, StableDiffusionImg2ImgPipeline); ours is one
// Txt2ImgPipeline::run with Txt2ImgParams::hires (unet/pipeline/hires.h), every parameter read from the run. Compared:
// the prompt embeddings, the first pass's latents, what the upscale made (latents, or the uint8 images before and
// after the resize), the second pass's noise, the final latents and images, the target size and the second pass's
// step count. "cache_runs" are checked only for running (the image has the target size and is finite). A key this
// checker does not understand FAILs the run naming it.
#include "tests/golden_runner/sd_comparisons.h"
#include "cache/util/strings.h"
#include "unet/cache/cache_config.h"
#include "unet/pipeline/hires.h"

namespace anchor::golden {
namespace {

bool claims_hires(const fs::path& d) { return has_file(d, "hires.json"); }

// The run's parameters as Txt2ImgParams (with hires), refusing keys it does not know.
unet::Txt2ImgParams hires_run_params(const nlohmann::json& r, const std::string& run) {
    static const std::set<std::string> known = {
        "prompt",       "negative_prompt", "guidance_scale", "width",          "height",          "steps",
        "scheduler",    "seed",            "batch_size",     "upscaler",       "hires_scale",     "hires_width",
        "hires_height", "hires_steps",     "hires_denoise",  "hires_steps_run", "target_width",   "target_height",
        "cache"};
    for (const auto& [k, v] : r.items())
        if (!known.count(k)) throw Error("hires.json: runs." + run + ": key '" + k + "' is not understood");
    unet::Txt2ImgParams p;
    p.prompts = {r.at("prompt").get<std::string>()};
    p.negative_prompts = {r.value("negative_prompt", std::string())};
    p.prompt_syntax = unet::PromptSyntax::Plain; // the reference is diffusers
    p.guidance_scale = r.at("guidance_scale").get<double>();
    p.width = r.at("width").get<int>();
    p.height = r.at("height").get<int>();
    p.steps = r.at("steps").get<int>();
    p.sampler = sdgolden::sampler_from_class(r.at("scheduler").get<std::string>());
    p.seed = r.at("seed").get<int64_t>();
    p.images_per_prompt = r.value("batch_size", 1);
    auto& h = p.hires;
    h.enabled = true;
    unet::parse_hires_upscaler(r.at("upscaler").get<std::string>(), h);
    if (h.upscaler == unet::HiresUpscaler::Model) throw Error("hires.json: runs." + run + ": unknown upscaler");
    if (r.contains("hires_scale")) h.scale = r["hires_scale"].get<double>();
    h.width = r.value("hires_width", 0);
    h.height = r.value("hires_height", 0);
    h.steps = r.value("hires_steps", 0);
    h.denoise = r.at("hires_denoise").get<double>();
    return p;
}

std::vector<CaseResult> run_hires_case(const fs::path& dir, const Context& ctx) {
    const std::string base = relative_name(dir, ctx);
    nlohmann::json cfg;
    unet::SDModels models;
    unet::SchedulerConfig sc;
    try {
        cfg = sdgolden::read_json_file(dir / "hires.json");
        for (const auto& [k, v] : cfg.items())
            if (k != "class" && k != "reference" && k != "generated_with" && k != "models" &&
                k != "scheduler_base_config" && k != "vae_scale_factor" && k != "runs" && k != "cache_runs")
                throw Error("hires.json: key '" + k + "' is not understood by this checker");
        if (cfg.value("class", std::string()) != "HiresFix") throw Error("hires.json: class is not HiresFix");
        models = sdgolden::load_run_models(dir, cfg);
        if (cfg.at("vae_scale_factor").get<int>() != models.vae_scale_factor())
            throw Error("hires.json: vae_scale_factor " + cfg["vae_scale_factor"].dump() + ", the VAE has " +
                        std::to_string(models.vae_scale_factor()));
        sc = unet::SchedulerConfig::from_json_text(cfg.at("scheduler_base_config").dump(), "hires.json");
    } catch (const std::exception& e) {
        return {guarded(base, [&](Stats& st) { st.fail(e.what()); })};
    }
    std::vector<CaseResult> out;
    unet::Txt2ImgPipeline pipe(models);
    for (const auto& [run, r] : cfg.at("runs").items()) {
        out.push_back(guarded(base + ":" + run, [&, run = run, r = r](Stats& st) {
            const auto p = hires_run_params(r, run);
            sdgolden::check_scheduler_settings(cfg["scheduler_base_config"], p.sampler, "hires.json");
            const auto g = WeightMap::load((dir / (run + ".safetensors")).string());
            unet::HiresStages stages;
            const auto res = unet::run_hires(pipe, p, nullptr, {}, {}, &sc, &stages);
            st.check_true("target size", stages.plan.width == r.at("target_width").get<int>() &&
                                             stages.plan.height == r.at("target_height").get<int>(),
                          "ours " + wxh(stages.plan.width, stages.plan.height) + ", the reference's " +
                              std::to_string(r.at("target_width").get<int>()) + "x" +
                              std::to_string(r.at("target_height").get<int>()));
            const int second = res.total_steps - stages.first_pass_steps;
            st.check_true("second pass steps", second == r.at("hires_steps_run").get<int>(),
                          "ours " + std::to_string(second) + ", the reference's " + r["hires_steps_run"].dump());
            // The reference stores [negative; prompt] once; the batch repeats each row per image.
            st.check("prompt_embeds", res.prompt_embeds,
                     g.get("prompt_embeds").repeat_interleave(p.images_per_prompt, 0), kAtol, kRtol);
            st.check("base_latents", stages.base_latents, g.get("base_latents"), kAtol, kRtol);
            if (g.has("upscaled_latents"))
                st.check("upscaled_latents", stages.upscaled_latents, g.get("upscaled_latents"), kAtol, kRtol);
            if (g.has("base_image_uint8")) {
#if TORCH_VERSION_MAJOR >= 2
                // LibTorch 2.x's VAE decode rounds differently from the reference's 1.13 (~1e-6): A1111's
                // truncation to uint8 then moves a value sitting on a level boundary by one level.
                const double u8_tol = 1.0;
#else
                const double u8_tol = 0.0; // bit for bit on the reference's LibTorch
#endif
                st.check("base_image_uint8", stages.base_image_uint8.to(torch::kFloat),
                         g.get("base_image_uint8").to(torch::kFloat), u8_tol, 0);
                st.check("upscaled_image_uint8", stages.upscaled_image_uint8.to(torch::kFloat),
                         g.get("upscaled_image_uint8").to(torch::kFloat), u8_tol, 0);
            }
            st.check("hires_noise", res.init.noise, g.get("hires_noise"), 0, 0);
#if TORCH_VERSION_MAJOR >= 2
            // A pixel upscaler's image moved by one uint8 level (above) is encoded into the second pass: its final
            // latents move by a few 1e-4 on LibTorch 2.x; the latent upscalers stay within kAtol.
            const double final_atol = g.has("base_image_uint8") ? 10 * kAtol : kAtol;
#else
            const double final_atol = kAtol;
#endif
            st.check("final_latents", res.final_latents, g.get("final_latents"), final_atol, kRtol);
            st.check("image", res.image, g.get("image"), kAtol, kRtol);
            st.check("image_uint8", res.image_uint8.to(torch::kFloat), g.get("image_uint8").to(torch::kFloat), 1.0, 0);
        }));
    }
    const nlohmann::json cache_runs = cfg.value("cache_runs", nlohmann::json::object()); // outlives the loop
    for (const auto& [run, r] : cache_runs.items()) {
        out.push_back(guarded(base + ":" + run + " (runs)", [&, run = run, r = r](Stats& st) {
            const auto p = hires_run_params(r, run);
            auto ctl = unet::parse_cache_mode(r.at("cache").get<std::string>());
            unet::HiresStages stages;
            const auto res = unet::run_hires(pipe, p, ctl.get(), {}, {}, &sc, &stages);
            st.check_true("output size", res.image_uint8.size(2) == stages.plan.width &&
                                             res.image_uint8.size(1) == stages.plan.height);
            st.check_true("finite", torch::isfinite(res.image).all().item<bool>());
            st.check_true("both passes ran", stages.first_pass_steps == p.steps && res.total_steps > p.steps);
        }));
    }
    return out;
}

const bool registered_hires = register_checker({"sd-hires", claims_hires, run_hires_case});

} // namespace
} // namespace anchor::golden
