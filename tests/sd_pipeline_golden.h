// Shared by tests/test_sd_pipeline.cpp and tests/golden_runner/check_sd_pipeline.cpp: the comparisons of one
// txt2img golden run (tests/golden/sd/pipeline_tiny, tests/golden/sd/deepcache), teacher-forced and free-running.
//
// Teacher-forced: every stage of step i is recomputed from the stored values before it (state latents -> model input,
// stored model input -> noise_pred, stored noise_pred -> guided eps, stored guided eps + state -> latents), with the
// generator advanced exactly as in the reference (initial noise, then the scheduler's own draws). Free-running: the
// whole loop from the seed, compared loosely (see tests/golden/sd/README.md for why).
#pragma once

#include "cache/io/error.h"
#include "cache/io/weight_map.h"
#include "unet/pipeline.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace anchor::sdgolden {

struct Comparison {
    std::string what;
    torch::Tensor actual, golden;
    double atol = 1e-4, rtol = 1e-4;
    enum Kind { Close, Exact, RelMax } kind = Close; // RelMax: max|a-g| <= atol * max|g|
};

inline unet::SamplerKind sampler_from_class(const std::string& cls) {
    using unet::SamplerKind;
    if (cls == "DDIMScheduler") return SamplerKind::DDIM;
    if (cls == "PNDMScheduler") return SamplerKind::PNDM;
    if (cls == "EulerDiscreteScheduler") return SamplerKind::Euler;
    if (cls == "EulerAncestralDiscreteScheduler") return SamplerKind::EulerAncestral;
    if (cls == "LMSDiscreteScheduler") return SamplerKind::LMS;
    if (cls == "DPMSolverMultistepScheduler") return SamplerKind::DPMPP2M;
    throw Error("unknown scheduler class '" + cls + "'");
}

inline nlohmann::json read_json_file(const std::filesystem::path& p) {
    std::ifstream f(p);
    if (!f) throw Error("cannot open '" + p.string() + "'");
    return nlohmann::json::parse(f);
}

// Models of a run folder: config.json "models" names folders next to the run folder.
inline unet::SDModels load_run_models(const std::filesystem::path& dir, const nlohmann::json& cfg) {
    namespace fs = std::filesystem;
    const auto& mods = cfg.at("models");
    const fs::path root = dir.parent_path();
    unet::SDModels m;
    m.layout = "diffusers-components";
    m.unet = unet::load_unet_folder((root / mods.at("unet").get<std::string>()).string());
    m.vae = unet::load_vae_folder((root / mods.at("vae").get<std::string>()).string());
    const fs::path te = root / mods.at("text_encoder").get<std::string>();
    m.text_encoder = unet::load_text_encoder_folder(te.string());
    // Vocabulary: a vocab/ folder next to the model folders, else the bundled copy.
    fs::path vocab = root / "vocab" / "bpe_simple_vocab_16e6.txt.gz";
    m.tokenizer = fs::exists(vocab) ? unet::ClipTokenizer::from_bpe_file(vocab.string()) : unet::ClipTokenizer::bundled();
    m.family = "sd1";
    return m;
}

// Writes the scheduler settings of config.json (scheduler_base_config) where SchedulerConfig::from_json_file reads.
inline unet::SchedulerConfig scheduler_config_of(const nlohmann::json& cfg, const std::string& scratch) {
    if (!cfg.contains("scheduler_base_config")) return unet::SchedulerConfig{};
    const std::string p = scratch + "/scheduler_config.json";
    std::ofstream(p) << cfg["scheduler_base_config"].dump();
    return unet::SchedulerConfig::from_json_file(p);
}

