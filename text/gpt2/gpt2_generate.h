// Streaming generation (`anchor-text gpt2 generate`): a prompt, then one token at a time through a Gpt2Stream past the
// context window, with the soak statistics of long runs: RSS and latency per window of tokens, their growth and drift.
#pragma once

#include "text/gpt2/gpt2_load.h"
#include "text/gpt2/sampler_chain.h"

#include <nlohmann/json.hpp>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace anchor::text {

struct GenerateParams {
    Gpt2ModelParams model;
    std::string prompt;         // text (GPT-2 BPE)
    bool allow_special = false; // encode a literal <|endoftext|> in the prompt as id 50256
    int64_t max_new_tokens = 64;
    KvSpec kv;
    PositionMode positions = PositionMode::Wrap;
    SamplingParams sampling;
    bool stop_at_eos = false;
    int64_t report_every = 0; // soak: a window of latency and RSS every N generated tokens (0: none)
    void validate() const;    // ParamError naming the field
};

struct SoakWindow {
    int64_t tokens = 0;      // generated tokens at the window's end
    double ms_per_token = 0; // mean over the window (the window callback itself is not timed)
    int64_t rss_bytes = 0;   // resident set size at its end
};

struct GenerateReport {
    std::string model;
    KvSpec kv;
    PositionMode positions = PositionMode::Wrap;
    std::string sampler; // the chain, SamplerChain::describe()
    int threads = 0;
    int64_t prompt_tokens = 0, generated = 0;
    double prefill_s = 0, generate_s = 0;
    int64_t kv_bytes = 0, peak_rss = 0;
    int64_t report_every = 0;
    std::vector<SoakWindow> windows;

    // Growth and drift, from the first window (warm-up: allocator pools and the ring fill) to the later ones; needs
    // two windows. Drift compares the median latency of the last quarter of the later windows with the first
    // quarter's (medians, so that a burst of other load on a shared machine does not count as drift).
    struct Soak {
        int64_t rss_first = 0, rss_max = 0;
        double rss_growth_percent = 0, latency_drift_percent = 0;
        double latency_min = 0, latency_median = 0, latency_max = 0; // ms/token over the later windows
    };
    std::optional<Soak> soak() const;
    nlohmann::json to_json() const; // the soak report (--report-json): windows, growth, drift
};

// Peak bytes a stream adds to the weights: its KV buffers (the mode's capacity, preallocated), the working set of the
// widest forward (the prompt's first chunk, or a recompute window) with its attention scores, the logits, and the
// generated tokens and text. StreamRunner refuses a run that needs more than the memory available (ParamError "kv"
// when the buffers dominate, else "prompt").
int64_t estimate_stream_bytes(const Gpt2Config& c, const KvSpec& kv, int64_t prompt_tokens, int64_t max_new_tokens);

// Loads the model (validating the parameters first), encodes the prompt and checks it fits the KV mode and the
// memory available; run() streams.
class StreamRunner {
public:
    explicit StreamRunner(const GenerateParams& p);
    // With a model and tokenizer loaded once for many runs (a server); p.model is not read. Every run has a KV
    // cache and a sampler of its own.
    StreamRunner(const GenerateParams& p, const LoadedGpt2& model, std::shared_ptr<const Gpt2Tokenizer> tokenizer);
    const std::vector<int64_t>& prompt_ids() const { return prompt_; }
    int64_t n_positions() const { return loaded_.config.n_positions; }
    // Feeds the prompt and generates; `on_text` gets the UTF-8 text of every token as soon as it is whole (and the
    // rest at the end), `on_window` each soak window.
    // `stop` (optional), asked after every token, ends the run early when it returns true (a stop sequence seen, a
    // client gone).
    GenerateReport run(const std::function<void(const std::string&)>& on_text = {},
                       const std::function<void(const SoakWindow&)>& on_window = {},
                       const std::function<bool()>& stop = {});
    // The last run's first stop: "eos" (<|endoftext|> with stop_at_eos), "stop" (the callback) or "length".
    const std::string& finish_reason() const { return finish_; }

private:
    void encode_prompt();
    GenerateParams p_;
    LoadedGpt2 loaded_;
    std::shared_ptr<const Gpt2Tokenizer> tok_;
    std::vector<int64_t> prompt_;
    std::string finish_ = "length";
};

} // namespace anchor::text
