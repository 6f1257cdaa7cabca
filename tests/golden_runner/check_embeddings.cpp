// Golden checker for textual-inversion embeddings (tests/golden/sd/anchorcache_cases/textual_inversion_*): a folder
// whose config.json has "textual_inversion" and a golden_textual_inversion.safetensors, made by
// generate/gen_textual_inversion.py with diffusers' load_textual_inversion. The embeddings folder is read as
// --embedding-dir reads it; every prompt is encoded under A1111 syntax (the names expand to their vectors, emphasis
// weighs them) and compared with the reference's prompt embeddings; every run goes through the pipeline a user runs.
#include "cache/io/error.h"
#include "cache/io/weight_map.h"
#include "tests/golden_runner/runner.h"
#include "tests/sd_pipeline_golden.h"
#include "unet/model/embeddings.h"

#include <nlohmann/json.hpp>

#include <set>

namespace anchor::golden {
namespace {

using nlohmann::json;

constexpr const char* kTiGoldenFile = "golden_textual_inversion.safetensors";

void ti_known_keys(const json& j, const std::set<std::string>& known, const std::string& where) {
    if (!j.is_object()) throw Error(where + " is not an object");
    for (const auto& [k, v] : j.items())
        if (!known.count(k)) throw Error(where + ": key '" + k + "' is not understood by this checker");
}

bool ti_claims(const fs::path& d) {
    if (!has_file(d, "config.json") || !has_file(d, kTiGoldenFile)) return false;
    try {
        return sdgolden::read_json_file(d / "config.json").contains("textual_inversion");
    } catch (...) {
        return false;
    }
}

struct TiCase {
    fs::path dir;
    json cfg;
    bool sdxl = false;
    unet::SDModels models;
    std::shared_ptr<const unet::EmbeddingDatabase> db;
    unet::SchedulerConfig scheduler;
};

void ti_load(TiCase& c) {
    c.cfg = sdgolden::read_json_file(c.dir / "config.json");
    ti_known_keys(c.cfg,
                  {"textual_inversion", "family", "models", "model", "embedding_dir", "scheduler_base_config", "encode",
                   "runs"},
                  "config.json");
    const std::string family = c.cfg.at("family").get<std::string>();
    if (family == "sd1") {
        c.models = sdgolden::load_run_models(c.dir, c.cfg);
    } else if (family == "sdxl") {
        c.sdxl = true;
        c.models = unet::load_sd_models((c.dir.parent_path() / c.cfg.at("model").get<std::string>()).string());
    } else {
        throw Error("config.json: family '" + family + "', expected sd1 or sdxl");
    }
    c.db = std::make_shared<const unet::EmbeddingDatabase>(
        unet::EmbeddingDatabase::load_dir((c.dir / c.cfg.at("embedding_dir").get<std::string>()).string()));
    c.scheduler = unet::SchedulerConfig::from_json_text(c.cfg.at("scheduler_base_config").dump(),
                                                        "config.json:scheduler_base_config");
}

// Prompt embeddings of one prompt (no CFG) against encode.<name>.*.
void ti_check_encode(TiCase& c, const std::string& name, const json& e, const WeightMap& g, Stats& st) {
    ti_known_keys(e, {"prompt", "fragments"}, "config.json encode." + name);
    unet::Txt2ImgPipeline pipe(c.models);
    unet::Txt2ImgParams p;
    p.prompts = {e.at("prompt").get<std::string>()};
    p.prompt_syntax = unet::PromptSyntax::A1111;
    p.embeddings = c.db;
    p = pipe.resolved(p);
    pipe.validate(p);
    c10::InferenceMode guard;
    const auto cond = pipe.encode_conditioning(p, false, nullptr);
    const std::string key = "encode." + name + ".";
    st.check(key + "prompt_embeds", cond.context, g.get(key + "prompt_embeds"), kAtol, kRtol);
    if (c.sdxl) st.check(key + "pooled_prompt_embeds", cond.text_embeds, g.get(key + "pooled_prompt_embeds"), kAtol, kRtol);
}

// A pipeline run against run.<name>.*: its conditioning closely, the free-running loop as the other pipeline cases
// (tests/golden/sd/README.md).
void ti_check_run(TiCase& c, const std::string& name, const json& r, const WeightMap& g, Stats& st) {
    ti_known_keys(r,
                  {"scheduler", "num_inference_steps", "prompt", "negative_prompt", "seed", "guidance_scale", "height",
                   "width"},
                  "config.json runs." + name);
    unet::Txt2ImgPipeline pipe(c.models);
    unet::Txt2ImgParams p;
    p.prompts = {r.at("prompt").get<std::string>()};
    p.negative_prompts = {r.at("negative_prompt").get<std::string>()};
    p.sampler = sdgolden::sampler_from_class(r.at("scheduler").get<std::string>());
    sdgolden::check_scheduler_settings(c.cfg.at("scheduler_base_config"), p.sampler,
                                       "config.json: scheduler_base_config");
    p.steps = r.at("num_inference_steps").get<int>();
    p.seed = r.at("seed").get<int64_t>();
    p.guidance_scale = r.at("guidance_scale").get<double>();
    p.height = r.at("height").get<int>();
    p.width = r.at("width").get<int>();
    p.prompt_syntax = unet::PromptSyntax::A1111;
    p.embeddings = c.db;
    auto res = pipe.run(p, nullptr, {}, {}, &c.scheduler);
    const std::string key = "run." + name + ".";
    st.check(key + "prompt_embeds", res.prompt_embeds, g.get(key + "prompt_embeds"), kAtol, kRtol);
    if (c.sdxl)
        st.check(key + "pooled_prompt_embeds", res.text_embeds, g.get(key + "pooled_prompt_embeds"), kAtol, kRtol);
    if (g.has(key + "initial_noise")) st.check_equal(key + "initial_noise", res.initial_noise, g.get(key + "initial_noise"));
    const auto gl = g.get(key + "final_latents");
    st.check(key + "final_latents (free-running, 5e-2 x max)", res.final_latents, gl,
             5e-2 * gl.abs().max().item<double>(), 0.0);
    st.check(key + "image (free-running)", res.image, g.get(key + "image"), 5e-2, 0.0);
    // The infotext's TI hashes: every embedding named by the prompt or the negative prompt, once.
    std::set<std::string> named;
    for (const auto& [n, h] : res.ti_hashes) {
        const auto* e = c.db->find(n);
        st.check_true(key + "TI hashes " + n, e && e->short_hash() == h, "hash " + h);
        named.insert(n);
    }
    st.check_true(key + "TI hashes count", named.size() == res.ti_hashes.size() && !named.empty(),
                  std::to_string(res.ti_hashes.size()) + " entries");
}

const bool registered_embeddings = register_checker(
    {"sd-textual-inversion", ti_claims, [](const fs::path& dir, const Context& ctx) {
         std::vector<CaseResult> out;
         TiCase c;
         c.dir = dir;
         std::string load_error;
         try {
             ti_load(c);
         } catch (const std::exception& e) {
             load_error = e.what();
         }
         const std::string base = relative_name(dir, ctx);
         if (!load_error.empty()) {
             out.push_back(guarded(base, [&](Stats&) { throw Error(load_error); }));
             return out;
         }
         const auto g = WeightMap::load((dir / kTiGoldenFile).string());
         for (const auto& [name, e] : c.cfg.at("encode").items())
             out.push_back(guarded(base + ":encode." + name, [&](Stats& st) { ti_check_encode(c, name, e, g, st); }));
         for (const auto& [name, r] : c.cfg.at("runs").items())
             out.push_back(guarded(base + ":run." + name, [&](Stats& st) { ti_check_run(c, name, r, g, st); }));
         return out;
     }});

} // namespace
} // namespace anchor::golden
