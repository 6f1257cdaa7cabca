// golden_runner checker for latent consistency model cases (../shared/golden/sd/lcm_tiny): a folder with `unet/` (an
// UNet2DConditionModel with time_cond_proj_dim), `scheduler/scheduler_config.json` (LCMScheduler), config.json
// describing a "component" UNet call with the guidance embedding and a LatentConsistencyModelPipeline "pipeline" run,
// and golden.safetensors. Every parameter comes from the case; a key this checker does not know FAILs the case.
#include "cache/io/error.h"
#include "cache/io/safetensors.h"
#include "tests/golden_runner/runner.h"
#include "tests/scheduler_golden.h"
#include "unet/model/checkpoint.h"
#include "unet/samplers/scheduler.h"

#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>

#include <set>

namespace anchor::golden {
namespace {

using namespace anchor::unet;

constexpr double kLcmAtol = 1e-4, kLcmRtol = 1e-4;

bool claims_lcm(const fs::path& d) {
    if (!has_file(d, "golden.safetensors") || !fs::exists(d / "unet" / "config.json") ||
        !fs::exists(d / "scheduler" / "scheduler_config.json"))
        return false;
    try {
        const auto u = test::read_json_file(d / "unet" / "config.json");
        const auto s = test::read_json_file(d / "scheduler" / "scheduler_config.json");
        return u.contains("time_cond_proj_dim") && !u["time_cond_proj_dim"].is_null() &&
               s.value("_class_name", "") == "LCMScheduler";
    } catch (const std::exception&) {
        return false;
    }
}

void lcm_only_known(const nlohmann::json& j, const std::string& what, const std::set<std::string>& known) {
    for (const auto& [k, v] : j.items())
        if (!known.count(k)) throw Error(what + ": '" + k + "' is not understood by this checker");
}

// The UNet call with the guidance embedding of w - 1 per batch row (diffusers passes timestep_cond).
void check_component(UNet2DConditionModelImpl& unet, const nlohmann::json& c, SafeTensorsFile& g, Stats& st) {
    lcm_only_known(c, "config.json component", {"timesteps", "guidance_scale_w", "timestep_cond"});
    const auto sample = g.tensor("sample"), ts = g.tensor("timesteps");
    const auto want_ts = c.at("timesteps").get<std::vector<int64_t>>();
    st.check_equal("timesteps", ts, torch::tensor(want_ts, torch::kInt64));
    const double w = c.at("guidance_scale_w").get<double>();
    const int64_t B = sample.size(0);
    auto cond_emb =
        guidance_scale_embedding(torch::full({B}, w - 1.0, torch::kFloat32), unet.config().time_cond_proj_dim);
    st.check("timestep_cond", cond_emb, g.tensor("timestep_cond"), kLcmAtol, kLcmRtol);
    UNetCond cond(g.tensor("encoder_hidden_states"));
    cond.timestep_cond = g.tensor("timestep_cond");
    st.check("unet_out", unet.forward(sample, ts, cond), g.tensor("unet_out"), kLcmAtol, kLcmRtol);
}

// LatentConsistencyModelPipeline's loop on the stored prompt embeddings: no CFG batch, the guidance embedding of
// guidance_scale - 1, one generator for the initial latents and every step's noise.
void check_pipeline(UNet2DConditionModelImpl& unet, const fs::path& dir, const nlohmann::json& p, SafeTensorsFile& g,
                    Stats& st) {
    lcm_only_known(p, "config.json pipeline",
                   {"replicates", "scheduler", "num_inference_steps", "original_inference_steps", "guidance_scale",
                    "batch", "generator_seed", "initial_latents", "step", "timesteps", "recorded"});
    auto scfg = SchedulerConfig::from_json_file((dir / "scheduler" / "scheduler_config.json").string());
    const auto unsupported =
        unsupported_scheduler_settings(read_text(dir / "scheduler" / "scheduler_config.json"), SamplerKind::LCM);
    if (!unsupported.empty()) throw Error("scheduler_config.json: " + unsupported.front());
    scfg.original_inference_steps = p.at("original_inference_steps").get<int>();
    auto sched = make_scheduler(SamplerKind::LCM, scfg);
    const int n = p.at("num_inference_steps").get<int>();
    sched->set_timesteps(n);
    const auto want_ts = p.at("timesteps").get<std::vector<double>>();
    st.check_true("timesteps", sched->timesteps() == want_ts, "the LCM schedule differs from the case's");
    const int64_t B = p.at("batch").get<int64_t>();
    const auto embeds = g.tensor("prompt_embeds");
    if (embeds.size(0) != B) throw Error("prompt_embeds has batch " + std::to_string(embeds.size(0)));
    auto gen = at::make_generator<at::CPUGeneratorImpl>(p.at("generator_seed").get<uint64_t>());
    const int64_t C = unet.config().in_channels;
    const auto init = g.tensor("initial_latents");
    auto latents = torch::randn({B, C, init.size(2), init.size(3)}, gen, torch::kFloat32) * sched->init_noise_sigma();
    st.check("initial_latents", latents, init, kLcmAtol, kLcmRtol);
    UNetCond cond(embeds);
    cond.timestep_cond =
        guidance_scale_embedding(torch::full({B}, p.at("guidance_scale").get<double>() - 1.0, torch::kFloat32),
                                 unet.config().time_cond_proj_dim);
    torch::Tensor denoised;
    // The loop runs free (each step from the last): bit for bit on the reference's LibTorch (1.x), the tolerance of a
    // single forward there. LibTorch 2's kernels round the tiny UNet differently (its 1x1 levels amplify that,
    // ../shared/golden/sd/README.md) and LCM's x0 = (x - sqrt(1 - abar) eps) / sqrt(abar) multiplies the UNet's
    // difference by ~15 at t = 999, so there the README's free-running tolerance applies: max |a - b| <= 5e-2 max |g|.
    auto check_loop = [&st](const std::string& what, const torch::Tensor& a, const torch::Tensor& g) {
#if TORCH_VERSION_MAJOR >= 2
        st.check(what, a, g, 5e-2 * g.abs().max().item<double>(), 0.0);
#else
        st.check(what, a, g, kLcmAtol, kLcmRtol);
#endif
    };
    for (int i = 0; i < sched->num_loop_steps(); ++i) {
        const auto t = torch::tensor(int64_t(sched->timestep(i)));
        auto out = unet.forward(sched->scale_model_input(latents, i), t, cond);
        latents = sched->step(out, i, latents, &gen);
        denoised = sched->denoised();
        check_loop("latents." + std::to_string(i), latents, g.tensor("latents." + std::to_string(i)));
        check_loop("denoised." + std::to_string(i), denoised, g.tensor("denoised." + std::to_string(i)));
    }
    check_loop("final_denoised", denoised, g.tensor("final_denoised"));
}

const bool registered_sd_lcm =
    register_checker({"sd-lcm", claims_lcm, [](const fs::path& dir, const Context& ctx) {
                          const std::string base = relative_name(dir, ctx);
                          const auto cfg = test::read_json_file(dir / "config.json");
                          std::vector<CaseResult> out;
                          UNet2DConditionModel unet{nullptr};
                          std::shared_ptr<SafeTensorsFile> g;
                          out.push_back(guarded(base + "/component", [&](Stats& st) {
                              lcm_only_known(cfg, "config.json", {"diffusers", "unet_config", "component", "pipeline"});
                              unet = load_unet_folder((dir / "unet").string());
                              g = SafeTensorsFile::open((dir / "golden.safetensors").string());
                              torch::NoGradGuard ng;
                              check_component(*unet, cfg.at("component"), *g, st);
                          }));
                          out.push_back(guarded(base + "/pipeline", [&](Stats& st) {
                              if (!unet || !g) throw Error("the UNet did not load (see the component case)");
                              torch::NoGradGuard ng;
                              check_pipeline(*unet, dir, cfg.at("pipeline"), *g, st);
                          }));
                          return out;
                      }});

// The case's unet/ folder: it loads (every tensor used by the model, cond_proj included); its forward is the
// component case of the folder above.
const bool registered_sd_lcm_unet = register_checker(
    {"sd-lcm-unet", [](const fs::path& d) { return d.filename() == "unet" && claims_lcm(d.parent_path()); },
     [](const fs::path& dir, const Context& ctx) {
         return std::vector<CaseResult>{
             guarded(relative_name(dir, ctx) + ":loads (forward checked by the case above)", [&](Stats& st) {
                 auto unet = load_unet_folder(dir.string());
                 st.check_true("time_cond_proj_dim",
                               unet->config().time_cond_proj_dim > 0 && unet->time_embedding->cond_proj,
                               "no cond_proj");
             })};
     }});

} // namespace
} // namespace anchor::golden
