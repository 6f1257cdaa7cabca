// Golden checker for the few-step cases whose reference is more than one diffusers call on stored models
// (tests/golden/sd/anchorcache_cases/{sdxl_turbo,lcm_lora,taesd_pipeline}, generate/gen_fewstep.py): a folder with
// fewstep.json naming the pipeline class, the models and what the run adds to them:
//   * "StableDiffusionXLPipeline": "models" is an SDXL pipeline folder (relative to the case), every run names its
//     "scheduler_config" file (SDXL-Turbo's trailing Euler ancestral); the comparisons of tests/sdxl_golden.h.
//   * "StableDiffusionPipeline": "models" as the sd-txt2img cases (tests/sd_pipeline_golden.h), optionally "lora"
//     (a file in the case, merged with "lora_scale" as --lora FILE:M does) and "vae_decoder" (a TAESD folder in the
//     case: the final image by --vae-decoder taesd:FILE, plus the TAESD decode of the stored final latents).
// A key this checker does not understand FAILs the case naming it.
#include "tests/golden_runner/sd_comparisons.h"
#include "tests/sdxl_golden.h"
#include "unet/model/checkpoint.h"
#include "unet/model/lora.h"
#include "unet/model/taesd.h"

#include <torch/version.h>

#include <unistd.h>

