// Shared by tests/test_sd_pipeline.cpp and tests/golden_runner/check_sd_pipeline.cpp: the comparisons of one
// txt2img golden run (tests/golden/sd/pipeline_tiny, tests/golden/sd/deepcache), teacher-forced and free-running.
//
// Every parameter comes from the case: prompts (a batch of several, as diffusers' prompt=[...]), negative prompt(s),
// images per prompt, guidance, seed, size, sampler, steps, eta, scheduler config, DeepCache interval / branch / skip
// mode. A case folder whose config.json lacks one may name the folder it was run against ("no_cache_baseline":
// "pipeline_tiny/ ..."), whose config.json then supplies it. A key this checker does not understand, a missing
// parameter, or a parameter that contradicts the stored tensors is an error with the key's name: the case FAILs with
// the reason, it never runs on a default.
//
// Teacher-forced: every stage of step i is recomputed from the stored values before it (state latents -> model input,
// stored model input -> noise_pred, stored noise_pred -> guided eps, stored guided eps + state -> latents), with the
// generator advanced exactly as in the reference (initial noise, then the scheduler's own draws). Free-running: the
// whole loop from the seed, compared loosely (see tests/golden/sd/README.md for why).
#pragma once

#include "cache/io/error.h"
#include "cache/io/weight_map.h"
#include "unet/cache/freq_cache.h"
#include "unet/pipeline/pipeline.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <functional>
#include <regex>
#include <set>
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
    if (cls == "LCMScheduler") return SamplerKind::LCM;
    throw Error("unknown scheduler class '" + cls + "'");
}

// A scheduler configuration that the engine's sampler for `kind` would not run as diffusers does (a behaviour-changing
// key with a value it does not implement, an unknown key that is set) fails the case naming the key and the value,
// instead of running as something else.
inline void check_scheduler_settings(const nlohmann::json& config, unet::SamplerKind kind, const std::string& where) {
    std::string u;
    for (const auto& s : unet::unsupported_scheduler_settings(config.dump(), kind)) u += (u.empty() ? "" : "; ") + s;
    if (!u.empty()) throw Error(where + ": " + u);
}

inline nlohmann::json read_json_file(const std::filesystem::path& p) {
    std::ifstream f(p);
    if (!f) throw Error("cannot open '" + p.string() + "'");
    return nlohmann::json::parse(f);
}

// The folder a case was run against: config.json "no_cache_baseline" = "<folder>/ ..." next to `dir`; empty if none.
inline std::filesystem::path baseline_dir(const std::filesystem::path& dir, const nlohmann::json& cfg) {
    if (!cfg.contains("no_cache_baseline") || !cfg["no_cache_baseline"].is_string()) return {};
    const std::string s = cfg["no_cache_baseline"].get<std::string>();
    const auto end = s.find_first_of(" /");
    const auto p = dir.parent_path() / s.substr(0, end);
    return std::filesystem::exists(p / "config.json") ? p : std::filesystem::path();
}

// config.json with the keys it lacks taken from its baseline folder's config.json (see the top of this file).
inline nlohmann::json resolved_config(const std::filesystem::path& dir, const nlohmann::json& cfg) {
    nlohmann::json out = cfg;
    const auto base = baseline_dir(dir, cfg);
    if (base.empty()) return out;
    const auto b = read_json_file(base / "config.json");
    for (const char* k : {"scheduler_base_config", "height", "width", "latent_shape", "vae_scale_factor"})
        if (!out.contains(k) && b.contains(k)) out[k] = b[k];
    return out;
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
    m.tokenizer =
        fs::exists(vocab) ? unet::ClipTokenizer::from_bpe_file(vocab.string()) : unet::ClipTokenizer::bundled();
    m.family = unet::SdFamily::SD1;
    return m;
}

// Everything one run needs, read from config.json (top level, overridden per run by the run's own keys).
struct RunSpec {
    unet::Txt2ImgParams params;
    unet::SchedulerConfig scheduler;
    int cache_interval = 0, cache_branch = 0;
    std::vector<double> timesteps;       // as stored, empty when the case gives none
    double init_noise_sigma = -1;        // < 0: not stored
    std::vector<std::string> step_modes; // "full" / "cached" per loop step, empty when not stored
};

