// Text diffusion runs (`anchor-text diffusion generate`, `--compare`): sampling with one cache mode, or two side by
// side with the same seed, each text's generative perplexity under a GPT-2 when asked.
#pragma once

#include "text/mdlm_sampler.h"

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace anchor::text {

struct DiffusionGenerateParams {
    std::string model;                             // MDLM folder or .safetensors (config.json next to it)
    int64_t n_heads = 0;                           // when the model has no config.json (0: D / 64)
    SamplerOptions sampler;                        // prompt: GPT-2 ids
    std::vector<CacheSpec> caches = {CacheSpec{}}; // one mode, or two run side by side with the same seed
    std::string score_with;                        // GPT-2 model scoring each text's generative perplexity ("": none)
    void validate() const;                         // ParamError naming the field
};

struct DiffusionRun {
    CacheSpec cache;
    SampleResult result;
    double gen_ppl = -1; // under score_with, conditioned on the prompt (-1: not scored)
    nlohmann::json to_json() const;
};

struct DiffusionReport {
    std::string model, score_with;
    int64_t prompt_tokens = 0;
    int threads = 0;
    std::vector<DiffusionRun> runs;
    double agreement() const; // of the second run's generated tokens with the first's (1 with one run)
    nlohmann::json to_json() const;
};

// Fraction of equal tokens of a and b from index `from` (1 when there are none).
double token_agreement(const std::vector<int64_t>& a, const std::vector<int64_t>& b, int64_t from);

// `on_step` (optional) sees every step of every run.
DiffusionReport generate_diffusion(const DiffusionGenerateParams& p, const StepCallback& on_step = {});

} // namespace anchor::text
