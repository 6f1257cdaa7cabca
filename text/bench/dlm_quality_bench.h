// Quality of the published families' caches on real prompts (`anchor-text diffusion bench -m MODEL --prompts-from F
// [--score-with GPT2]`): every mode on the same prompts and seeds, interleaved per prompt, with the per-prompt
// speed-up, the positions each mode recomputed (the forward-cost proxy: full forwards = positions / sequence length),
// the agreement of its answer with the first mode's, the unigram entropy of the answers and their generative
// perplexity under a GPT-2 (the MDLM bench's figures, text/bench/mdlm_bench.h, for DiffuGPT / LLaDA / Dream).
#pragma once

#include "text/bench/mdlm_bench.h"
#include "text/diffusion/families/dlm_sampler.h"
#include "text/gpt2/gpt2_model.h"

#include <nlohmann/json.hpp>

#include <functional>
#include <string>
#include <vector>

namespace anchor::text {

struct DlmQualityRow {
    DlmCache cache = DlmCache::Off;
    std::vector<double> seconds, speedups; // per prompt (speed-up: the first mode's time over this one's)
    double positions = 0;                  // positions recomputed per prompt (mean)
    double full_forwards = 0;              // positions / sequence length (mean)
    double agreement = 1;                  // answer positions equal to the first mode's (mean over prompts)
    MeanCi entropy, gen_ppl;               // gen_ppl.mean -1: not scored
    std::vector<std::vector<int64_t>> answers;
    nlohmann::json to_json() const;
};

struct DlmQualityReport {
    std::vector<DlmQualityRow> rows; // the first is the baseline
    int64_t prompts = 0, prompt_len = 0, gen_length = 0, block_length = 0, steps = 0;
    double temperature = 0;
    // Relative changes of row i against row 0 (gen-PPL and entropy means), and the median per-prompt speed-up.
    double gen_ppl_change(size_t i) const { return rows.at(i).gen_ppl.mean / rows.at(0).gen_ppl.mean - 1; }
    double entropy_change(size_t i) const { return rows.at(i).entropy.mean / rows.at(0).entropy.mean - 1; }
    double forward_ratio(size_t i) const { return rows.at(0).positions / rows.at(i).positions; }
    double median_speedup(size_t i) const;
    nlohmann::json to_json() const;
};

// Windows of a token file as prompts for a family's model: `n` evenly spaced windows of `len` ids, skipping those
// with an end token or an id outside the model's vocabulary (text/token_file.h).
std::vector<std::vector<int64_t>> dlm_prompts_from(const std::string& path, const DlmConfig& c, int64_t n,
                                                   int64_t len);

// Runs `modes` on each prompt in turn (prompt k draws from seed + k in every mode); `scorer` (may be null) scores
// each sequence's answer with generative_ppl. `on_prompt` (may be empty) sees the prompt index after each prompt.
DlmQualityReport dlm_quality_bench(DlmModel& model, const std::vector<std::vector<int64_t>>& prompts,
                                   const DlmSampleOptions& o, const std::vector<DlmCache>& modes, uint64_t seed,
                                   Gpt2Model* scorer, const std::function<void(size_t)>& on_prompt = {});

} // namespace anchor::text