namespace detail {

// Keys that only describe the case (hashes of what was checked when it was made, the commands, file names).
inline bool descriptive_key(const std::string& k) {
    static const std::regex re(
        R"(^(png|pngs|note|notes|description|generator|helper|no_cache_baseline|models|interval_1_equals_plain_pipeline|full_steps|cached_steps)$|^max_abs_diff|_check_max_abs_diff$|_std$|_mean$|_sha256$)");
    return std::regex_search(k, re);
}

inline const nlohmann::json& need(const nlohmann::json& m, const std::string& run, const char* k) {
    if (!m.contains(k)) throw Error("config.json: runs." + run + " has no '" + k + "'");
    return m[k];
}

inline std::vector<std::string> string_or_list(const nlohmann::json& v, const std::string& key) {
    if (v.is_string()) return {v.get<std::string>()};
    if (v.is_array()) {
        std::vector<std::string> out;
        for (const auto& e : v) {
            if (!e.is_string()) throw Error("config.json: '" + key + "' must hold strings");
            out.push_back(e.get<std::string>());
        }
        return out;
    }
    if (v.is_null()) return {};
    throw Error("config.json: '" + key + "' must be a string or a list of strings");
}

inline int64_t manual_seed_in(const std::string& text) {
    std::smatch m;
    static const std::regex re(R"(manual_seed\(\s*(-?\d+)\s*\))");
    return std::regex_search(text, m, re) ? std::stoll(m[1].str()) : -1;
}

} // namespace detail

// Run `run` of a case's config.json: the top level with the run's own keys over it (a case may vary the seed or
// guidance per run).
inline nlohmann::json run_parameters(const nlohmann::json& cfg, const std::string& run) {
    if (!cfg.contains("runs") || !cfg["runs"].contains(run)) throw Error("config.json: no runs." + run);
    nlohmann::json m = cfg;
    m.erase("runs");
    for (const auto& [k, v] : cfg["runs"][run].items()) m[k] = v;
    return m;
}

// `extra` and the prompt, guidance, seed and size parameters every txt2img-style run may have.
inline std::set<std::string> with_prompt_parameters(std::set<std::string> extra) {
    for (const char* k : {"prompts", "prompt", "negative_prompt", "negative_prompts", "num_images_per_prompt",
                          "batch_size", "guidance_scale", "seed", "height", "width"})
        extra.insert(k);
    return extra;
}

// The parameters every txt2img/img2img run has: the prompts (diffusers: negative_prompt None -> "" for every prompt,
// a string -> that string for every prompt, a list -> one per prompt), images per prompt, guidance and seed. First
// every key of m must be a parameter of `parameters` or descriptive.
inline void read_prompt_parameters(const nlohmann::json& m, const std::string& run,
                                   const std::set<std::string>& parameters, unet::Txt2ImgParams& p) {
    for (const auto& [k, v] : m.items())
        if (!parameters.count(k) && !detail::descriptive_key(k))
            throw Error("config.json: parameter '" + k + "' (runs." + run + ") is not understood by this checker");
    p.prompts =
        detail::string_or_list(m.contains("prompts") ? m["prompts"] : detail::need(m, run, "prompt"), "prompts");
    if (p.prompts.empty()) throw Error("config.json: 'prompts' is empty");
    if (m.contains("negative_prompts"))
        p.negative_prompts = detail::string_or_list(m["negative_prompts"], "negative_prompts");
    else if (m.contains("negative_prompt"))
        p.negative_prompts = detail::string_or_list(m["negative_prompt"], "negative_prompt");
    if (p.negative_prompts.size() > 1 && p.negative_prompts.size() != p.prompts.size())
        throw Error("config.json: " + std::to_string(p.negative_prompts.size()) + " negative prompts for " +
                    std::to_string(p.prompts.size()) + " prompts");
    p.images_per_prompt = m.value("num_images_per_prompt", 1);
    if (m.contains("batch_size") && m["batch_size"].get<int>() != int(p.prompts.size()) * p.images_per_prompt)
        throw Error("config.json: batch_size " + m["batch_size"].dump() + " is not " +
                    std::to_string(p.prompts.size()) + " prompts x " + std::to_string(p.images_per_prompt) +
                    " images per prompt");
    p.guidance_scale = detail::need(m, run, "guidance_scale").get<double>();
    p.seed = detail::need(m, run, "seed").get<int64_t>();
    if (m.contains("generator")) { // the description names the seed too: they must agree
        const int64_t g = detail::manual_seed_in(m["generator"].is_string() ? m["generator"].get<std::string>() : "");
        if (g >= 0 && g != p.seed)
            throw Error("config.json: generator text seeds " + std::to_string(g) + " but 'seed' is " +
                        std::to_string(p.seed));
    }
}

