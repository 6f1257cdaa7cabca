// Shared by tests/test_sdxl.cpp and tests/golden_runner/check_sdxl.cpp: the comparisons of an SDXL golden folder
// (tests/golden/sd/sdxl_tiny: diffusers 0.27.2 StableDiffusionXLPipeline): both text encoders, the UNet with added
// conditioning and its features, the VAE, and every pipeline run of golden.json "pipeline" (teacher-forced step by
// step, free-running through the pipeline a user runs). Every parameter comes from golden.json; a key this checker
// does not understand is an error naming it.
#pragma once

#include "tests/sd_pipeline_golden.h"

namespace anchor::sdgolden {

inline bool is_sdxl_golden_folder(const std::filesystem::path& dir) {
    namespace fs = std::filesystem;
    if (!fs::exists(dir / "model_index.json") || !fs::exists(dir / "golden.json")) return false;
    try {
        return read_json_file(dir / "model_index.json").value("_class_name", std::string()) ==
               "StableDiffusionXLPipeline";
    } catch (...) {
        return false;
    }
}

// Text encoders on the stored ids: hidden states, penultimate states, pooled outputs, prompt_embeds.
inline std::vector<Comparison> compare_sdxl_text(unet::SDModels& m, const std::filesystem::path& dir) {
    auto g = WeightMap::load((dir / "golden_text_encoders.safetensors").string());
    c10::InferenceMode guard;
    std::vector<Comparison> out;
    std::vector<torch::Tensor> penultimate;
    for (auto [name, te] : {std::pair{"te1", m.text_encoder}, std::pair{"te2", m.text_encoder_2}}) {
        const std::string p = std::string(name) + ".";
        const auto ids = g.get(p + "input_ids");
        const auto o = te->forward(ids);
        out.push_back({p + "last_hidden_state", o.last_hidden_state, g.get(p + "last_hidden_state")});
        for (size_t i = 0; i < o.hidden_states.size(); ++i)
            if (g.has(p + "hidden_states." + std::to_string(i)))
                out.push_back({p + "hidden_states." + std::to_string(i), o.hidden_states[i],
                               g.get(p + "hidden_states." + std::to_string(i))});
        const auto c = te->encode_penultimate(ids);
        out.push_back({p + "penultimate_hidden_state", c.hidden, g.get(p + "penultimate_hidden_state")});
        penultimate.push_back(c.hidden);
        // pooler_output: final_layer_norm at the EOS (before any projection); text_embeds: the projection of it.
        const auto eos = ids.argmax(-1);
        out.push_back({p + "pooler_output", o.last_hidden_state.index({torch::arange(ids.size(0)), eos}),
                       g.get(p + "pooler_output")});
        if (g.has(p + "eos_position"))
            out.push_back({p + "eos_position", eos, g.get(p + "eos_position"), 0, 0, Comparison::Exact});
        if (g.has(p + "text_embeds")) out.push_back({p + "text_embeds", c.pooled, g.get(p + "text_embeds")});
    }
    out.push_back({"prompt_embeds", torch::cat(penultimate, -1), g.get("prompt_embeds")});
    return out;
}

// UNet calls a (timesteps per row, inner features) and b (a float 0-dim timestep) with added conditioning.
inline std::vector<Comparison> compare_sdxl_unet(unet::UNet2DConditionModelImpl& unet, const std::filesystem::path& dir,
                                                 bool features) {
    auto in = WeightMap::load((dir / "golden_unet_inputs.safetensors").string());
    auto outs = WeightMap::load((dir / "golden_unet_outputs.safetensors").string());
    const unet::UNetCond cond{in.get("encoder_hidden_states"), in.get("text_embeds"), in.get("time_ids")};
    unet::UNetFeatures fa, fb;
    fa.record_inner = true;
    std::vector<Comparison> out;
    out.push_back({"a.out", unet.forward(in.get("sample"), in.get("timesteps_a"), cond, &fa), outs.get("a.out")});
    out.push_back({"b.out", unet.forward(in.get("sample"), in.get("timestep_b"), cond, &fb), outs.get("b.out")});
    if (!features) return out;
    auto feats = WeightMap::load((dir / "golden_unet_features.safetensors").string());
    for (const auto& name : feats.names()) {
        const auto dot = name.find('.');
        const auto& f = name.substr(0, dot) == "a" ? fa : fb;
        const std::string key = name.substr(dot + 1);
        if (!f.named.count(key)) throw Error("UNet feature '" + name + "' is not produced by the forward");
        out.push_back({name, f.named.at(key), feats.get(name)});
    }
    return out;
}

inline std::vector<Comparison> compare_sdxl_vae(unet::AutoencoderKLImpl& vae, const std::filesystem::path& dir) {
    auto g = WeightMap::load((dir / "golden_vae.safetensors").string());
    const auto j = read_json_file(dir / "golden.json").at("vae");
    c10::InferenceMode guard;
    std::vector<Comparison> out;
    out.push_back({"decode.image", vae.decode(g.get("latent")), g.get("decode.image")});
    auto d = vae.encode(g.get("image"));
    out.push_back({"encode.mean", d.mean, g.get("encode.mean")});
    out.push_back({"encode.std", d.std, g.get("encode.std")});
    if (g.has("encode.sample")) {
        if (!j.contains("sample_seed")) throw Error("golden.json vae: no sample_seed for encode.sample");
        auto gen = at::detail::createCPUGenerator(uint64_t(j.at("sample_seed").get<int64_t>()));
        out.push_back({"encode.sample", d.sample(&gen), g.get("encode.sample")});
    }
    return out;
}

// The run names of golden.json "pipeline".
inline std::vector<std::string> sdxl_runs(const std::filesystem::path& dir) {
    std::vector<std::string> out;
    const auto j = read_json_file(dir / "golden.json");
    if (!j.contains("pipeline") || !j["pipeline"].contains("runs")) return out;
    for (const auto& [k, v] : j["pipeline"]["runs"].items()) out.push_back(k);
    return out;
}

// golden.json pipeline parameters of `run` (the top level with the run's keys over it) -> Txt2ImgParams.
inline unet::Txt2ImgParams read_sdxl_run(const nlohmann::json& pipeline, const std::string& run,
                                         std::vector<double>* timesteps, std::vector<double>* sigmas,
                                         double* init_noise_sigma) {
    const nlohmann::json m = run_parameters(pipeline, run);
    static const std::set<std::string> parameters = with_prompt_parameters(
        {"steps", "original_size", "crops_coords_top_left", "target_size", "negative_original_size",
         "negative_crops_coords_top_left", "negative_target_size", "prompt_2", "negative_prompt_2", "guidance_rescale",
         "clip_skip", "eta", "timesteps", "sigmas", "init_noise_sigma"});
    unet::Txt2ImgParams p;
    read_prompt_parameters(m, run, parameters, p);
    auto need = [&](const char* k) -> const nlohmann::json& { return detail::need(m, run, k); };
    p.prompt_syntax = unet::PromptSyntax::Plain; // the reference is diffusers
    p.steps = need("steps").get<int>();
    p.height = need("height").get<int>();
    p.width = need("width").get<int>();
    if (m.value("guidance_rescale", 0.0) != 0.0)
        throw Error("golden.json: guidance_rescale " + m["guidance_rescale"].dump() + " is not supported");
    if (!m.value("clip_skip", nlohmann::json()).is_null()) p.clip_skip = m["clip_skip"].get<int>();
    if (m.contains("eta") && m["eta"].get<double>() != 0.0)
        throw Error("golden.json: eta " + m["eta"].dump() + " with the folder's scheduler is not supported");
    if (m.contains("prompt_2")) p.prompts_2 = detail::string_or_list(m["prompt_2"], "prompt_2");
    if (m.contains("negative_prompt_2"))
        p.negative_prompts_2 = detail::string_or_list(m["negative_prompt_2"], "negative_prompt_2");
    auto pair = [&](const char* k) -> std::optional<std::array<int, 2>> {
        if (!m.contains(k) || m[k].is_null()) return std::nullopt;
        const auto v = m[k].get<std::vector<int>>();
        if (v.size() != 2) throw Error(std::string("golden.json: '") + k + "' must have 2 entries");
        return std::array<int, 2>{v[0], v[1]};
    };
    p.original_size = pair("original_size");
    p.target_size = pair("target_size");
    p.crop = pair("crops_coords_top_left").value_or(std::array<int, 2>{0, 0});
    p.negative_original_size = pair("negative_original_size");
    p.negative_target_size = pair("negative_target_size");
    p.negative_crop = pair("negative_crops_coords_top_left").value_or(std::array<int, 2>{0, 0});
    if (m.contains("timesteps")) *timesteps = m["timesteps"].get<std::vector<double>>();
    if (m.contains("sigmas")) *sigmas = m["sigmas"].get<std::vector<double>>();
    *init_noise_sigma = m.value("init_noise_sigma", -1.0);
    return p;
}

// One pipeline run (`pipeline`: golden.json's "pipeline" with "runs"; `tensors`: the run's stored tensors):
// conditioning, schedule, teacher-forced steps and decode; then free-running.
inline std::vector<Comparison> compare_sdxl_run(unet::SDModels& models, const nlohmann::json& pipeline,
                                                const std::string& run, const std::filesystem::path& tensors) {
    using torch::Tensor;
    std::vector<double> timesteps, sigmas;
    double init_sigma = -1;
    auto params = read_sdxl_run(pipeline, run, &timesteps, &sigmas, &init_sigma);
    auto g = WeightMap::load(tensors.string());
    unet::Txt2ImgPipeline pipe(models);
    const auto sc = pipe.scheduler_config();
    params.sampler = sampler_from_class(sc.class_name);
    const bool cfg_on = params.guidance_scale > 1.0;
    const int64_t images = int64_t(params.prompts.size()) * params.images_per_prompt;
    c10::InferenceMode guard;
    std::vector<Comparison> out;
    // Conditioning.
    const auto prompts_2 = params.prompts_2.empty() ? params.prompts : params.prompts_2;
    out.push_back({"prompt_ids_1", pipe.prompt_ids(models.tokenizer, 77, params.prompts, nullptr),
                   g.get("prompt_ids_1"), 0, 0, Comparison::Exact});
    out.push_back({"prompt_ids_2", pipe.prompt_ids(models.tokenizer_2, 77, prompts_2, nullptr), g.get("prompt_ids_2"),
                   0, 0, Comparison::Exact});
    const auto cond = pipe.encode_conditioning(params, cfg_on, nullptr);
    const int64_t rows = cond.context.size(0);
    if (cfg_on) {
        out.push_back({"negative_prompt_embeds", cond.context.narrow(0, 0, images), g.get("negative_prompt_embeds")});
        out.push_back({"negative_pooled_prompt_embeds", cond.text_embeds.narrow(0, 0, images),
                       g.get("negative_pooled_prompt_embeds")});
    }
    out.push_back({"prompt_embeds", cond.context.narrow(0, rows - images, images), g.get("prompt_embeds")});
    out.push_back(
        {"pooled_prompt_embeds", cond.text_embeds.narrow(0, rows - images, images), g.get("pooled_prompt_embeds")});
    out.push_back({"cfg.prompt_embeds", cond.context, g.get("cfg.prompt_embeds")});
    out.push_back({"cfg.text_embeds", cond.text_embeds, g.get("cfg.text_embeds")});
    out.push_back({"cfg.time_ids", cond.time_ids, g.get("cfg.time_ids"), 0, 0, Comparison::Exact});
    // Schedule.
    auto sched = unet::make_scheduler(params.sampler, sc, params.eta);
    sched->set_timesteps(params.steps);
    if (!timesteps.empty())
        out.push_back({"timesteps", torch::tensor(sched->timesteps(), torch::kFloat64),
                       torch::tensor(timesteps, torch::kFloat64), 0, 0, Comparison::Exact});
    if (!sigmas.empty() && !sched->sigmas().empty())
        out.push_back({"sigmas", torch::tensor(sched->sigmas(), torch::kFloat64),
                       torch::tensor(sigmas, torch::kFloat64), 1e-6, 1e-6});
    if (init_sigma >= 0)
        out.push_back({"init_noise_sigma", torch::tensor({sched->init_noise_sigma()}, torch::kFloat64),
                       torch::tensor({init_sigma}, torch::kFloat64), 0, 1e-6});
    // Teacher-forced loop on the stored conditioning.
    torch::Generator gen = at::detail::createCPUGenerator(uint64_t(params.seed));
    const int f = models.vae_scale_factor();
    auto noise = torch::randn({images, models.unet->config().in_channels, params.height / f, params.width / f}, gen,
                              torch::TensorOptions().dtype(torch::kFloat));
    out.push_back({"initial_noise (seed parity)", noise, g.get("initial_noise"), 0, 0, Comparison::Exact});
    out.push_back({"initial_latents", noise * sched->init_noise_sigma(), g.get("initial_latents"), 1e-6, 1e-6});
    const unet::UNetCond gcond{g.get("cfg.prompt_embeds"), g.get("cfg.text_embeds"), g.get("cfg.time_ids")};
    for (int i = 0; i < sched->num_loop_steps(); ++i) {
        const std::string p = "step." + std::to_string(i) + ".";
        if (!g.has(p + "latents")) break;
        auto state = i == 0 ? g.get("initial_latents") : g.get("step." + std::to_string(i - 1) + ".latents");
        out.push_back({p + "model_input", sched->scale_model_input(cfg_on ? torch::cat({state, state}, 0) : state, i),
                       g.get(p + "model_input")});
        auto t = torch::tensor(sched->timestep(i), torch::kFloat).reshape({});
        out.push_back(
            {p + "noise_pred", models.unet->forward(g.get(p + "model_input"), t, gcond), g.get(p + "noise_pred")});
        auto guided =
            cfg_on ? unet::cfg_combine(g.get(p + "noise_pred"), params.guidance_scale) : g.get(p + "noise_pred");
        out.push_back({p + "guided_noise_pred", guided, g.get(p + "guided_noise_pred")});
        out.push_back(
            {p + "latents", sched->step(g.get(p + "guided_noise_pred"), i, state, &gen), g.get(p + "latents")});
    }
    const auto d = pipe.decode(g.get("final_latents"));
    out.push_back({"decoded", d[0], g.get("decoded")});
    out.push_back({"image_uint8", d[2].to(torch::kFloat), g.get("image_uint8").to(torch::kFloat), 1.0, 0});
    // Free-running.
    auto r = pipe.run(params);
    out.push_back({"free-running initial_noise", r.initial_noise, g.get("initial_noise"), 0, 0, Comparison::Exact});
    out.push_back({"free-running final_latents", r.final_latents, g.get("final_latents"), 5e-2, 0, Comparison::RelMax});
    out.push_back({"free-running image", r.image, g.get("image"), 5e-2, 0});
    return out;
}

inline std::vector<Comparison> compare_sdxl_run(unet::SDModels& models, const std::filesystem::path& dir,
                                                const std::string& run) {
    // A single file has no scheduler config: the runs were made with the golden folder's.
    if (models.scheduler_config_path.empty())
        models.scheduler_config_path = (dir / "scheduler" / "scheduler_config.json").string();
    return compare_sdxl_run(models, read_json_file(dir / "golden.json").at("pipeline"), run,
                            dir / ("pipeline_" + run + ".safetensors"));
}

} // namespace anchor::sdgolden
