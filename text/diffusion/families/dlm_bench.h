// Timing the published families' cache modes against each other (`anchor-text diffusion generate --compare` and
// `diffusion bench` on a LLaDA / Dream / DiffuGPT model): the same prompt, options and seed under each mode, with the
// seconds per denoising step, the positions each mode recomputed, its agreement with the first mode's answer and the
// process's peak resident memory.
#pragma once

#include "text/diffusion/families/dlm_sampler.h"

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace anchor::text {

// "off,prefix,dual" (commas or semicolons) -> modes. The MDLM path's caches (anchor, window, drift, ...) are refused
// with the reason; ParamError naming `field`.
std::vector<DlmCache> parse_dlm_cache_list(const std::vector<std::string>& lists, const std::string& field);

struct DlmBenchRow {
    DlmCache cache = DlmCache::Off;
    std::vector<double> seconds;     // one per repeat
    int64_t steps = 0;               // denoising steps run (last repeat)
    int64_t positions = 0;           // positions recomputed, summed over steps (last repeat)
    double agreement = 1;            // fraction of answer positions equal to the first row's answer
    std::vector<int64_t> generated;  // the answer of the last repeat
    double median_s() const;
    double min_s() const;
    double max_s() const;
    double per_step_s() const { return steps > 0 ? median_s() / double(steps) : 0; }
};

struct DlmBenchReport {
    std::vector<DlmBenchRow> rows; // the first is the baseline of the speed-ups and agreements
    int64_t prompt_tokens = 0;
    int64_t weight_bytes = 0;
    int64_t peak_rss_bytes = 0; // the process's high-water mark after the runs (the model's load included)
    int threads = 0;
    double speedup(size_t row) const; // rows[0] median / rows[row] median
    nlohmann::json to_json() const;
};

// Runs `modes` in order, each `repeats` times (the same seed every time); `o.cache` is replaced by each mode, which
// is validated against the model before anything runs (ParamError "cache"). `on_row` (may be empty) sees each row
// as it completes.
DlmBenchReport dlm_bench(DlmModel& model, const std::vector<int64_t>& prompt, const DlmSampleOptions& o,
                         const std::vector<DlmCache>& modes, int repeats, uint64_t seed,
                         const std::function<void(const DlmBenchReport&, size_t row)>& on_row = {});

// A deterministic prompt of n ids of the model's vocabulary that are neither its mask nor an end token (benchmarks
// without a tokenizer).
std::vector<int64_t> dlm_synthetic_prompt(const DlmConfig& c, int64_t n);

// The process's peak resident set size in bytes (getrusage), 0 where unknown.
int64_t dlm_peak_rss_bytes();

} // namespace anchor::text
