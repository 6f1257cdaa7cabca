// Golden checker for Stable Diffusion 3 / 3.5 cases (tests/golden/sd/sd3_tiny): a folder whose config.json names
// SD3Transformer2DModel sub-folders ("variants", "pipeline.transformer"), with golden_transformer_<variant>,
// golden_vae and golden_pipeline safetensors. Lines: each transformer variant (output and every block's outputs), the
// VAE decode / encode, the scheduler's timesteps and sigmas, the pipeline teacher-forced (each step from the stored
// latents before it) and free-running (the whole loop from the initial latents). Every parameter comes from the case:
// folders, steps, guidance, batch, the scheduler config (shift, dynamic shifting); a key this checker does not
// understand is a FAIL naming it. The model sub-folders are claimed as components that must load, every tensor used.
#include "cache/io/error.h"
#include "cache/io/read_file.h"
#include "cache/io/weight_map.h"
#include "tests/golden_runner/runner.h"

#include <torch/version.h>
#include "unet/model/checkpoint.h"
#include "unet/model/mmdit.h"
#include "unet/pipeline/sd3_pipeline.h"

#include <nlohmann/json.hpp>

#include <set>

namespace anchor::golden::sd3 { // a namespace of its own: the runner's sources build as one unity file
namespace {

using namespace anchor::unet;

constexpr double kFreeLatents = 5e-2;        // free-running final latents: max |a - g| <= this * max |g|
constexpr double kFreeImage = 5e-2;          // free-running image in [0, 1]
constexpr const char* kTransformerClass = "SD3Transformer2DModel";

nlohmann::json case_json(const fs::path& dir) {
    return nlohmann::json::parse(read_text(dir / "config.json"));
}

// "scheduler/ (FlowMatchEulerDiscreteScheduler, shift 3.00)" -> "scheduler"; "vae/config.json (...)" -> "vae".
std::string leading_folder(const std::string& s) {
    return s.substr(0, s.find_first_of(" /"));
}

bool is_sd3_case(const fs::path& dir) {
    if (!has_file(dir, "config.json") || !config_class(dir).empty()) return false;
    const auto j = case_json(dir);
    if (!j.is_object()) return false;
    if (j.contains("variants") && j["variants"].is_object())
        for (const auto& [name, v] : j["variants"].items())
            if (v.is_object() && v.contains("folder") &&
                config_class(dir / v["folder"].get<std::string>()) == kTransformerClass)
                return true;
    if (j.contains("pipeline") && j["pipeline"].is_object() && j["pipeline"].contains("transformer"))
        return config_class(dir / leading_folder(j["pipeline"]["transformer"].get<std::string>())) == kTransformerClass;
    return false;
}

void check_unknown_keys(Stats& st, const nlohmann::json& j, const std::set<std::string>& known,
                        const std::string& where) {
    for (const auto& [k, v] : j.items())
        if (!known.count(k)) st.fail(where + " key '" + k + "' is not understood by this checker");
}

// The forward on the golden file's inputs: `out` and every block feature it holds.
void compare_transformer(SD3Transformer2DModelImpl& model, const fs::path& golden, Stats& st) {
    const auto g = WeightMap::load(golden.string());
    FeatureMap f;
    torch::NoGradGuard ng;
    const auto out = model.forward(g.get("hidden_states"), g.get("encoder_hidden_states"), g.get("pooled_projections"),
                                   g.get("timestep"), &f);
    static const std::set<std::string> inputs = {"hidden_states", "encoder_hidden_states", "pooled_projections",
                                                 "timestep"};
    for (const auto& name : g.names()) {
        if (inputs.count(name)) continue;
        if (name == "out") {
            st.check(name, out, g.get(name), kAtol, kRtol);
        } else if (f.count(name)) {
            st.check(name, f.at(name), g.get(name), kAtol, kRtol);
        } else {
            st.fail("golden tensor '" + name + "' is not produced by the forward");
        }
    }
}

void check_transformer(const fs::path& dir, const std::string& variant, const nlohmann::json& vj, Stats& st) {
    const fs::path golden = dir / ("golden_transformer_" + variant + ".safetensors");
    if (!fs::exists(golden)) throw Error("variant '" + variant + "': no " + golden.filename().string());
    check_unknown_keys(st, vj, {"folder", "config_extra", "output_std"}, "variants." + variant);
    auto model = load_sd3_transformer_folder((dir / vj.at("folder").get<std::string>()).string());
    compare_transformer(*model, golden, st);
}

void check_vae(const fs::path& dir, const nlohmann::json& vj, Stats& st) {
    check_unknown_keys(st, vj, {"config", "decoded", "encoded_mean"}, "vae");
    auto vae = load_vae_folder((dir / leading_folder(vj.value("config", std::string("vae/")))).string());
    const auto g = WeightMap::load((dir / "golden_vae.safetensors").string());
    torch::NoGradGuard ng;
    if (vj.contains("decoded")) st.check("decoded", vae->decode(g.get("latents")), g.get("decoded"), kAtol, kRtol);
    if (vj.contains("encoded_mean"))
        st.check("encoded_mean", vae->encode(g.get("image")).mean, g.get("encoded_mean"), kAtol, kRtol);
}

struct PipelineCase {
    nlohmann::json pj;
    SchedulerConfig scfg;
    int steps = 0;
    double guidance = 0;
};

PipelineCase read_pipeline(const fs::path& dir, const nlohmann::json& j) {
    PipelineCase pc;
    pc.pj = j.at("pipeline");
    const fs::path sdir = dir / leading_folder(pc.pj.at("scheduler").get<std::string>());
    const std::string text = read_file((sdir / "scheduler_config.json").string(), "scheduler config");
    pc.scfg = SchedulerConfig::from_json_text(text, (sdir / "scheduler_config.json").string());
    if (sampler_from_class_name(pc.scfg.class_name) != SamplerKind::FlowMatchEuler)
        throw Error("the pipeline's scheduler is " + pc.scfg.class_name + ", not FlowMatchEulerDiscreteScheduler");
    const auto bad = unsupported_scheduler_settings(text, SamplerKind::FlowMatchEuler);
    if (!bad.empty()) {
        std::string all;
        for (const auto& b : bad) all += (all.empty() ? "" : "; ") + b;
        throw Error("scheduler_config.json: " + all);
    }
    pc.steps = pc.pj.at("num_inference_steps").get<int>();
    pc.guidance = pc.pj.at("guidance_scale").get<double>();
    return pc;
}

std::unique_ptr<Scheduler> make_flow_scheduler(const PipelineCase& pc, const torch::Tensor& latents, int64_t patch) {
    SchedulerConfig c = pc.scfg;
    // Dynamic shifting: mu from the image's token count (diffusers' calculate_shift).
    if (c.use_dynamic_shifting) c.mu = flow_match_mu(c, (latents.size(2) / patch) * (latents.size(3) / patch));
    auto s = make_scheduler(SamplerKind::FlowMatchEuler, c);
    s->set_timesteps(pc.steps);
    return s;
}

void check_scheduler(const PipelineCase& pc, const torch::Tensor& latents, int64_t patch, Stats& st) {
    auto s = make_flow_scheduler(pc, latents, patch);
    auto vec = [](const std::vector<double>& v) { return torch::tensor(v, torch::kDouble); };
    if (pc.pj.contains("timesteps"))
        st.check("timesteps", vec(s->timesteps()), vec(pc.pj["timesteps"].get<std::vector<double>>()), 0.0, 0.0);
    if (pc.pj.contains("sigmas"))
        st.check("sigmas", vec(s->sigmas()), vec(pc.pj["sigmas"].get<std::vector<double>>()), 0.0, 1e-6);
}

std::vector<CaseResult> check_pipeline(const fs::path& dir, const nlohmann::json& j, const std::string& base) {
    CaseResult sched, tf, fr;
    sched.name = base + ":scheduler";
    tf.name = base + ":pipeline:teacher-forced";
    fr.name = base + ":pipeline:free-running";
    try {
        const auto pc = read_pipeline(dir, j);
        check_unknown_keys(tf.stats, pc.pj,
                           {"replicates", "transformer", "scheduler", "num_inference_steps", "guidance_scale", "batch",
                            "generator_seed", "initial_latents", "timesteps", "sigmas", "decode", "recorded"},
                           "pipeline");
        auto transformer =
            load_sd3_transformer_folder((dir / leading_folder(pc.pj.at("transformer").get<std::string>())).string());
        auto vae = load_vae_folder((dir / leading_folder(j.at("vae").value("config", std::string("vae/")))).string());
        const auto g = WeightMap::load((dir / "golden_pipeline.safetensors").string());
        const auto init = g.get("initial_latents");
        const int64_t patch = transformer->config().patch_size;
        const int batch = pc.pj.value("batch", int(init.size(0)));
        if (init.size(0) != batch)
            throw Error("initial_latents has batch " + std::to_string(init.size(0)) + ", the case says " +
                        std::to_string(batch));
        check_scheduler(pc, init, patch, sched.stats);
        SD3Conditioning cond{g.get("prompt_embeds"), g.get("pooled_prompt_embeds"),
                             g.has("negative_prompt_embeds") ? g.get("negative_prompt_embeds") : torch::Tensor(),
                             g.has("negative_pooled_prompt_embeds") ? g.get("negative_pooled_prompt_embeds")
                                                                    : torch::Tensor()};
        if (pc.guidance > 1.0 && !cond.negative_prompt_embeds.defined())
            throw Error("guidance_scale > 1 but the golden file has no negative_prompt_embeds");
        torch::NoGradGuard ng;
        // Teacher-forced: each step from the stored latents before it.
        auto s = make_flow_scheduler(pc, init, patch);
        if (s->num_loop_steps() != pc.steps) throw Error("scheduler loop steps != num_inference_steps");
        torch::Tensor prev = init;
        for (int i = 0; i < pc.steps; ++i) {
            const std::string si = std::to_string(i);
            if (!g.has("noise_pred." + si) || !g.has("latents." + si))
                throw Error("golden_pipeline lacks noise_pred." + si + " / latents." + si);
            const auto v = sd3_guided_velocity(*transformer, prev, s->timestep(i), cond, pc.guidance);
            tf.stats.check("noise_pred." + si, v, g.get("noise_pred." + si), kAtol, kRtol);
            tf.stats.check("latents." + si, s->step(g.get("noise_pred." + si), i, prev, nullptr),
                           g.get("latents." + si), kAtol, kRtol);
            prev = g.get("latents." + si);
        }
        if (g.has("image")) tf.stats.check("image", sd3_decode(*vae, prev), g.get("image"), kAtol, kRtol);
        // Free-running: the whole loop from the initial latents.
        auto s2 = make_flow_scheduler(pc, init, patch);
        const auto final_latents = sd3_denoise(*transformer, *s2, init, cond, pc.guidance);
        const auto gl = g.get("latents." + std::to_string(pc.steps - 1));
        fr.stats.check("final latents", final_latents, gl, kFreeLatents * gl.abs().max().item<double>(), 0.0);
        if (g.has("image")) fr.stats.check("image", sd3_decode(*vae, final_latents), g.get("image"), kFreeImage, 0.0);
    } catch (const std::exception& e) {
        for (auto* r : {&sched, &tf, &fr}) r->stats.fail(std::string("exception: ") + e.what());
    }
    return {sched, tf, fr};
}

const bool registered_sd3 =
    register_checker({"sd3", is_sd3_case, [](const fs::path& dir, const Context& ctx) {
                          const std::string base = relative_name(dir, ctx);
                          const auto j = case_json(dir);
                          std::vector<CaseResult> out;
                          // Keys of the case this checker does not read: a FAIL naming them (a newer generator's
                          // addition).
                          static const std::set<std::string> known = {
                              "diffusers", "variants", "init", "sdpa", "transformer_inputs", "vae", "pipeline"};
                          std::string unknown;
                          for (const auto& [k, v] : j.items())
                              if (!known.count(k)) unknown += (unknown.empty() ? "" : ", ") + k;
                          if (!unknown.empty()) {
                              CaseResult r;
                              r.name = base + ":case";
                              r.stats.fail("config.json keys not understood by this checker: " + unknown);
                              out.push_back(r);
                          }
                          if (j.contains("variants"))
                              for (const auto& [name, v] : j["variants"].items())
                                  out.push_back(guarded(base + ":transformer_" + name,
                                                        [&](Stats& st) { check_transformer(dir, name, v, st); }));
                          if (j.contains("vae"))
                              out.push_back(guarded(base + ":vae", [&](Stats& st) { check_vae(dir, j["vae"], st); }));
                          if (j.contains("pipeline"))
                              for (auto& r : check_pipeline(dir, j, base)) out.push_back(r);
                          return out;
                      }});

// An original SD 3 single file (model.diffusion_model.joint_blocks...) next to golden_transformer.safetensors: loads
// through load_sd3_models (family sd3, every tensor converted and used), then the golden forward.
std::string sd3_single_file(const fs::path& dir) {
    if (!has_file(dir, "golden_transformer.safetensors")) return "";
    for (const auto& e : fs::directory_iterator(dir)) {
        if (e.path().extension() != ".safetensors" || e.path().filename() == "golden_transformer.safetensors") continue;
        if (WeightMap::load(e.path().string()).has("model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight"))
            return e.path().string();
    }
    return "";
}

const bool registered_sd3_single =
    register_checker({"sd3-single-file", [](const fs::path& d) { return !sd3_single_file(d).empty(); },
                      [](const fs::path& dir, const Context& ctx) {
                          const std::string base = relative_name(dir, ctx);
                          SD3Models m;
                          std::vector<CaseResult> out;
                          out.push_back(guarded(base + ":load", [&](Stats& st) {
                              m = load_sd3_models(sd3_single_file(dir));
                              st.check_true("family sd3", m.family == SdFamily::SD3);
                          }));
                          if (m.transformer)
                              out.push_back(guarded(base + ":transformer", [&](Stats& st) {
                                  compare_transformer(*m.transformer, dir / "golden_transformer.safetensors", st);
                              }));
                          return out;
                      }});

// A StableDiffusion3Pipeline folder (model_index.json) with golden_sd3_text.safetensors + golden.json: the real
// __call__ from prompt strings without T5 (make_sd3_tiny_text.py).
bool is_sd3_text_case(const fs::path& dir) {
    if (!has_file(dir, "model_index.json") || !has_file(dir, "golden_sd3_text.safetensors")) return false;
    return nlohmann::json::parse(read_text(dir / "model_index.json")).value("_class_name", std::string()) ==
           "StableDiffusion3Pipeline";
}

std::vector<std::string> string_list(const nlohmann::json& j, const char* key, size_t n) {
    if (!j.contains(key) || j[key].is_null()) return {};
    if (j[key].is_string()) return std::vector<std::string>(n, j[key].get<std::string>());
    return j[key].get<std::vector<std::string>>();
}

// The recorded __call__ of golden.json + golden_sd3_text.safetensors on the loaded models `m`: ids, embeddings, every
// step teacher-forced, free-running.
void check_sd3_text_run(const fs::path& dir, const std::string& base, SD3Models& m, std::vector<CaseResult>& out) {
         const auto j = nlohmann::json::parse(read_text(dir / "golden.json"));
         const auto g = WeightMap::load((dir / "golden_sd3_text.safetensors").string());
         CaseResult keys;
         keys.name = base + ":case";
         check_unknown_keys(keys.stats, j,
                            {"prompts", "negative_prompt", "num_inference_steps", "guidance_scale", "height", "width",
                             "generator_seed", "initial_latents", "text_encoder_3", "max_sequence_length", "recorded",
                             "skip_guidance_layers", "skip_layer_guidance_scale", "skip_layer_guidance_start",
                             "skip_layer_guidance_stop", "single_file", "text_encoders", "verified"},
                            "golden.json");
         const bool with_t5 = j.contains("text_encoder_3") && !j["text_encoder_3"].is_null();
         const int max_seq = j.value("max_sequence_length", 256);
         keys.stats.check_true("text_encoder_3 loaded as the case says", bool(m.text_encoder_3) == with_t5,
                               with_t5 ? "the case has T5, the loader did not load it" : "the case has no T5");
         out.push_back(keys);
         const auto prompts = j.at("prompts").get<std::vector<std::string>>();
         const auto negative = string_list(j, "negative_prompt", prompts.size());
         const double guidance = j.at("guidance_scale").get<double>();
         const int steps = j.at("num_inference_steps").get<int>();
         SD3SkipLayerGuidance slg; // diffusers >= 0.32's skip_guidance_layers and its defaults
         if (j.contains("skip_guidance_layers") && !j["skip_guidance_layers"].is_null()) {
             slg.layers = j["skip_guidance_layers"].get<std::vector<int>>();
             slg.scale = j.value("skip_layer_guidance_scale", slg.scale);
             slg.start = j.value("skip_layer_guidance_start", slg.start);
             slg.stop = j.value("skip_layer_guidance_stop", slg.stop);
         }
         out.push_back(guarded(base + ":tokenizers", [&](Stats& st) {
             auto ids = [](const ClipTokenizer& t, const std::vector<std::string>& ps) {
                 std::vector<torch::Tensor> r;
                 for (const auto& p : ps) r.push_back(torch::tensor(t.tokenize(p, 77).ids, torch::kLong));
                 return torch::stack(r);
             };
             const auto neg = negative.empty() ? std::vector<std::string>(prompts.size(), "") : negative;
             st.check_equal("input_ids", ids(m.tokenizer, prompts), g.get("input_ids"));
             st.check_equal("input_ids_2", ids(m.tokenizer_2, prompts), g.get("input_ids_2"));
             if (g.has("negative_input_ids"))
                 st.check_equal("negative_input_ids", ids(m.tokenizer, neg), g.get("negative_input_ids"));
             if (g.has("negative_input_ids_2"))
                 st.check_equal("negative_input_ids_2", ids(m.tokenizer_2, neg), g.get("negative_input_ids_2"));
             if (m.text_encoder_3) {
                 auto ids3 = [&](const std::vector<std::string>& ps) {
                     std::vector<torch::Tensor> r;
                     for (const auto& p : ps) r.push_back(torch::tensor(m.tokenizer_3.tokenize(p, max_seq), torch::kLong));
                     return torch::stack(r);
                 };
                 st.check_equal("input_ids_3", ids3(prompts), g.get("input_ids_3"));
                 if (g.has("negative_input_ids_3"))
                     st.check_equal("negative_input_ids_3", ids3(neg), g.get("negative_input_ids_3"));
             }
         }));
         SD3Conditioning cond;
         out.push_back(guarded(base + ":text-encoders", [&](Stats& st) {
             cond = sd3_encode_prompts(m, prompts, negative, guidance, max_seq);
             st.check("prompt_embeds", cond.prompt_embeds, g.get("prompt_embeds"), kAtol, kRtol);
             st.check("pooled_prompt_embeds", cond.pooled, g.get("pooled_prompt_embeds"), kAtol, kRtol);
             if (guidance > 1.0) {
                 st.check("negative_prompt_embeds", cond.negative_prompt_embeds, g.get("negative_prompt_embeds"), kAtol,
                          kRtol);
                 st.check("negative_pooled_prompt_embeds", cond.negative_pooled, g.get("negative_pooled_prompt_embeds"),
                          kAtol, kRtol);
             }
         }));
         auto scheduler = [&](const torch::Tensor& latents) {
             // A single file brings no scheduler config: SD 3's own, as sd3_make_scheduler uses it.
             const std::string text =
                 m.scheduler_config.empty()
                     ? std::string(R"({"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000,)"
                                   R"( "shift": 3.0})")
                     : read_file(m.scheduler_config, "scheduler config");
             const auto bad = unsupported_scheduler_settings(text, SamplerKind::FlowMatchEuler);
             if (!bad.empty()) throw Error("scheduler_config.json: " + bad.front());
             PipelineCase pc;
             pc.scfg = SchedulerConfig::from_json_text(text, m.scheduler_config.empty() ? "SD 3 default"
                                                                                        : m.scheduler_config);
             pc.steps = steps;
             return make_flow_scheduler(pc, latents, m.transformer->config().patch_size);
         };
         const auto init = g.get("initial_latents");
         const int64_t h = j.value("height", int64_t(init.size(2) * m.vae_scale_factor()));
         CaseResult tf;
         tf.name = base + ":pipeline:teacher-forced";
         try {
             if (init.size(2) * m.vae_scale_factor() != h)
                 throw Error("initial_latents size does not match height " + std::to_string(h));
             SD3Conditioning gc{g.get("prompt_embeds"), g.get("pooled_prompt_embeds"),
                                guidance > 1 ? g.get("negative_prompt_embeds") : torch::Tensor(),
                                guidance > 1 ? g.get("negative_pooled_prompt_embeds") : torch::Tensor()};
             auto s = scheduler(init);
             torch::NoGradGuard ng;
             torch::Tensor prev = init;
             for (int i = 0; i < steps; ++i) {
                 const std::string n = "latents." + std::to_string(i);
                 const auto v = sd3_guided_velocity(*m.transformer, prev, s->timestep(i), gc, guidance, slg, i, steps);
                 tf.stats.check(n, s->step(v, i, prev, nullptr), g.get(n), kAtol, kRtol);
                 prev = g.get(n);
             }
             tf.stats.check("image", sd3_decode(*m.vae, prev), g.get("image"), kAtol, kRtol);
         } catch (const std::exception& e) {
             tf.stats.fail(std::string("exception: ") + e.what());
         }
         out.push_back(tf);
         out.push_back(guarded(base + ":pipeline:free-running", [&](Stats& st) {
             if (!cond.prompt_embeds.defined()) throw Error("no text conditioning (see the text-encoders line)");
             auto s = scheduler(init);
             torch::NoGradGuard ng;
             const auto final_latents = sd3_denoise(*m.transformer, *s, init, cond, guidance, {}, slg);
             const auto gl = g.get("latents." + std::to_string(steps - 1));
             st.check("final latents", final_latents, gl, kFreeLatents * gl.abs().max().item<double>(), 0.0);
             st.check("image", sd3_decode(*m.vae, final_latents), g.get("image"), kFreeImage, 0.0);
         }));
}

const bool registered_sd3_text = register_checker(
    {"sd3-text", is_sd3_text_case, [](const fs::path& dir, const Context& ctx) {
         const std::string base = relative_name(dir, ctx);
         std::vector<CaseResult> out;
         SD3Models m;
         out.push_back(guarded(base + ":load", [&](Stats& st) {
             m = load_sd3_models(dir.string());
             st.check_true("family sd3", m.family == SdFamily::SD3);
             st.check_true("text encoders", m.text_encoder && m.text_encoder_2);
             st.check_true("tokenizer_2 pads with '!' (0)", m.tokenizer_2.pad_id() == 0);
         }));
         if (m.transformer && m.text_encoder && m.vae) check_sd3_text_run(dir, base, m, out);
         return out;
     }});

// An original SD 3 single file WITH its text encoders (golden.json's "single_file"; "text_encoders": the folder
// --text-encoders names, for the tokenizers a file cannot hold) and the recorded run of the same models as a folder
// (tests/golden/sd/sd3_tiny_single_file_te/generate): everything loads from the file through load_sd3_models, then
// the sd3-text checks.
bool is_sd3_single_file_te_case(const fs::path& dir) {
    if (has_file(dir, "model_index.json") || !has_file(dir, "golden_sd3_text.safetensors") ||
        !has_file(dir, "golden.json"))
        return false;
    return nlohmann::json::parse(read_text(dir / "golden.json")).contains("single_file");
}

const bool registered_sd3_single_te = register_checker(
    {"sd3-single-file-te", is_sd3_single_file_te_case, [](const fs::path& dir, const Context& ctx) {
         const std::string base = relative_name(dir, ctx);
         std::vector<CaseResult> out;
         SD3Models m;
         out.push_back(guarded(base + ":load", [&](Stats& st) {
             const auto j = nlohmann::json::parse(read_text(dir / "golden.json"));
             const std::string te = j.value("text_encoders", std::string());
             m = load_sd3_models((dir / j.at("single_file").get<std::string>()).string(), torch::kFloat, true,
                                 te.empty() ? std::string() : (dir / te).string());
             st.check_true("family sd3", m.family == SdFamily::SD3);
             st.check_true("CLIP encoders from the file", m.text_encoder && m.text_encoder_2);
             st.check_true("VAE from the file", bool(m.vae));
             st.check_true("tokenizer_2 pads with '!' (0)", m.tokenizer_2.pad_id() == 0);
         }));
         if (m.transformer && m.text_encoder && m.vae) check_sd3_text_run(dir, base, m, out);
         return out;
     }});

// A T5EncoderModel folder with its tokenizer (spiece.model) and golden_t5.safetensors + golden_t5.json
// (tests/golden/sd/sd3_tiny_t5/generate/make_sd3_tiny_t5.py): the ids of each prompt at each max_length, and the
// encoder's embeddings, every block's output and last_hidden_state on the first rows of the first length's ids.
bool is_t5_case(const fs::path& dir) {
    return has_file(dir, "golden_t5.safetensors") && has_file(dir, "golden_t5.json") &&
           config_class(dir) == "T5EncoderModel";
}

const bool registered_t5 = register_checker(
    {"t5-encoder", is_t5_case, [](const fs::path& dir, const Context& ctx) {
         const std::string base = relative_name(dir, ctx);
         const auto j = nlohmann::json::parse(read_text(dir / "golden_t5.json"));
         const auto g = WeightMap::load((dir / "golden_t5.safetensors").string());
         std::vector<CaseResult> out;
         CaseResult keys;
         keys.name = base + ":case";
         check_unknown_keys(keys.stats, j,
                            {"prompts", "max_lengths", "features_of", "fuzz_prompts", "fuzz_max_length", "tokenizer",
                             "recorded"},
                            "golden_t5.json");
         out.push_back(keys);
         const auto prompts = j.at("prompts").get<std::vector<std::string>>();
         const auto lengths = j.at("max_lengths").get<std::vector<int>>();
         out.push_back(guarded(base + ":tokenizer", [&](Stats& st) {
             const auto tok = T5Tokenizer::from_folder(dir.string());
             for (int len : lengths) {
                 std::vector<torch::Tensor> r;
                 for (const auto& p : prompts) r.push_back(torch::tensor(tok.tokenize(p, len), torch::kLong));
                 st.check_equal("input_ids." + std::to_string(len), torch::stack(r),
                                g.get("input_ids." + std::to_string(len)));
             }
             if (j.contains("fuzz_prompts")) {
                 const int len = j.at("fuzz_max_length").get<int>();
                 const auto got = g.get("fuzz_input_ids");
                 const auto fuzz = j.at("fuzz_prompts").get<std::vector<std::string>>();
                 int64_t wrong = 0;
                 std::string first;
                 for (size_t i = 0; i < fuzz.size(); ++i) {
                     const auto ids = torch::tensor(tok.tokenize(fuzz[i], len), torch::kLong);
                     if (i < size_t(got.size(0)) && torch::equal(ids, got[int64_t(i)])) continue;
                     if (wrong++ == 0) first = "fuzz prompt " + std::to_string(i);
                 }
                 st.check_true("fuzz_input_ids (" + std::to_string(fuzz.size()) + " prompts)", wrong == 0,
                               std::to_string(wrong) + " differ, the first: " + first);
                 st.check_true("fuzz rows", int64_t(fuzz.size()) == got.size(0));
             }
         }));
         out.push_back(guarded(base + ":encoder", [&](Stats& st) {
             auto model = load_t5_encoder_folder(dir.string());
             // "input_ids.<len>[:rows]": the ids the features were computed on.
             const std::string of = j.at("features_of").get<std::string>();
             const auto br = of.find("[:");
             auto ids = g.get(of.substr(0, br));
             if (br != std::string::npos) ids = ids.narrow(0, 0, std::stoll(of.substr(br + 2)));
             std::vector<torch::Tensor> blocks;
             torch::NoGradGuard ng;
             const auto last = model->forward(ids, &blocks);
             // Bit for bit on the reference's LibTorch (1.x). On LibTorch 2 the GEMMs round differently and T5's
             // residual stream (no scaling of q k^T, no normalisation of the sum) carries that into every block at
             // ~3e-5 of the tensor's largest value: there the bound is 1e-4 of it.
             const auto check_t5 = [&st](const std::string& n, const torch::Tensor& a, const torch::Tensor& want) {
#if TORCH_VERSION_MAJOR >= 2
                 st.check(n, a, want, 1e-4 * want.abs().max().item<double>(), 0.0);
#else
                 st.check(n, a, want, kAtol, kRtol);
#endif
             };
             check_t5("embeddings", blocks.front(), g.get("embeddings"));
             for (size_t i = 1; i < blocks.size(); ++i) {
                 const std::string n = "block." + std::to_string(i - 1);
                 if (g.has(n)) check_t5(n, blocks[i], g.get(n));
             }
             check_t5("last_hidden_state", last, g.get("last_hidden_state"));
         }));
         return out;
     }});

// A model folder of an SD3 case: it must load, every tensor used.
const bool registered_sd3_component =
    register_checker({"sd3-component",
                      [](const fs::path& d) {
                          const std::string cls = config_class(d);
                          return (cls == kTransformerClass || cls == "AutoencoderKL") && has_file(d, "config.json") &&
                                 !has_file(d, "golden_outputs.safetensors") && is_sd3_case(d.parent_path());
                      },
                      [](const fs::path& dir, const Context& ctx) {
                          return std::vector<CaseResult>{guarded(relative_name(dir, ctx) + ":loads", [&](Stats&) {
                              if (config_class(dir) == kTransformerClass)
                                  (void)load_sd3_transformer_folder(dir.string());
                              else
                                  (void)load_vae_folder(dir.string());
                          })};
                      }});

// A StableDiffusion3Img2ImgPipeline folder with golden_sd3_img2img.safetensors + golden.json
// (tests/golden/sd/sd3_tiny_img2img/generate/make_sd3_tiny_img2img.py): the strength rule, the init image's VAE
// posterior draw, the noise and scale_noise, every loop step teacher-forced, the free-running run.
bool is_sd3_img2img_case(const fs::path& dir) {
    if (!has_file(dir, "model_index.json") || !has_file(dir, "golden_sd3_img2img.safetensors")) return false;
    return nlohmann::json::parse(read_text(dir / "model_index.json")).value("_class_name", std::string()) ==
           "StableDiffusion3Img2ImgPipeline";
}

const bool registered_sd3_img2img = register_checker(
    {"sd3-img2img", is_sd3_img2img_case, [](const fs::path& dir, const Context& ctx) {
         const std::string base = relative_name(dir, ctx);
         std::vector<CaseResult> out;
         SD3Models m;
         out.push_back(guarded(base + ":load", [&](Stats& st) {
             m = load_sd3_models(dir.string());
             st.check_true("text encoders and VAE", m.text_encoder && m.text_encoder_2 && m.vae);
         }));
         if (!m.transformer || !m.text_encoder || !m.vae) return out;
         const auto j = nlohmann::json::parse(read_text(dir / "golden.json"));
         const auto g = WeightMap::load((dir / "golden_sd3_img2img.safetensors").string());
         CaseResult keys;
         keys.name = base + ":case";
         check_unknown_keys(keys.stats, j,
                            {"prompts", "negative_prompt", "num_inference_steps", "guidance_scale", "strength",
                             "generator_seed", "init_image", "loop_steps", "text_encoder_3", "max_sequence_length",
                             "recorded"},
                            "golden.json");
         keys.stats.check_true("no T5 in the case", !j.contains("text_encoder_3") || j["text_encoder_3"].is_null());
         out.push_back(keys);
         const auto prompts = j.at("prompts").get<std::vector<std::string>>();
         const auto negative = string_list(j, "negative_prompt", prompts.size());
         const double guidance = j.at("guidance_scale").get<double>(), strength = j.at("strength").get<double>();
         const int steps = j.at("num_inference_steps").get<int>(), max_seq = j.value("max_sequence_length", 256);
         const int64_t seed = j.at("generator_seed").get<int64_t>();
         const auto pixels = g.get("init_pixels");
         const int f = m.vae_scale_factor(), W = int(pixels.size(1)) - int(pixels.size(1)) % f,
                   H = int(pixels.size(0)) - int(pixels.size(0)) % f;
         int begin = 0;
         out.push_back(guarded(base + ":strength", [&](Stats& st) {
             st.check_equal("init.png", read_image_rgb((dir / j.at("init_image").get<std::string>()).string()), pixels);
             begin = sd3_img2img_start(steps, strength);
             st.check_true("loop steps", steps - begin == j.at("loop_steps").get<int>(),
                           std::to_string(steps - begin) + " loop steps, the case ran " + j.at("loop_steps").dump());
             const auto s = sd3_make_scheduler(m, steps, H / f, W / f);
             st.check("timesteps", torch::tensor(s->timesteps(), torch::kDouble).to(torch::kFloat),
                      g.get("timesteps").to(torch::kFloat), 1e-3, 0.0);
         }));
         out.push_back(guarded(base + ":prepare-latents", [&](Stats& st) {
             auto s = sd3_make_scheduler(m, steps, H / f, W / f);
             s->set_begin_index(begin);
             torch::Generator gen = at::detail::createCPUGenerator(uint64_t(seed));
             torch::Tensor il, noise;
             const auto noised = sd3_img2img_latents(*m.vae, preprocess_image(pixels, W, H), int64_t(prompts.size()),
                                                     *s, begin, gen, &il, &noise);
             st.check("image_latents", il, g.get("image_latents"), kAtol, kRtol);
             st.check_equal("noise", noise, g.get("noise"));
             st.check("noised_latents", noised, g.get("noised_latents"), kAtol, kRtol);
         }));
         CaseResult tf;
         tf.name = base + ":pipeline:teacher-forced";
         try {
             const auto cond = sd3_encode_prompts(m, prompts, negative, guidance, max_seq);
             auto s = sd3_make_scheduler(m, steps, H / f, W / f);
             s->set_begin_index(begin);
             torch::NoGradGuard ng;
             torch::Tensor prev = g.get("noised_latents");
             for (int k = 0; k < steps - begin; ++k) {
                 const int i = begin + k;
                 const std::string n = "latents." + std::to_string(k);
                 const auto v = sd3_guided_velocity(*m.transformer, prev, s->timestep(i), cond, guidance, {}, i, steps);
                 tf.stats.check(n, s->step(v, i, prev, nullptr), g.get(n), kAtol, kRtol);
                 prev = g.get(n);
             }
             tf.stats.check("image", sd3_decode(*m.vae, prev), g.get("image"), kAtol, kRtol);
         } catch (const std::exception& e) {
             tf.stats.fail(std::string("exception: ") + e.what());
         }
         out.push_back(tf);
         out.push_back(guarded(base + ":pipeline:free-running", [&](Stats& st) {
             SD3Txt2ImgParams p;
             p.prompts = prompts;
             p.negative_prompts = negative;
             p.steps = steps;
             p.guidance_scale = guidance;
             p.seed = seed;
             p.max_sequence_length = max_seq;
             p.init.init_pixels = pixels;
             p.init.strength = strength;
             const auto r = sd3_txt2img(m, p);
             st.check("image", r.image, g.get("image"), kFreeImage, 0.0);
         }));
         return out;
     }});

} // namespace
} // namespace anchor::golden::sd3
