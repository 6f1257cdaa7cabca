// The text-diffusion benchmark (`anchor-text diffusion bench`): every decoding mode (a cache and its sampler
// overrides, text/diffusion/mdlm_run.h) against a baseline (`off` by default) on the same prompts and seeds, interleaved per
// repeat: wall time (min/median/max) and the per-prompt speed-up, reused fraction, token agreement, the unigram
// entropy of the samples and, with a scoring GPT-2, their generative perplexity with a 95 % interval over the prompts
// (the MDLM/SEDD quality metric: once the decoding order changes, agreement with the baseline means little).
#pragma once

#include "text/bench/bench_report.h"
#include "text/diffusion/mdlm_run.h"
#include "text/diffusion/mdlm_sampler.h"

#include <nlohmann/json.hpp>

#include <cmath>
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
    double temperature = 0.0;                                             // 0: argmax, so agreement measures the cache
    int64_t block_length = 0;                                             // of every mode that does not set its own
    kernels::AttentionKernel attention = kernels::AttentionKernel::Exact; // the model's (kernels/attention.h)
    kernels::GemmBackend gemm = kernels::GemmBackend::Torch;              // its linear layers' (MdlmBlockImpl::gemm)
    Placement placement; // --device / --dtype of the MDLM; the scoring GPT-2 stays the CPU float32 reference
    uint64_t seed = 0;
    DecodeSpec baseline;            // what every mode is measured against (off)
    std::vector<DecodeSpec> caches; // each measured against the baseline
    std::string prompts_from;       // token file whose evenly spaced windows are the prompts ("": random)
    std::string score_with;         // GPT-2 model for generative perplexity ("": none)
    void validate() const;          // ParamError naming the field
};

// Mean of per-prompt values and the half-width of its normal 95 % interval (1.96 standard errors; 0 for one prompt).
struct MeanCi {
    double mean = -1, ci95 = 0;
    static MeanCi of(const std::vector<double>& v);
    nlohmann::json to_json() const { return {{"mean", mean}, {"ci95", ci95}}; }
};

struct DiffusionBenchRow {
    std::string cache, resolved; // as typed, and with every parameter
    int64_t steps = 0;
    Spread off_s, cached_s; // wall time of the baseline and the mode
    Spread speedups;        // per prompt: baseline over mode
    double reused = 0, agreement = 0;
    double forwards_off = 0, forwards_cached = 0; // denoiser calls per sample
    MeanCi gen_ppl_off, gen_ppl_cached;           // mean -1: not scored
    MeanCi entropy_off, entropy_cached;           // unigram entropy (nats) of the generated tokens
    double gen_ppl_change() const { return gen_ppl_cached.mean / gen_ppl_off.mean - 1; }
    double entropy_change() const { // relative; a baseline of entropy 0 (one repeated token) gives 0 or +inf
        return entropy_off.mean > 0 ? entropy_cached.mean / entropy_off.mean - 1
                                    : (entropy_cached.mean > 0 ? HUGE_VAL : 0.0);
    }
    cache::CacheStats store; // the cached runs' latent store, summed over the repeats
    double speedup() const { return off_s.median / cached_s.median; } // median wall time, off over cached
    nlohmann::json to_json() const;
};

struct DiffusionBenchReport {
    std::string model, prompts, baseline;
    nlohmann::json config;
    int64_t length = 0, prompt_len = 0, repeats = 0;
    UnmaskRule unmask = UnmaskRule::Confidence;
    double temperature = 0;
    int threads = 0;
    std::string kernels;                          // "gemm onednn, attention flash"
    std::string score_with, load_start, load_end; // load averages (a loaded 2-core machine makes timings moot)
    std::vector<DiffusionBenchRow> rows;
    nlohmann::json to_json() const;
};

// `progress` (optional) after loading (row nullptr) and after every row.
DiffusionBenchReport
run_diffusion_bench(const DiffusionBenchParams& p,
                    const std::function<void(const DiffusionBenchReport&, const DiffusionBenchRow*)>& progress = {});

} // namespace anchor::text