namespace anchor::golden {
namespace {

bool claims_fewstep(const fs::path& d) { return has_file(d, "fewstep.json"); }

std::vector<std::string> fewstep_runs(const nlohmann::json& runs) {
    std::vector<std::string> out;
    for (const auto& [k, v] : runs.items()) out.push_back(k);
    return out;
}

void reject_unknown_fewstep_keys(const nlohmann::json& j, const std::set<std::string>& known) {
    for (const auto& [k, v] : j.items())
        if (!known.count(k)) throw Error("fewstep.json: key '" + k + "' is not understood by this checker");
}

std::vector<CaseResult> run_fewstep_sdxl(const fs::path& dir, const nlohmann::json& cfg, const std::string& base) {
    std::vector<CaseResult> out;
    unet::SDModels models;
    std::string load_error;
    try {
        reject_unknown_fewstep_keys(cfg, {"pipeline_class", "models", "pipeline"});
        models = unet::load_sd_models((dir / cfg.at("models").get<std::string>()).string());
        if (models.family != unet::SdFamily::SDXL) throw Error("fewstep.json: models is not an SDXL pipeline");
    } catch (const std::exception& e) {
        load_error = e.what();
    }
    const nlohmann::json pipeline = cfg.value("pipeline", nlohmann::json::object());
    for (const auto& run : fewstep_runs(pipeline.value("runs", nlohmann::json::object()))) {
        for (auto& r : run_results(base + ":" + run, [&] {
                 if (!load_error.empty()) throw Error(load_error);
                 // The run's scheduler: its own file, as the pipeline folder's scheduler/ would hold it.
                 nlohmann::json p = pipeline;
                 auto& rj = p["runs"][run];
                 if (!rj.contains("scheduler_config"))
                     throw Error("fewstep.json: runs." + run + " has no 'scheduler_config'");
                 models.scheduler_config_path = (dir / rj["scheduler_config"].get<std::string>()).string();
                 rj.erase("scheduler_config");
                 return sdgolden::compare_sdxl_run(models, p, run, dir / ("pipeline_" + run + ".safetensors"));
             }))
            out.push_back(r);
    }
    return out;
}

std::vector<CaseResult> run_fewstep_sd(const fs::path& dir, const nlohmann::json& cfg_in, const std::string& base) {
    std::vector<CaseResult> out;
    unet::SDModels models;
    nlohmann::json cfg = cfg_in;
    std::string load_error;
    bool taesd = false;
    try {
        // The keys that describe the engine's side of the run; the rest is the sd-txt2img layout, checked there.
        for (const char* k : {"pipeline_class", "lora", "lora_scale", "vae_decoder"}) cfg.erase(k);
        models = sdgolden::load_run_models(dir, cfg);
        if (cfg_in.contains("lora")) {
            unet::LoraSpec spec{(dir / cfg_in["lora"].get<std::string>()).string(), cfg_in.value("lora_scale", 1.0)};
            (void)unet::apply_loras(models, {spec});
        } else if (cfg_in.contains("lora_scale")) {
            throw Error("fewstep.json: lora_scale without lora");
        }
        if (cfg_in.contains("vae_decoder")) {
            unet::attach_taesd(models, (dir / cfg_in["vae_decoder"].get<std::string>()).string(), dir.string());
            taesd = true;
        }
    } catch (const std::exception& e) {
        load_error = e.what();
    }
    const auto scratch = fs::temp_directory_path() / ("anchor_golden_fewstep_" + std::to_string(::getpid()));
    fs::create_directories(scratch);
    for (const auto& run : fewstep_runs(cfg_in.value("runs", nlohmann::json::object()))) {
        for (auto& r : run_results(base + ":" + run, [&] {
                 if (!load_error.empty()) throw Error(load_error);
                 auto cmp = sdgolden::compare_run(models, dir, cfg, run, scratch.string(), [&](unet::Txt2ImgParams& p) {
                     if (taesd) p.vae_decoder = unet::VaeDecoder::Taesd;
                 });
                 if (taesd) { // the decoder alone, on the reference's final latents
                     auto g = WeightMap::load((dir / (run + ".safetensors")).string());
                     unet::Txt2ImgPipeline pipe(models);
                     const auto d = pipe.decode(g.get("final_latents"), unet::VaeDecoder::Taesd);
                     const auto want = g.get("decoded");
#if TORCH_VERSION_MAJOR >= 2
                     // Bit for bit on the reference's LibTorch (1.x). LibTorch 2's convolutions round differently, and
                     // the tiny random TAESD's outputs reach ~5e3, so an element near 0 can be 1e-2 off where the
                     // tensor's relative error is ~1e-6: there the bound is relative to the tensor's largest value.
                     cmp.push_back({"decoded (TAESD)", d[0], want, 1e-5, 0, sdgolden::Comparison::RelMax});
#else
                     cmp.push_back({"decoded (TAESD)", d[0], want});
#endif
                     cmp.push_back({"image_uint8 (TAESD)", d[2].to(torch::kFloat), g.get("image_uint8").to(torch::kFloat),
                                    1.0, 0});
                 }
                 return cmp;
             }))
            out.push_back(r);
    }
    fs::remove_all(scratch);
    return out;
}

std::vector<CaseResult> run_fewstep(const fs::path& dir, const Context& ctx) {
    const std::string base = relative_name(dir, ctx);
    nlohmann::json cfg;
    try {
        cfg = sdgolden::read_json_file(dir / "fewstep.json");
        const std::string cls = cfg.at("pipeline_class").get<std::string>();
        if (cls == "StableDiffusionXLPipeline") return run_fewstep_sdxl(dir, cfg, base);
        if (cls == "StableDiffusionPipeline") return run_fewstep_sd(dir, cfg, base);
        throw Error("fewstep.json: pipeline_class '" + cls + "' is not understood by this checker");
    } catch (const std::exception& e) {
        return {guarded(base, [&](Stats& st) { st.fail(e.what()); })};
    }
}

// The TAESD folder a few-step case names in "vae_decoder": it must load (its outputs are checked by the case).
bool named_by_fewstep_case(const fs::path& d) {
    if (!claims_fewstep(d.parent_path()) || !has_file(d, "config.json")) return false;
    try {
        const auto cfg = sdgolden::read_json_file(d.parent_path() / "fewstep.json");
        return cfg.contains("vae_decoder") &&
               fs::path(cfg["vae_decoder"].get<std::string>()).lexically_normal().filename() == d.filename();
    } catch (const std::exception&) {
        return false;
    }
}

std::vector<CaseResult> run_fewstep_model(const fs::path& dir, const Context& ctx) {
    return {guarded(relative_name(dir, ctx) + ":loads (outputs checked by the case above)", [&](Stats& st) {
        auto m = unet::load_taesd(dir.string());
        st.check_true("has a decoder", m->has_decoder());
    })};
}

const bool registered_fewstep = register_checker({"sd-fewstep", claims_fewstep, run_fewstep});
const bool registered_fewstep_model =
    register_checker({"sd-fewstep-model", named_by_fewstep_case, run_fewstep_model});

} // namespace
} // namespace anchor::golden
