// Shared by tests/test_lora.cpp and tests/golden_runner/check_sd_lora.cpp: how a LoRA case's txt2img run
// (tests/golden/sd/lora_sd15_tiny/golden.json "pipeline" and "pair") becomes a run of tests/sd_pipeline_golden.h.
#pragma once

#include "tests/sd_pipeline_golden.h"
#include "unet/model/lora.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <string>
#include <vector>

namespace anchor::sdgolden {

// The LoRA file of `name` in targets.json ("file", next to the case).
inline std::filesystem::path lora_case_file(const std::filesystem::path& dir, const nlohmann::json& targets,
                                            const std::string& name) {
    if (!targets.contains(name)) throw Error("targets.json has no LoRA '" + name + "'");
    return dir / targets[name].at("file").get<std::string>();
}

// golden.json "pair": [{"lora", "multiplier"}, ...] in merge order.
inline std::vector<unet::LoraSpec> lora_pair(const std::filesystem::path& dir, const nlohmann::json& golden,
                                             const nlohmann::json& targets) {
    std::vector<unet::LoraSpec> out;
    for (const auto& p : golden.at("pair")) {
        for (const auto& [k, v] : p.items())
            if (k != "lora" && k != "multiplier") throw Error("golden.json pair: key '" + k + "' is not understood");
        out.push_back(
            {lora_case_file(dir, targets, p.at("lora").get<std::string>()).string(), p.at("multiplier").get<double>()});
    }
    return out;
}

struct LoraPairRun {
    std::string run;                 // <run>.safetensors in the case folder
    nlohmann::json config;           // a txt2img case config (read_run_spec) with that one run
    std::filesystem::path base;      // the run it shares its settings with ("same_settings_as")
    bool same_initial_noise = false; // the case says its initial noise is the base run's
};

// golden.json "pipeline": the run's own settings (prompts, seed, guidance, scheduler, steps, timesteps ...) and, from
// the config.json of the run it names as "same_settings_as", the scheduler configuration and image size it does not
// repeat. Every other key goes to read_run_spec, which names any it does not understand.
inline LoraPairRun lora_pair_run(const std::filesystem::path& dir, const nlohmann::json& golden) {
    const auto& pl = golden.at("pipeline");
    LoraPairRun r;
    r.run = pl.at("run").get<std::string>();
    r.base = dir / pl.at("same_settings_as").get<std::string>();
    const auto base_cfg = read_json_file(r.base.parent_path() / "config.json");
    nlohmann::json run = nlohmann::json::object();
    for (const char* k : {"scheduler_base_config", "height", "width", "latent_shape", "vae_scale_factor"})
        if (base_cfg.contains(k)) r.config[k] = base_cfg[k];
    for (const auto& [k, v] : pl.items()) {
        if (k == "run" || k == "same_settings_as") continue;
        if (k.rfind("initial_noise_equals_", 0) == 0)
            r.same_initial_noise = v.get<bool>();
        else
            run[k] = v;
    }
    r.config["runs"] = {{r.run, run}};
    return r;
}

} // namespace anchor::sdgolden