// All comparisons of run `run` (a `<run>.safetensors` in `dir`). `deepcache` runs use the run's cache_interval /
// cache_branch_id.
inline std::vector<Comparison> compare_run(unet::SDModels& models, const std::filesystem::path& dir,
                                           const nlohmann::json& cfg, const std::string& run,
                                           const std::string& scratch) {
    using torch::Tensor;
    std::vector<Comparison> out;
    auto g = WeightMap::load((dir / (run + ".safetensors")).string());
    const auto& rc = cfg.at("runs").at(run);
    const auto kind = sampler_from_class(rc.at("scheduler").get<std::string>());
    const int steps = rc.at("num_inference_steps").get<int>();
    const double guidance = cfg.value("guidance_scale", 7.5);
    const int64_t seed = cfg.value("seed", int64_t(42));
    const int interval = rc.value("cache_interval", 0);
    const int branch = rc.value("cache_branch_id", 0);
    const auto prompts = cfg.at("prompts").get<std::vector<std::string>>();
    const std::string negative = cfg.value("negative_prompt", std::string());
    auto sched_cfg = scheduler_config_of(cfg, scratch);
    unet::Txt2ImgPipeline pipe(models);
    c10::InferenceMode guard;

    // Prompt ids and embeddings.
    auto ids = models.tokenizer.tokenize(prompts.at(0)).ids;
    out.push_back({"prompt_ids", torch::tensor(ids, torch::kLong).unsqueeze(0), g.get("prompt_ids"), 0, 0, Comparison::Exact});
    auto nids = models.tokenizer.tokenize(negative).ids;
    out.push_back({"negative_prompt_ids", torch::tensor(nids, torch::kLong).unsqueeze(0), g.get("negative_prompt_ids"), 0, 0,
                   Comparison::Exact});
    out.push_back({"prompt_embeds", pipe.encode_prompts(prompts, negative, 0, guidance > 1, nullptr), g.get("prompt_embeds")});

    // Teacher-forced loop.
    auto sched = unet::make_scheduler(kind, sched_cfg);
    sched->set_timesteps(steps);
    torch::Generator gen = at::detail::createCPUGenerator(uint64_t(seed));
    auto golden_noise = g.get("initial_noise");
    auto noise = torch::randn(golden_noise.sizes(), gen, torch::TensorOptions().dtype(torch::kFloat));
    out.push_back({"initial_noise (seed parity)", noise, golden_noise, 0, 0, Comparison::Exact});
    out.push_back({"initial_latents", noise * sched->init_noise_sigma(), g.get("initial_latents"), 1e-6, 1e-6});
    auto ctx = g.get("prompt_embeds");
    Tensor cached;
    for (int i = 0; i < sched->num_loop_steps(); ++i) {
        const std::string p = "step." + std::to_string(i) + ".";
        if (!g.has(p + "latents")) break;
        auto state = i == 0 ? g.get("initial_latents") : g.get("step." + std::to_string(i - 1) + ".latents");
        auto mi = sched->scale_model_input(torch::cat({state, state}, 0), i);
        out.push_back({p + "model_input", mi, g.get(p + "model_input")});
        auto t = torch::tensor(sched->timestep(i), torch::kFloat).reshape({});
        Tensor np;
        if (interval > 0 && i % interval != 0) {
            np = models.unet->forward_shallow(g.get(p + "model_input"), t, ctx, branch, cached);
        } else {
            unet::UNetFeatures f;
            f.cache_branch = interval > 0 ? branch : -1;
            np = models.unet->forward(g.get(p + "model_input"), t, ctx, &f);
            if (interval > 0) {
                const std::string cname = "cache.up_blocks.3.attentions.1.step." + std::to_string(i);
                if (g.has(cname)) {
                    out.push_back({cname, f.cache_feature, g.get(cname)});
                    cached = g.get(cname); // later cached steps start from the stored feature
                } else {
                    cached = f.cache_feature;
                }
            }
        }
        out.push_back({p + "noise_pred", np, g.get(p + "noise_pred"), 5e-3, 1e-4});
        auto guided = unet::cfg_combine(g.get(p + "noise_pred"), guidance);
        out.push_back({p + "guided_noise_pred", guided, g.get(p + "guided_noise_pred")});
        auto next = sched->step(g.get(p + "guided_noise_pred"), i, state, &gen);
        out.push_back({p + "latents", next, g.get(p + "latents")});
    }

    // Free-running.
    unet::Txt2ImgParams params;
    params.prompts = prompts;
    params.negative_prompt = negative;
    params.guidance_scale = guidance;
    params.steps = steps;
    params.seed = seed;
    params.width = cfg.value("width", 512);
    params.height = cfg.value("height", 512);
    params.sampler = kind;
    std::unique_ptr<unet::DenoiseController> ctl;
    if (interval > 0) ctl = std::make_unique<unet::DeepCacheDenoiser>(interval, branch);
    auto r = pipe.run(params, ctl.get(), {}, {}, &sched_cfg);
    out.push_back({"free-running initial_noise", r.initial_noise, golden_noise, 0, 0, Comparison::Exact});
    out.push_back({"free-running final_latents", r.final_latents, g.get("final_latents"), 5e-2, 0, Comparison::RelMax});
    out.push_back({"free-running image", r.image, g.get("image"), 5e-2, 0});
    return out;
}

} // namespace anchor::sdgolden
