// The text-diffusion cache benchmark (`anchor-text diffusion bench`): every cache mode against `off` on the same
// prompts and seeds, interleaved per repeat: wall time, reused fraction, token agreement, optionally the generative
// perplexity of both, and the latent store's statistics.
#pragma once

#include "text/bench_report.h"
#include "text/mdlm_sampler.h"

#include <nlohmann/json.hpp>

#include <functional>
#include <string>
#include <vector>

namespace anchor::text {

struct DiffusionBenchParams {
    std::string model;                     // "": random weights of `layers` x `dim`
    int64_t n_heads = 0;                   // when the model has no config.json
    int64_t layers = 12, dim = 768;        // the random model
    int64_t length = 256, prompt_len = 64; // sequence and prompt tokens
    int64_t repeats = 3;                   // runs per step count (each with its own prompt and seed + r)
    std::vector<int64_t> steps = {64, 128, 256};
    UnmaskRule unmask = UnmaskRule::Confidence;
    double temperature = 0.0; // 0: argmax, so agreement measures the cache
    uint64_t seed = 0;
    std::vector<CacheSpec> caches; // each measured against off
    std::string prompts_from;      // token file whose evenly spaced windows are the prompts ("": random)
    std::string score_with;        // GPT-2 model for generative perplexity ("": none)
    void validate() const;         // ParamError naming the field
};

struct DiffusionBenchRow {
    std::string cache;
    int64_t steps = 0;
    Spread off_s, cached_s;                                                  // wall time of the off and cached runs
    double reused = 0, agreement = 0, gen_ppl_off = -1, gen_ppl_cached = -1; // means over the repeats
    cache::CacheStats store; // the cached runs' latent store, summed over the repeats
    double speedup() const { return off_s.median / cached_s.median; } // median wall time, off over cached
    nlohmann::json to_json() const;
};

struct DiffusionBenchReport {
    std::string model, prompts;
    nlohmann::json config;
    int64_t length = 0, prompt_len = 0, repeats = 0;
    UnmaskRule unmask = UnmaskRule::Confidence;
    double temperature = 0;
    int threads = 0;
    std::string score_with, load_start, load_end; // load averages (a loaded 2-core machine makes timings moot)
    std::vector<DiffusionBenchRow> rows;
    nlohmann::json to_json() const;
};

// `progress` (optional) after loading (row nullptr) and after every row.
DiffusionBenchReport
run_diffusion_bench(const DiffusionBenchParams& p,
                    const std::function<void(const DiffusionBenchReport&, const DiffusionBenchRow*)>& progress = {});

} // namespace anchor::text