// Reads run `run` of a txt2img case; throws anchor::Error naming the key it cannot use.
inline RunSpec read_run_spec(const std::filesystem::path& dir, const nlohmann::json& cfg_in, const std::string& run,
                             int vae_factor) {
    const nlohmann::json m = run_parameters(resolved_config(dir, cfg_in), run);
    static const std::set<std::string> parameters =
        with_prompt_parameters({"latent_shape", "vae_scale_factor", "scheduler_base_config", "scheduler",
                                "num_inference_steps", "timesteps", "init_noise_sigma", "eta", "clip_skip",
                                "guidance_rescale", "cache_interval", "cache_branch_id", "skip_mode", "step_modes"});
    RunSpec s;
    auto& p = s.params;
    read_prompt_parameters(m, run, parameters, p);
    auto need = [&](const char* k) -> const nlohmann::json& { return detail::need(m, run, k); };
    const int images = int(p.prompts.size()) * p.images_per_prompt;
    if (m.contains("guidance_rescale") && m["guidance_rescale"].get<double>() != 0.0)
        throw Error("config.json: guidance_rescale " + m["guidance_rescale"].dump() + " is not supported");
    if (m.contains("eta")) p.eta = m["eta"].get<double>(); // unset: the sampler's default
    p.clip_skip = m.value("clip_skip", 0);
    p.prompt_syntax = unet::PromptSyntax::Plain; // the reference is diffusers: brackets are text
    p.steps = need("num_inference_steps").get<int>();
    p.sampler = sampler_from_class(need("scheduler").get<std::string>());
    if (m.contains("vae_scale_factor") && m["vae_scale_factor"].get<int>() != vae_factor)
        throw Error("config.json: vae_scale_factor " + m["vae_scale_factor"].dump() + ", the models' VAE has " +
                    std::to_string(vae_factor));
    if (m.contains("height") || m.contains("width")) {
        p.height = need("height").get<int>();
        p.width = need("width").get<int>();
    } else if (m.contains("latent_shape")) {
        const auto ls = m["latent_shape"].get<std::vector<int64_t>>();
        if (ls.size() != 4) throw Error("config.json: latent_shape must have 4 entries");
        p.height = int(ls[2]) * vae_factor;
        p.width = int(ls[3]) * vae_factor;
    } // else: the size of the stored initial noise (compare_run)
    if (m.contains("latent_shape") && p.height > 0) {
        const auto ls = m["latent_shape"].get<std::vector<int64_t>>();
        const std::vector<int64_t> want{images, 4, p.height / vae_factor, p.width / vae_factor};
        if (ls.size() != 4 || ls[0] != want[0] || ls[2] != want[2] || ls[3] != want[3])
            throw Error("config.json: latent_shape " + m["latent_shape"].dump() + " does not match " +
                        std::to_string(images) + " images of " + std::to_string(p.width) + "x" +
                        std::to_string(p.height));
    }
    if (!m.contains("scheduler_base_config"))
        throw Error("config.json: runs." + run +
                    " has no 'scheduler_base_config' (nor a no_cache_baseline folder "
                    "that has one)");
    check_scheduler_settings(m["scheduler_base_config"], p.sampler, "config.json: scheduler_base_config");
    s.scheduler =
        unet::SchedulerConfig::from_json_text(m["scheduler_base_config"].dump(), "config.json:scheduler_base_config");
    if (m.contains("timesteps")) s.timesteps = m["timesteps"].get<std::vector<double>>();
    s.init_noise_sigma = m.value("init_noise_sigma", -1.0);
    if (m.contains("cache_interval")) {
        s.cache_interval = m["cache_interval"].get<int>();
        s.cache_branch = need("cache_branch_id").get<int>();
        const std::string mode = m.value("skip_mode", std::string("uniform"));
        if (mode != "uniform") throw Error("config.json: DeepCache skip_mode '" + mode + "' is not supported");
        if (m.contains("step_modes")) s.step_modes = m["step_modes"].get<std::vector<std::string>>();
    }
    return s;
}

