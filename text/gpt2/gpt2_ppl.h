// Streaming perplexity (`anchor-text gpt2 ppl`): the StreamingLLM protocol (Xiao et al. 2023, sec. 4.1) over one or
// several KV modes: one token per forward, the next token scored, ppl = exp(mean NLL).
#pragma once

#include "text/gpt2/gpt2_load.h"

#include <nlohmann/json.hpp>

#include <functional>
#include <string>
#include <vector>

namespace anchor::text {

// "full,window:32,sink:4,28,recompute:32": comma-separated KV modes, where a bare number after sink:S belongs to it
// (S,W). ParamError (field "kv") on a bad mode.
std::vector<KvSpec> parse_kv_list(const std::string& s);

struct PplParams {
    Gpt2ModelParams model;
    std::string file;       // UTF-8 text to score
    std::vector<KvSpec> kv; // modes run over the same text; with one, a mode that cannot run is an error
    PositionMode positions = PositionMode::Wrap;
    int64_t max_tokens = 0; // score only the first N tokens (0: all)
    void validate() const;  // ParamError naming the field
};

struct PplRun {
    KvSpec kv;
    int64_t tokens = 0; // stream steps
    double ppl = 0, mean_nll = 0;
    int64_t kv_bytes = 0; // preallocated KV cache
    double seconds = 0;
    int64_t peak_rss = 0;    // process high-water mark after the run (VmHWM)
    std::string skipped;     // why the mode did not run (several modes only), in short,
    std::string skipped_why; // and in full, naming the parameter fields at fault; or
    std::string failed;      // the error it stopped with
    nlohmann::json to_json() const;
};

struct PplReport {
    std::string model, config, file;
    int64_t tokens = 0; // of the text (after max_tokens)
    PositionMode positions = PositionMode::Wrap;
    int threads = 0;
    std::vector<PplRun> runs;
    nlohmann::json to_json() const;
};

// Progress of evaluate_ppl: after loading (the report has no runs yet), before and after each mode.
struct PplProgress {
    std::function<void(const PplReport&)> loaded;
    std::function<void(const KvSpec&)> run_started;
    std::function<void(const PplRun&)> run_finished;
};

// Loads the model and text, runs every mode. A mode that cannot run (the text is longer than a full cache or than
// absolute positions allow) is a ParamError when it is the only one, else a run with `skipped`; another runtime
// error of one mode of several is a run with `failed`.
PplReport evaluate_ppl(const PplParams& p, const PplProgress& progress = {});

} // namespace anchor::text
