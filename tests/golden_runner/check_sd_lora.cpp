// Golden checker for LoRA cases (tests/golden/sd/lora_sd15_tiny, lora_sdxl_tiny): a folder with targets.json,
// merge_deltas.safetensors and a golden.json naming a "pair" of LoRAs. Every LoRA of targets.json is matched to the
// base model's weights and its (alpha/rank) * (up @ down) compared with merge_deltas; the model with each LoRA merged
// alone at golden.json's "single_multiplier" is run on the stored inputs; the txt2img run with the pair merged goes
// through the txt2img comparisons of tests/sd_pipeline_golden.h. File names, multipliers, inputs, prompts and seeds
// all come from the case files; a key this checker does not know is a FAIL naming it.
#include "cache/io/error.h"
#include "cache/io/weight_map.h"
#include "tests/golden_runner/sd_comparisons.h"
#include "tests/sd_lora_golden.h"
#include "tests/sdxl_golden.h"
#include "unet/model/checkpoint.h"
#include "unet/model/lora.h"

#include <nlohmann/json.hpp>

#include <set>

namespace anchor::golden {
namespace {

using namespace anchor::unet;
using nlohmann::json;

// The golden README's suggestions: merged deltas atol 1e-6 (rtol 1e-5), model outputs atol 1e-4 rtol 1e-4.
constexpr double kDeltaAtol = 1e-6, kDeltaRtol = 1e-5, kOutAtol = 1e-4, kOutRtol = 1e-4;

void require_known_keys(const json& j, const std::set<std::string>& known, const std::string& where) {
    for (const auto& [k, v] : j.items())
        if (!known.count(k)) throw Error(where + ": key '" + k + "' is not understood by this checker");
}

// "PATH: name, name (call a)" (golden.json "inputs") -> the file next to the case and the tensor names.
std::pair<fs::path, std::vector<std::string>> input_spec(const fs::path& dir, const json& s, const std::string& what) {
    if (!s.is_string()) throw Error("golden.json: inputs." + what + " must be a string 'FILE: tensor, ...'");
    std::string text = s.get<std::string>();
    const auto colon = text.find(": ");
    if (colon == std::string::npos) throw Error("golden.json: inputs." + what + " '" + text + "' has no 'FILE: '");
    std::string names = text.substr(colon + 2);
    if (const auto paren = names.find(" ("); paren != std::string::npos) names = names.substr(0, paren);
    std::vector<std::string> out;
    for (size_t from = 0; from <= names.size();) {
        auto comma = names.find(',', from);
        if (comma == std::string::npos) comma = names.size();
        std::string n = names.substr(from, comma - from);
        while (!n.empty() && n.front() == ' ') n.erase(0, 1);
        while (!n.empty() && n.back() == ' ') n.pop_back();
        if (!n.empty()) out.push_back(n);
        from = comma + 1;
    }
    return {dir / text.substr(0, colon), out};
}

struct Case {
    fs::path dir;
    json golden, targets;
    bool sdxl = false;
    fs::path sdxl_root; // SDXL: the base pipeline folder
};

Case read_case(const fs::path& dir) {
    Case c{dir, sdgolden::read_json_file(dir / "golden.json"), sdgolden::read_json_file(dir / "targets.json")};
    require_known_keys(c.golden,
                       {"set", "lora_seeds", "single_multiplier", "pair", "models", "inputs", "pipeline", "checks",
                        "discrimination_rel_to_max"},
                       "golden.json");
    const auto& models = c.golden.at("models");
    if (models.is_string()) { // "../sdxl_tiny (unet, text_encoder, text_encoder_2, vae, scheduler)"
        const std::string s = models.get<std::string>();
        c.sdxl_root = dir / s.substr(0, s.find(' '));
        c.sdxl = true;
    } else {
        require_known_keys(models, {"unet", "text_encoder", "vae"}, "golden.json models");
    }
    return c;
}

// The base models of an SD 1.x case (golden.json "models", relative to the case folder).
SDModels load_base(const Case& c) {
    const auto& mods = c.golden.at("models");
    SDModels m;
    m.layout = "diffusers-components";
    m.unet = load_unet_folder((c.dir / mods.at("unet").get<std::string>()).string());
    m.vae = load_vae_folder((c.dir / mods.at("vae").get<std::string>()).string());
    m.text_encoder = load_text_encoder_folder((c.dir / mods.at("text_encoder").get<std::string>()).string());
    const fs::path vocab = c.dir.parent_path() / "vocab" / "bpe_simple_vocab_16e6.txt.gz";
    m.tokenizer = fs::exists(vocab) ? ClipTokenizer::from_bpe_file(vocab.string()) : ClipTokenizer::bundled();
    m.family = SdFamily::SD1;
    return m;
}

fs::path lora_file(const Case& c, const std::string& name) {
    return sdgolden::lora_case_file(c.dir, c.targets, name);
}

// SDXL: each LoRA alone at single_multiplier, merged into the base pipeline (sdxl_tiny): both text encoders on the
// stored ids (penultimate hidden states, te2's pooled text_embeds, prompt_embeds = their concatenation) and the UNet
// call a of the base folder's inputs with its added conditioning.
void check_sdxl_outputs(const Case& c, const std::string& name, Stats& st) {
    const double mult = c.golden.at("single_multiplier").get<double>();
    const auto& inputs = c.golden.at("inputs");
    require_known_keys(inputs, {"unet", "text_encoders"}, "golden.json inputs");
    const auto [tfile, tnames] = input_spec(c.dir, inputs.at("text_encoders"), "text_encoders");
    const auto [ufile, unames] = input_spec(c.dir, inputs.at("unet"), "unet");
    if (tnames.size() != 2) throw Error("golden.json inputs.text_encoders: expected te1 and te2 input ids");
    if (unames.size() != 5)
        throw Error(
            "golden.json inputs.unet: expected sample, timesteps, encoder_hidden_states, text_embeds, time_ids");
    LoadOptions o;
    o.loras = {{lora_file(c, name).string(), mult}};
    SDModels m = load_sd_models(c.sdxl_root.string(), o);
    auto tin = WeightMap::load(tfile.string()), uin = WeightMap::load(ufile.string());
    auto out = WeightMap::load((c.dir / "golden_outputs.safetensors").string());
    c10::InferenceMode guard;
    const auto c1 = m.text_encoder->encode_penultimate(tin.get(tnames[0]));
    const auto c2 = m.text_encoder_2->encode_penultimate(tin.get(tnames[1]));
    const UNetCond cond{uin.get(unames[2]), uin.get(unames[3]), uin.get(unames[4])};
    const std::map<std::string, torch::Tensor> ours = {
        {"text_encoder.penultimate_hidden_state", c1.hidden},
        {"text_encoder_2.penultimate_hidden_state", c2.hidden},
        {"text_encoder_2.text_embeds", c2.pooled},
        {"prompt_embeds", torch::cat({c1.hidden, c2.hidden}, -1)},
        {"unet.out", m.unet->forward(uin.get(unames[0]), uin.get(unames[1]), cond)}};
    for (const auto& key : out.names()) {
        if (key.rfind(name + ".", 0) != 0) continue;
        const std::string what = key.substr(name.size() + 1);
        if (ours.count(what))
            st.check(key, ours.at(what), out.get(key), kOutAtol, kOutRtol);
        else
            st.fail("golden output '" + key + "' is not understood by this checker");
    }
}

// SDXL: the txt2img run with golden.json's pair merged, golden.json "pipeline" "settings" + its run keys, the base
// folder's scheduler.
std::vector<CaseResult> check_sdxl_pair_run(const Case& c, const std::string& rel) {
    const auto& pl = c.golden.at("pipeline");
    const std::string run = pl.at("run").get<std::string>();
    return run_results(rel + ":" + run, [&] {
        require_known_keys(pl,
                           {"run", "settings", "negative_prompt", "timesteps", "png", "same_settings_as",
                            "max_abs_diff_final_latents_vs_no_lora_rel", "initial_noise_equals_sdxl_tiny"},
                           "golden.json pipeline");
        nlohmann::json pipeline = pl.at("settings");
        pipeline["runs"][run] = {{"negative_prompt", pl.value("negative_prompt", nlohmann::json())}};
        if (pl.contains("timesteps")) pipeline["runs"][run]["timesteps"] = pl["timesteps"];
        LoadOptions o;
        o.loras = sdgolden::lora_pair(c.dir, c.golden, c.targets);
        SDModels m = load_sd_models(c.sdxl_root.string(), o);
        return sdgolden::compare_sdxl_run(m, pipeline, run, c.dir / (run + ".safetensors"));
    });
}

// The file's modules against merge_deltas (multiplier 1) and targets.json (names, ranks, alphas).
void check_merge(const Case& c, const std::string& name, const LoraTargets& targets, Stats& st) {
    const auto& spec = c.targets.at(name);
    require_known_keys(spec, {"format", "file", "dtype", "has_alpha_keys", "targets"}, "targets.json " + name);
    const LoraFile f = read_lora(lora_file(c, name).string(), targets);
    st.check_true("format", f.format == spec.at("format").get<std::string>(),
                  "read as '" + f.format + "', targets.json says '" + spec.at("format").get<std::string>() + "'");
    auto deltas = WeightMap::load((c.dir / "merge_deltas.safetensors").string());
    std::set<std::string> produced;
    std::map<std::string, const LoraModule*> by_key;
    for (const auto& m : f.modules) {
        const std::string full = enum_name(lora_component_table(), m.component) + "." + m.weight;
        const std::string key = name + "." + full;
        produced.insert(full);
        by_key[m.key] = &m;
        if (!deltas.has(key)) {
            st.fail("merge_deltas has no '" + key + "'");
            continue;
        }
        const auto g = deltas.get(key);
        st.check(key, lora_delta(m, g.sizes().vec()), g, kDeltaAtol, kDeltaRtol);
    }
    for (const auto& k : deltas.names())
        if (k.rfind(name + ".", 0) == 0 && !produced.count(k.substr(name.size() + 1)))
            st.fail("merge_deltas '" + k + "' is not a module the file was matched to");
    const auto& tlist = spec.at("targets");
    st.check_true("number of modules", tlist.size() == f.modules.size(),
                  std::to_string(f.modules.size()) + " matched, targets.json lists " + std::to_string(tlist.size()));
    const bool alphas = spec.at("has_alpha_keys").get<bool>();
    for (const auto& t : tlist) {
        require_known_keys(t,
                           {"component", "module", "weight", "diffusers_weight_name", "kind", "down_key", "up_key",
                            "alpha_key", "rank", "alpha", "scale", "down_shape", "up_shape", "weight_shape",
                            "diffusers_kohya_converter_key"},
                           "targets.json " + name + " target");
        const std::string down = t.at("down_key").get<std::string>();
        const std::string stem = down.substr(0, down.rfind(".lora_"));
        const auto it = by_key.find(stem);
        if (it == by_key.end()) {
            st.fail("targets.json module '" + stem + "' was not matched");
            continue;
        }
        const auto& m = *it->second;
        const std::string full = enum_name(lora_component_table(), m.component) + "." + m.weight;
        st.check_true(stem + " -> " + full, full == t.at("diffusers_weight_name").get<std::string>(),
                      "targets.json maps it to " + t.at("diffusers_weight_name").get<std::string>());
        st.check_true(stem + " rank", m.rank() == t.at("rank").get<int64_t>());
        st.check_true(stem + " alpha", m.alpha == t.at("alpha").get<double>() &&
                                           m.alpha_stored == !t.at("alpha_key").is_null() && m.alpha_stored == alphas);
        st.check_true(stem + " scale", std::abs(m.scale() - t.at("scale").get<double>()) <= 1e-12);
        st.check_true(stem + " shapes", m.down.sizes().vec() == t.at("down_shape").get<std::vector<int64_t>>() &&
                                            m.up.sizes().vec() == t.at("up_shape").get<std::vector<int64_t>>());
        const std::string dtype = spec.at("dtype").get<std::string>();
        st.check_true(stem + " dtype",
                      std::string(c10::toString(m.down.scalar_type())) == (dtype == "float16"   ? "Half"
                                                                           : dtype == "float32" ? "Float"
                                                                                                : dtype));
    }
}

// Each LoRA alone at single_multiplier: the UNet call and the text encoder on the stored inputs.
void check_outputs(const Case& c, const std::string& name, Stats& st) {
    const double mult = c.golden.at("single_multiplier").get<double>();
    const auto& inputs = c.golden.at("inputs");
    require_known_keys(inputs, {"unet", "text_encoder"}, "golden.json inputs");
    SDModels m = load_base(c);
    apply_loras(m, {{lora_file(c, name).string(), mult}});
    auto out = WeightMap::load((c.dir / "golden_outputs.safetensors").string());
    c10::InferenceMode guard;
    for (const auto& key : out.names()) {
        if (key.rfind(name + ".", 0) != 0) continue;
        const std::string what = key.substr(name.size() + 1);
        if (what == "unet.out") {
            const auto [file, names] = input_spec(c.dir, inputs.at("unet"), "unet");
            if (names.size() != 3) throw Error("golden.json inputs.unet: expected sample, timesteps, context");
            auto in = WeightMap::load(file.string());
            st.check(key, m.unet->forward(in.get(names[0]), in.get(names[1]), in.get(names[2])), out.get(key), kOutAtol,
                     kOutRtol);
        } else if (what == "text_encoder.last_hidden_state") {
            const auto [file, names] = input_spec(c.dir, inputs.at("text_encoder"), "text_encoder");
            if (names.size() != 1) throw Error("golden.json inputs.text_encoder: expected input_ids");
            auto in = WeightMap::load(file.string());
            st.check(key, m.text_encoder->forward(in.get(names[0])).last_hidden_state, out.get(key), kOutAtol,
                     kOutRtol);
        } else {
            st.fail("golden output '" + key + "' is not understood by this checker");
        }
    }
}

// The txt2img run with golden.json's pair merged: the run's settings from golden.json "pipeline", the scheduler
// configuration and image size from the run it names as "same_settings_as" (whose initial noise it shares).
std::vector<CaseResult> check_pair_run(const Case& c, const std::string& rel) {
    const std::string run = c.golden.at("pipeline").at("run").get<std::string>();
    // read_run_spec names golden.json's "pipeline" keys as the config.json of a txt2img case.
    return run_results(
        rel + ":" + run,
        [&] {
            const auto pair = sdgolden::lora_pair(c.dir, c.golden, c.targets);
            const auto spec = sdgolden::lora_pair_run(c.dir, c.golden);
            SDModels m = load_base(c);
            apply_loras(m, pair);
            auto out = sdgolden::compare_run(m, c.dir, spec.config, run, "");
            if (spec.same_initial_noise) {
                auto ours = WeightMap::load((c.dir / (run + ".safetensors")).string());
                auto base = WeightMap::load(spec.base.string());
                out.push_back({"initial_noise = " + spec.base.filename().string(), ours.get("initial_noise"),
                               base.get("initial_noise"), 0, 0, sdgolden::Comparison::Exact});
            }
            return out;
        },
        "exception (golden.json pipeline / pair as a txt2img run): ");
}

bool claims(const fs::path& d) {
    if (!has_file(d, "targets.json") || !has_file(d, "merge_deltas.safetensors") || !has_file(d, "golden.json"))
        return false;
    const auto g = sdgolden::read_json_file(d / "golden.json");
    return g.contains("pair") && g.contains("single_multiplier");
}

const bool registered_sd_lora = register_checker(
    {"sd-lora", claims, [](const fs::path& dir, const Context& ctx) {
         const std::string rel = relative_name(dir, ctx);
         std::vector<CaseResult> out;
         Case c;
         out.push_back(guarded(rel + ":case", [&](Stats&) { c = read_case(dir); }));
         if (!out.back().stats.pass) return out;
         out.clear();
         for (const auto& item : c.targets.items()) {
             const std::string name = item.key();
             out.push_back(guarded(rel + ":" + name + ":merge", [&](Stats& st) {
                 SDModels m = c.sdxl ? load_sd_models(c.sdxl_root.string()) : load_base(c);
                 check_merge(c, name, lora_targets(m), st);
             }));
             if (c.sdxl)
                 out.push_back(
                     guarded(rel + ":" + name + ":outputs", [&](Stats& st) { check_sdxl_outputs(c, name, st); }));
             else
                 out.push_back(guarded(rel + ":" + name + ":outputs", [&](Stats& st) { check_outputs(c, name, st); }));
         }
         for (auto& r : c.sdxl ? check_sdxl_pair_run(c, rel) : check_pair_run(c, rel)) out.push_back(r);
         return out;
     }});

} // namespace
} // namespace anchor::golden
