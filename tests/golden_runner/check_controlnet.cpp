// Golden checker for ControlNet cases (controlnet_tiny): a folder whose config.json names a "controlnet_config" and
// holds golden_controlnet.safetensors (the ControlNet's residuals and the UNet with and without them, config
// "component") and/or golden_pipeline.safetensors (diffusers' StableDiffusionControlNetPipeline run, config
// "pipeline": latents after every step and the images). Every parameter is read from config.json; a key this checker
// does not know fails the case naming it. Also the model folders of such a case (unet/, vae/, controlnet/): loaded,
// their configs checked against the weights, their forwards checked by the case's lines.
#include "cache/io/error.h"
#include "cache/io/weight_map.h"
#include "tests/golden_runner/sd_comparisons.h"
#include "unet/model/controlnet.h"
#include "unet/pipeline/pipeline.h"
#include "unet/samplers/scheduler.h"

#include <nlohmann/json.hpp>

#include <set>

namespace anchor::golden {
namespace {

using sdgolden::Comparison;
using torch::Tensor;

nlohmann::json read_config(const fs::path& dir) {
    return nlohmann::json::parse(read_text(dir / "config.json"));
}

bool is_controlnet_case(const fs::path& d) {
    if (!has_file(d, "config.json")) return false;
    try {
        const auto j = read_config(d);
        return j.is_object() && j.contains("controlnet_config");
    } catch (...) {
        return false;
    }
}

// The folder a config path ("controlnet/config.json", "unet/config.json") lives in.
fs::path model_dir(const fs::path& dir, const nlohmann::json& cfg, const char* key, const char* def) {
    const std::string p = cfg.contains(key) && cfg[key].is_string() ? cfg[key].get<std::string>() : std::string(def);
    return (dir / p).parent_path();
}

void reject_unknown(const nlohmann::json& section, const std::set<std::string>& known, const std::string& where) {
    for (const auto& [k, v] : section.items())
        if (!known.count(k))
            throw Error(where + ": key '" + k + "' (" + v.dump().substr(0, 60) + ") is not understood");
}

std::vector<Comparison> compare_component(const fs::path& dir, const nlohmann::json& cfg) {
    const auto& c = cfg.at("component");
    reject_unknown(
        c,
        {"timesteps", "conditioning_scale", "guess_mode", "sample", "encoder_hidden_states", "controlnet_cond",
         "text_embeds", "time_ids"},
        "config.json component");
    const double scale = c.value("conditioning_scale", 1.0);
    const bool guess = c.value("guess_mode", false);
    auto g = WeightMap::load((dir / "golden_controlnet.safetensors").string());
    const auto& cc = cfg.at("controlnet_config");
    if (!cc.is_string()) throw Error("config.json component with several ControlNets is not understood");
    auto net = unet::load_controlnet(model_dir(dir, cfg, "controlnet_config", "controlnet/config.json").string());
    auto unet = unet::load_unet_folder(model_dir(dir, cfg, "unet_config", "unet/config.json").string());
    c10::InferenceMode guard;
    const Tensor x = g.get("sample"), t = g.get("timesteps");
    // SDXL's added conditioning (text_time): the pooled text embedding and the size/crop numbers, for the UNet and
    // the ControlNet alike; both or neither.
    if (g.has("text_embeds") != g.has("time_ids"))
        throw Error("golden_controlnet.safetensors: text_embeds and time_ids go together (SDXL's added conditioning)");
    const unet::UNetCond ctx = g.has("text_embeds")
                                   ? unet::UNetCond(g.get("encoder_hidden_states"), g.get("text_embeds"), g.get("time_ids"))
                                   : unet::UNetCond(g.get("encoder_hidden_states"));
    std::vector<Comparison> out;
    if (c.contains("timesteps"))
        out.push_back({"timesteps (config)", t.to(torch::kFloat64),
                       torch::tensor(c["timesteps"].get<std::vector<double>>(), torch::kFloat64), 0, 0,
                       Comparison::Exact});
    const auto r = net->residuals(x, t, ctx, g.get("controlnet_cond"), scale, guess);
    int k = 0;
    for (; g.has("down_block_res_samples." + std::to_string(k)); ++k) {
        const std::string name = "down_block_res_samples." + std::to_string(k);
        if (size_t(k) >= r.down.size())
            throw Error(name + ": the ControlNet produced " + std::to_string(r.down.size()));
        out.push_back({name, r.down[size_t(k)], g.get(name), 1e-4, 1e-4});
    }
    out.push_back({"residual count", torch::tensor({double(r.down.size())}), torch::tensor({double(k)}), 0, 0,
                   Comparison::Exact});
    out.push_back({"mid_block_res_sample", r.mid, g.get("mid_block_res_sample"), 1e-4, 1e-4});
    // The UNet alone, with the golden residuals, and end to end with the ControlNet attached (lazy residuals).
    out.push_back({"unet_out_plain", unet->forward(x, t, ctx), g.get("unet_out_plain"), 5e-3, 1e-4});
    unet::UNetCond with = ctx;
    for (int j = 0; j < k; ++j) with.residuals.down.push_back(g.get("down_block_res_samples." + std::to_string(j)));
    with.residuals.mid = g.get("mid_block_res_sample");
    out.push_back({"unet_out_with_control (golden residuals)", unet->forward(x, t, with),
                   g.get("unet_out_with_control"), 5e-3, 1e-4});
    unet::UNetCond own = ctx;
    own.residuals = r;
    out.push_back({"unet_out_with_control (own residuals)", unet->forward(x, t, own), g.get("unet_out_with_control"),
                   5e-3, 1e-4});
    return out;
}

std::vector<Comparison> compare_pipeline(const fs::path& dir, const nlohmann::json& cfg) {
    const auto& pc = cfg.at("pipeline");
    reject_unknown(pc,
                   {"class", "scheduler", "num_inference_steps", "guidance_scale", "controlnet_conditioning_scale",
                    "height", "width", "batch", "num_images_per_prompt", "generator_seed", "control_image",
                    "prompt_embeds", "negative_prompt_embeds", "recorded", "guess_mode", "control_guidance_start",
                    "control_guidance_end", "eta"},
                   "config.json pipeline");
    if (pc.value("class", "") != "StableDiffusionControlNetPipeline")
        throw Error("config.json pipeline class '" + pc.value("class", "") + "' is not understood");
    auto g = WeightMap::load((dir / "golden_pipeline.safetensors").string());
    unet::SDModels m;
    m.source = dir.string();
    m.layout = "diffusers";
    m.unet = unet::load_unet_folder(model_dir(dir, cfg, "unet_config", "unet/config.json").string());
    m.vae = unet::load_vae_folder((dir / "vae").string());
    const fs::path sched_file = dir / "scheduler" / "scheduler_config.json";
    m.scheduler_config_path = sched_file.string();
    const auto sched_json = nlohmann::json::parse(read_text(sched_file));
    const std::string cls = sched_json.value("_class_name", "");
    if (pc.contains("scheduler") && pc["scheduler"].get<std::string>() != cls)
        throw Error("config.json pipeline scheduler '" + pc["scheduler"].get<std::string>() +
                    "' but scheduler_config.json has '" + cls + "'");
    const auto kind = unet::sampler_from_class_name(cls, sched_json.value("use_karras_sigmas", false),
                                                    sched_json.value("algorithm_type", ""));
    sdgolden::check_scheduler_settings(sched_json, kind, "scheduler_config.json");

    // One ControlNet, or several (diffusers' MultiControlNetModel): "controlnet_config" a list, and the images,
    // scales, starts and ends lists of the same length or one value for all.
    const auto& cc = cfg.at("controlnet_config");
    const auto configs =
        cc.is_array() ? cc.get<std::vector<std::string>>() : std::vector<std::string>{cc.get<std::string>()};
    auto nth = [&](const char* key, size_t k, const nlohmann::json& def) {
        if (!pc.contains(key)) return def;
        const auto& v = pc[key];
        if (!v.is_array()) return v;
        if (v.size() != configs.size())
            throw Error(std::string("config.json pipeline ") + key + ": " + std::to_string(v.size()) + " values for " +
                        std::to_string(configs.size()) + " ControlNets");
        return v[k];
    };
    std::vector<unet::ControlParams> control;
    for (size_t k = 0; k < configs.size(); ++k) {
        unet::ControlParams cp;
        cp.net = unet::load_controlnet((dir / configs[k]).parent_path().string());
        cp.source = configs[k];
        std::string img = nth("control_image", k, "control_image.png").get<std::string>();
        img = img.substr(0, img.find(' ')); // "control_image.png (16x16 RGB), passed as a PIL image"
        cp.image = (dir / img).string();
        cp.scale = nth("controlnet_conditioning_scale", k, 1.0).get<double>();
        cp.start = nth("control_guidance_start", k, 0.0).get<double>();
        cp.end = nth("control_guidance_end", k, 1.0).get<double>();
        cp.guess_mode = pc.value("guess_mode", false);
        control.push_back(cp);
    }

    unet::Txt2ImgParams p;
    p.sampler = kind;
    p.steps = pc.at("num_inference_steps").get<int>();
    p.guidance_scale = pc.at("guidance_scale").get<double>();
    p.seed = pc.at("generator_seed").get<int64_t>();
    p.width = pc.value("width", 0);
    p.height = pc.value("height", 0);
    if (pc.contains("eta")) p.eta = pc["eta"].get<double>();
    const Tensor pos = g.get("prompt_embeds");
    const int64_t P = pos.size(0);
    const int64_t batch = pc.value("batch", P);
    const int n = pc.value("num_images_per_prompt", int(batch / std::max<int64_t>(P, 1)));
    if (P * n != batch)
        throw Error("config.json: batch " + std::to_string(batch) + " is not " + std::to_string(P) +
                    " prompt_embeds rows x " + std::to_string(n) + " images per prompt");
    const bool cfg_on = p.guidance_scale > 1.0;
    // diffusers' encode_prompt with given embeddings: each row repeated num_images_per_prompt times.
    Tensor rows = pos.repeat_interleave(n, 0);
    if (cfg_on) rows = torch::cat({g.get("negative_prompt_embeds").repeat_interleave(n, 0), rows}, 0);
    p.prompt_embeds = rows;
    p.prompts.assign(size_t(batch), "");
    p.images_per_prompt = 1;
    p.control = control;

    std::vector<Comparison> out;
    if (g.has("control_image_u8"))
        out.push_back({"control_image_u8 (PNG decode)", unet::control_image_rgb(control[0])[0],
                       g.get("control_image_u8"), 0, 0, Comparison::Exact});
    unet::Txt2ImgPipeline pipe(m);
    const auto pr = pipe.resolved(p);
    pipe.validate(pr);
    c10::InferenceMode guard;
    const int f = m.vae_scale_factor();
    // Teacher-forced: each step from the golden state before it.
    {
        const auto sconf = pipe.scheduler_config(pr);
        auto sched = unet::make_scheduler(pr.sampler, sconf, pr.eta);
        sched->set_timesteps(pr.steps);
        torch::Generator gen = at::detail::createCPUGenerator(uint64_t(pr.seed));
        auto state = torch::randn({batch, m.unet->config().in_channels, pr.height / f, pr.width / f}, gen,
                                  torch::TensorOptions().dtype(torch::kFloat)) *
                     sched->init_noise_sigma();
        const int steps = sched->num_loop_steps();
        const unet::ControlRun control(pr.control, pr.width, pr.height, batch, 1, cfg_on, steps);
        unet::FullDenoiser full;
        const unet::UNetCond ctx(pr.prompt_embeds);
        for (int i = 0; i < steps && g.has("latents." + std::to_string(i)); ++i) {
            const auto next =
                pipe.step(*sched, i, state, control.at(ctx, i), pr.guidance_scale, cfg_on, full, gen, nullptr);
            const std::string name = "latents." + std::to_string(i);
            // Relative to the state's scale: a batch of several rows rounds the tiny model's 1x1 levels differently
            // from one row (tests/golden/sd/README.md), and the sampler multiplies that by its step size.
            out.push_back({name, next, g.get(name), 1e-4, 0, Comparison::RelMax});
            state = g.get(name);
        }
    }
    // Free-running, through the pipeline a user runs.
    const auto r = pipe.run(pr);
    int last = 0;
    while (g.has("latents." + std::to_string(last + 1))) ++last;
    out.push_back({"free-running final latents", r.final_latents, g.get("latents." + std::to_string(last)), 5e-2, 0,
                   Comparison::RelMax});
    out.push_back({"free-running images", r.image, g.get("images"), 5e-2, 0});
    return out;
}

const bool registered_controlnet = register_checker(
    {"controlnet", is_controlnet_case, [](const fs::path& dir, const Context& ctx) {
         std::vector<CaseResult> out;
         const std::string base = relative_name(dir, ctx);
         nlohmann::json cfg;
         std::string err;
         try {
             cfg = read_config(dir);
         } catch (const std::exception& e) {
             err = e.what();
         }
         bool any = false;
         if (has_file(dir, "golden_controlnet.safetensors")) {
             any = true;
             CaseResult r;
             r.name = base + ":controlnet+unet";
             try {
                 if (!err.empty()) throw Error(err);
                 if (!cfg.contains("component")) throw Error("config.json has no 'component' section");
                 for (const auto& c : compare_component(dir, cfg)) apply_comparison(r.stats, c);
             } catch (const std::exception& e) {
                 r.stats.fail(std::string("exception: ") + e.what());
             }
             out.push_back(r);
         }
         if (has_file(dir, "golden_pipeline.safetensors")) {
             any = true;
             for (auto& r : run_results(base + ":pipeline", [&] {
                      if (!err.empty()) throw Error(err);
                      return compare_pipeline(dir, cfg);
                  }))
                 out.push_back(r);
         }
         if (!any) {
             CaseResult r;
             r.name = base + ":controlnet";
             r.stats.fail("no golden_controlnet.safetensors / golden_pipeline.safetensors in the case");
             out.push_back(r);
         }
         for (const auto& [k, v] : cfg.items())
             if (k != "diffusers" && k != "unet_config" && k != "controlnet_config" && k != "init" &&
                 k != "component" && k != "pipeline") {
                 CaseResult r;
                 r.name = base + ":config";
                 r.stats.fail("config.json key '" + k + "' is not understood");
                 out.push_back(r);
             }
         return out;
     }});

// A model folder of a ControlNet case (its forward is checked by the case's lines).
bool model_of_controlnet_case(const fs::path& d) {
    const std::string cls = config_class(d);
    return (cls == "UNet2DConditionModel" || cls == "AutoencoderKL" || cls == "ControlNetModel") &&
           !has_file(d, "golden_outputs.safetensors") && is_controlnet_case(d.parent_path());
}

const bool registered_controlnet_models =
    register_checker({"controlnet-model", model_of_controlnet_case, [](const fs::path& dir, const Context& ctx) {
                          CaseResult r;
                          r.name = relative_name(dir, ctx) + ":load (forward checked by the case above)";
                          try {
                              const std::string cls = config_class(dir);
                              std::vector<Tensor> params;
                              if (cls == "ControlNetModel") {
                                  auto m = unet::load_controlnet(dir.string());
                                  r.stats.check_true("zero convs = skips", int(m->zero_convs.size()) == m->num_skips());
                                  params = m->parameters();
                              } else if (cls == "UNet2DConditionModel") {
                                  params = unet::load_unet_folder(dir.string())->parameters();
                              } else {
                                  params = unet::load_vae_folder(dir.string())->parameters();
                              }
                              bool finite = !params.empty();
                              for (const auto& p : params) finite = finite && torch::isfinite(p).all().item<bool>();
                              r.stats.check_true("weights present and finite", finite);
                          } catch (const std::exception& e) {
                              r.stats.fail(std::string("exception: ") + e.what());
                          }
                          return std::vector<CaseResult>{r};
                      }});

} // namespace
} // namespace anchor::golden
