// The tiny SD model of tests/golden/sd/deepcache and a txt2img run of it, for the tests that run the pipeline
// free (the caches, the samplers): the case's prompts and guidance, seed 42, pipeline_tiny's image size.
#pragma once

#include "tests/sd_pipeline_golden.h"
#include "tests/test_util.h"
#include "unet/pipeline/pipeline.h"

#include <filesystem>
#include <string>
#include <vector>

namespace anchor::test {

inline unet::SDModels deepcache_models() {
    const std::filesystem::path dir = golden("sd/deepcache");
    return sdgolden::load_run_models(dir, sdgolden::read_json_file(dir / "config.json"));
}

// The DeepCache golden's prompts and guidance, seed 42, at `steps` of `sampler`.
inline unet::Txt2ImgParams tiny_params(int steps, unet::SamplerKind sampler) {
    namespace fs = std::filesystem;
    auto cfg = sdgolden::read_json_file(fs::path(golden("sd/deepcache")) / "config.json");
    unet::Txt2ImgParams p;
    p.prompts = cfg.at("prompts").get<std::vector<std::string>>();
    p.guidance_scale = cfg.value("guidance_scale", 7.5);
    p.steps = steps;
    p.seed = 42;
    // deepcache/config.json has no image size: it is pipeline_tiny's (16x16, 8x8 latents).
    auto pcfg = sdgolden::read_json_file(fs::path(golden("sd/pipeline_tiny")) / "config.json");
    p.width = pcfg.at("width").get<int>();
    p.height = pcfg.at("height").get<int>();
    p.sampler = sampler;
    return p;
}

} // namespace anchor::test