// Prompt ids and embeddings, as diffusers' encode_prompt batches them.
inline void compare_prompts(unet::Txt2ImgPipeline& pipe, const unet::Txt2ImgParams& params, const WeightMap& g,
                            bool cfg_on, std::vector<Comparison>& out) {
    out.push_back({"prompt_ids", pipe.prompt_ids(params.prompts), g.get("prompt_ids"), 0, 0, Comparison::Exact});
    if (g.has("negative_prompt_ids")) {
        auto nids = pipe.prompt_ids(unet::Txt2ImgPipeline::negatives_of(params));
        const auto gn = g.get("negative_prompt_ids");
        // A reference that tokenized one shared negative prompt stores one row.
        if (gn.size(0) == 1 && nids.size(0) > 1 && torch::equal(nids, nids.narrow(0, 0, 1).expand_as(nids)))
            nids = nids.narrow(0, 0, 1);
        out.push_back({"negative_prompt_ids", nids, gn, 0, 0, Comparison::Exact});
    }
    out.push_back({"prompt_embeds", pipe.encode_prompts(params, cfg_on, nullptr), g.get("prompt_embeds")});
}

// All comparisons of run `run` (a `<run>.safetensors` in `dir`).
// `adjust` (may be empty) changes the parameters of the free-running run where the case describes more than a
// diffusers call (tests/golden_runner/check_fewstep.cpp: the TAESD decoder).
inline std::vector<Comparison> compare_run(unet::SDModels& models, const std::filesystem::path& dir,
                                           const nlohmann::json& cfg, const std::string& run,
                                           const std::string& scratch,
                                           const std::function<void(unet::Txt2ImgParams&)>& adjust = {}) {
    (void)scratch;
    using torch::Tensor;
    std::vector<Comparison> out;
    auto g = WeightMap::load((dir / (run + ".safetensors")).string());
    const int f = models.vae_scale_factor();
    RunSpec spec = read_run_spec(dir, cfg, run, f);
    auto& params = spec.params;
    const auto golden_noise = g.get("initial_noise");
    if (params.width <= 0) { // no size in the case: the stored initial noise's
        params.height = int(golden_noise.size(2)) * f;
        params.width = int(golden_noise.size(3)) * f;
    }
    const int64_t images = int64_t(params.prompts.size()) * params.images_per_prompt;
    const bool cfg_on = params.guidance_scale > 1.0;
    unet::Txt2ImgPipeline pipe(models);
    c10::InferenceMode guard;

    compare_prompts(pipe, params, g, cfg_on, out);

    // Schedule.
    auto sched = unet::make_scheduler(params.sampler, spec.scheduler, params.eta);
    sched->set_timesteps(params.steps);
    if (!spec.timesteps.empty())
        out.push_back({"timesteps", torch::tensor(sched->timesteps(), torch::kFloat64),
                       torch::tensor(spec.timesteps, torch::kFloat64), 0, 0, Comparison::Exact});
    if (spec.init_noise_sigma >= 0)
        out.push_back({"init_noise_sigma", torch::tensor({sched->init_noise_sigma()}, torch::kFloat64),
                       torch::tensor({spec.init_noise_sigma}, torch::kFloat64), 0, 1e-6});

    // Teacher-forced loop. The initial noise is drawn in the shape the parameters give (a batch of `images`).
    torch::Generator gen = at::detail::createCPUGenerator(uint64_t(params.seed));
    const int64_t C = models.unet->config().in_channels;
    auto noise = torch::randn({images, C, params.height / f, params.width / f}, gen,
                              torch::TensorOptions().dtype(torch::kFloat));
    out.push_back({"initial_noise (seed parity)", noise, golden_noise, 0, 0, Comparison::Exact});
    out.push_back({"initial_latents", noise * sched->init_noise_sigma(), g.get("initial_latents"), 1e-6, 1e-6});
    auto ctx = g.get("prompt_embeds");
    const int interval = spec.cache_interval, branch = spec.cache_branch;
    Tensor cached;
    for (int i = 0; i < sched->num_loop_steps(); ++i) {
        const std::string p = "step." + std::to_string(i) + ".";
        if (!g.has(p + "latents")) break;
        auto state = i == 0 ? g.get("initial_latents") : g.get("step." + std::to_string(i - 1) + ".latents");
        auto mi = sched->scale_model_input(cfg_on ? torch::cat({state, state}, 0) : state, i);
        out.push_back({p + "model_input", mi, g.get(p + "model_input")});
        auto t = torch::tensor(sched->timestep(i), torch::kFloat).reshape({});
        Tensor np;
        if (interval > 0 && i % interval != 0) {
            np = models.unet->forward_shallow(g.get(p + "model_input"), t, ctx, branch, cached);
        } else {
            unet::UNetFeatures feats;
            feats.cache_branch = interval > 0 ? branch : -1;
            np = models.unet->forward(g.get(p + "model_input"), t, ctx, &feats);
            if (interval > 0) {
                const std::string cname = "cache.up_blocks.3.attentions.1.step." + std::to_string(i);
                if (g.has(cname)) {
                    // An intermediate of the same UNet evaluation as noise_pred, through the same badly conditioned
                    // 1x1 levels of the tiny model (tests/golden/sd/README.md): noise_pred's tolerance applies.
                    out.push_back({cname, feats.cache_feature, g.get(cname), 5e-3, 1e-4});
                    cached = g.get(cname); // later cached steps start from the stored feature
                } else {
                    cached = feats.cache_feature;
                }
            }
        }
        out.push_back({p + "noise_pred", np, g.get(p + "noise_pred"), 5e-3, 1e-4});
        auto guided =
            cfg_on ? unet::cfg_combine(g.get(p + "noise_pred"), params.guidance_scale) : g.get(p + "noise_pred");
        out.push_back({p + "guided_noise_pred", guided, g.get(p + "guided_noise_pred")});
        auto next = sched->step(g.get(p + "guided_noise_pred"), i, state, &gen);
        out.push_back({p + "latents", next, g.get(p + "latents")});
    }

    // Free-running, through the pipeline a user runs.
    if (adjust) adjust(params);
    std::unique_ptr<unet::DenoiseController> ctl;
    if (interval > 0) ctl = std::make_unique<unet::DeepCacheDenoiser>(interval, branch);
    std::vector<double> modes;
    auto r = pipe.run(
        params, ctl.get(), {},
        [&](const unet::StepRecord&) { modes.push_back(ctl && !ctl->last_step_was_full() ? 0.0 : 1.0); },
        &spec.scheduler);
    if (!spec.step_modes.empty()) {
        std::vector<double> want;
        for (const auto& s : spec.step_modes) {
            if (s != "full" && s != "cached") throw Error("config.json: step_modes entry '" + s + "'");
            want.push_back(s == "full" ? 1.0 : 0.0);
        }
        out.push_back({"free-running step_modes (1 = full)", torch::tensor(modes, torch::kFloat64),
                       torch::tensor(want, torch::kFloat64), 0, 0, Comparison::Exact});
    }
    out.push_back({"free-running initial_noise", r.initial_noise, golden_noise, 0, 0, Comparison::Exact});
    out.push_back({"free-running final_latents", r.final_latents, g.get("final_latents"), 5e-2, 0, Comparison::RelMax});
    out.push_back({"free-running image", r.image, g.get("image"), 5e-2, 0});
    return out;
}

} // namespace anchor::sdgolden
