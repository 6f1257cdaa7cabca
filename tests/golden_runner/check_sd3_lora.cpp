// Golden checker for SD 3 / 3.5 LoRA cases (tests/golden/sd/sd3_lora_tiny, generate/make_sd3_lora_tiny.py): a folder
// with golden.json + golden_sd3_lora.safetensors. golden.json names the base pipeline folder ("models"), the LoRA
// files ("loras": file, format), the transformer's inputs and, per output, the LoRA, its multiplier and the
// tolerance the generator measured; "pipeline" a StableDiffusion3Pipeline run with one LoRA merged (prompts, steps,
// guidance, size, seed, tolerances). Lines: the case keys; per output the transformer with that LoRA merged (and that
// the LoRA moves the output by more than the tolerance); the pipeline's text encoders, every step teacher-forced, and
// the free-running run. A key this checker does not understand is a FAIL naming it.
#include "cache/io/error.h"
#include "cache/io/weight_map.h"
#include "tests/golden_runner/runner.h"
#include "unet/model/lora_sd3.h"
#include "unet/pipeline/sd3_pipeline.h"

#include <nlohmann/json.hpp>

#include <set>

namespace anchor::golden::sd3_lora { // a namespace of its own: the runner's sources build as one unity file
namespace {

using namespace anchor::unet;
using nlohmann::json;

void sd3_lora_known_keys(Stats& st, const json& j, const std::set<std::string>& known, const std::string& where) {
    for (const auto& [k, v] : j.items())
        if (!known.count(k)) st.fail(where + ": key '" + k + "' is not understood by this checker");
}

bool is_sd3_lora_case(const fs::path& dir) {
    return has_file(dir, "golden.json") && has_file(dir, "golden_sd3_lora.safetensors");
}

struct Sd3LoraCase {
    fs::path dir, models;
    json j;
    WeightMap g;
};

// The base models with one LoRA of the case merged at `multiplier`.
SD3Models sd3_lora_models(const Sd3LoraCase& c, const std::string& lora, double multiplier) {
    const auto& l = c.j.at("loras").at(lora);
    SD3Models m = load_sd3_models(c.models.string());
    const auto applied = apply_sd3_loras(m, {{(c.dir / l.at("file").get<std::string>()).string(), multiplier}});
    if (applied.size() != 1 || applied[0].modules == 0) throw Error("LoRA '" + lora + "' merged nothing");
    if (applied[0].format != l.at("format").get<std::string>())
        throw Error("LoRA '" + lora + "' read as format '" + applied[0].format + "', the case says '" +
                    l.at("format").get<std::string>() + "'");
    return m;
}

CaseResult check_sd3_lora_output(const Sd3LoraCase& c, const json& o, const std::string& base) {
    const std::string tensor = o.at("tensor").get<std::string>();
    return guarded(base + ":transformer:" + tensor, [&](Stats& st) {
        sd3_lora_known_keys(st, o, {"tensor", "lora", "multiplier", "f32_vs_f64_max_abs", "atol", "rtol",
                                    "vs_base_max_abs"},
                            "golden.json transformer.outputs");
        const auto& t = c.j.at("transformer");
        const auto names = t.at("inputs").get<std::vector<std::string>>();
        if (names.size() != 4)
            throw Error("transformer.inputs: expected hidden_states, encoder_hidden_states, pooled_projections, "
                        "timestep");
        SD3Models m = sd3_lora_models(c, o.at("lora").get<std::string>(), o.at("multiplier").get<double>());
        torch::NoGradGuard ng;
        const auto out = m.transformer->forward(c.g.get(names[0]), c.g.get(names[1]), c.g.get(names[2]),
                                                c.g.get(names[3]));
        const double atol = o.at("atol").get<double>(), rtol = o.at("rtol").get<double>();
        st.check(tensor, out, c.g.get(tensor), atol, rtol);
        // The LoRA must matter at this tolerance: the output without it is far outside.
        const auto base_out = c.g.get(t.at("base").get<std::string>());
        const double moved = (c.g.get(tensor) - base_out).abs().max().item<double>();
        st.check_true("the LoRA moves the output beyond the tolerance", moved > 100 * atol,
                      "max |with - without| = " + std::to_string(moved));
    });
}

std::vector<CaseResult> check_sd3_lora_pipeline(const Sd3LoraCase& c, const std::string& base) {
    std::vector<CaseResult> out;
    const json& p = c.j.at("pipeline");
    CaseResult keys;
    keys.name = base + ":pipeline:case";
    sd3_lora_known_keys(keys.stats, p,
                        {"prompts", "negative_prompt", "num_inference_steps", "guidance_scale", "height", "width",
                         "generator_seed", "max_sequence_length", "multiplier", "lora", "f32_vs_f64", "atol", "rtol",
                         "free_running_latents_rel", "free_running_image_atol", "recorded"},
                        "golden.json pipeline");
    out.push_back(keys);
    SD3Models m;
    out.push_back(guarded(base + ":pipeline:load", [&](Stats& st) {
        m = sd3_lora_models(c, p.at("lora").get<std::string>(), p.at("multiplier").get<double>());
        st.check_true("text encoders", m.text_encoder && m.text_encoder_2 && m.vae);
        st.check_true("no T5 (the case's pipeline has none)", !m.text_encoder_3);
    }));
    if (!m.transformer || !m.text_encoder || !m.vae) return out;
    const auto prompts = p.at("prompts").get<std::vector<std::string>>();
    const std::vector<std::string> negative(prompts.size(), p.at("negative_prompt").get<std::string>());
    const double guidance = p.at("guidance_scale").get<double>(), atol = p.at("atol").get<double>(),
                 rtol = p.at("rtol").get<double>();
    const int steps = p.at("num_inference_steps").get<int>();
    auto g = [&](const std::string& n) { return c.g.get("pipeline." + n); };
    SD3Conditioning cond;
    out.push_back(guarded(base + ":pipeline:text-encoders", [&](Stats& st) {
        cond = sd3_encode_prompts(m, prompts, negative, guidance, p.at("max_sequence_length").get<int>());
        st.check("prompt_embeds", cond.prompt_embeds, g("prompt_embeds"), atol, rtol);
        st.check("pooled_prompt_embeds", cond.pooled, g("pooled_prompt_embeds"), atol, rtol);
        st.check("negative_prompt_embeds", cond.negative_prompt_embeds, g("negative_prompt_embeds"), atol, rtol);
        st.check("negative_pooled_prompt_embeds", cond.negative_pooled, g("negative_pooled_prompt_embeds"), atol,
                 rtol);
    }));
    const auto init = g("initial_latents");
    out.push_back(guarded(base + ":pipeline:teacher-forced", [&](Stats& st) {
        if (init.size(2) * m.vae_scale_factor() != p.at("height").get<int64_t>() ||
            init.size(3) * m.vae_scale_factor() != p.at("width").get<int64_t>())
            throw Error("initial_latents do not match height / width");
        const SD3Conditioning gc{g("prompt_embeds"), g("pooled_prompt_embeds"), g("negative_prompt_embeds"),
                                 g("negative_pooled_prompt_embeds")};
        auto s = sd3_make_scheduler(m, steps, init.size(2), init.size(3));
        torch::NoGradGuard ng;
        torch::Tensor prev = init;
        for (int i = 0; i < steps; ++i) {
            const std::string n = "latents." + std::to_string(i);
            const auto v = sd3_guided_velocity(*m.transformer, prev, s->timestep(i), gc, guidance);
            st.check(n, s->step(v, i, prev, nullptr), g(n), atol, rtol);
            prev = g(n);
        }
        st.check("image", sd3_decode(*m.vae, prev), g("image"), atol, rtol);
    }));
    out.push_back(guarded(base + ":pipeline:free-running", [&](Stats& st) {
        if (!cond.prompt_embeds.defined()) throw Error("no text conditioning (see the text-encoders line)");
        auto s = sd3_make_scheduler(m, steps, init.size(2), init.size(3));
        torch::NoGradGuard ng;
        const auto final_latents = sd3_denoise(*m.transformer, *s, init, cond, guidance);
        const auto gl = g("latents." + std::to_string(steps - 1));
        st.check("final latents", final_latents, gl,
                 p.at("free_running_latents_rel").get<double>() * gl.abs().max().item<double>(), 0.0);
        st.check("image", sd3_decode(*m.vae, final_latents), g("image"),
                 p.at("free_running_image_atol").get<double>(), 0.0);
    }));
    return out;
}

const bool registered_sd3_lora = register_checker(
    {"sd3-lora", is_sd3_lora_case, [](const fs::path& dir, const Context& ctx) {
         const std::string base = relative_name(dir, ctx);
         std::vector<CaseResult> out;
         Sd3LoraCase c;
         out.push_back(guarded(base + ":case", [&](Stats& st) {
             c.dir = dir;
             c.j = json::parse(read_text(dir / "golden.json"));
             sd3_lora_known_keys(st, c.j, {"models", "generator", "loras", "transformer", "pipeline"}, "golden.json");
             sd3_lora_known_keys(st, c.j.at("transformer"), {"inputs", "base", "outputs"}, "golden.json transformer");
             for (const auto& [name, l] : c.j.at("loras").items())
                 sd3_lora_known_keys(st, l, {"file", "format", "scale"}, "golden.json loras." + name);
             c.models = dir / c.j.at("models").get<std::string>();
             c.g = WeightMap::load((dir / "golden_sd3_lora.safetensors").string());
         }));
         if (!out.back().stats.pass) return out;
         for (const auto& o : c.j.at("transformer").at("outputs")) out.push_back(check_sd3_lora_output(c, o, base));
         if (c.j.contains("pipeline")) {
             auto p = check_sd3_lora_pipeline(c, base);
             out.insert(out.end(), p.begin(), p.end());
         }
         return out;
     }});

} // namespace
} // namespace anchor::golden::sd3_lora
