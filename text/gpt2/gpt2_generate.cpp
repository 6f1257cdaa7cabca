#include "text/gpt2/gpt2_generate.h"

#include "cache/util/bench.h"
#include "cache/util/memory.h"
#include "text/params.h"

#include <chrono>

namespace anchor::text {

void GenerateParams::validate() const {
    model.validate();
    if (prompt.empty()) throw ParamError("prompt", "is empty");
    if (max_new_tokens < 0) throw ParamError("max_new_tokens", "must be >= 0, got " + std::to_string(max_new_tokens));
    if (report_every < 0) throw ParamError("report_every", "must be >= 0, got " + std::to_string(report_every));
    sampling.validate();
}

std::optional<GenerateReport::Soak> GenerateReport::soak() const {
    if (windows.size() < 2) return std::nullopt;
    Soak s;
    s.rss_first = s.rss_max = windows.front().rss_bytes;
    std::vector<double> later;
    for (size_t i = 1; i < windows.size(); ++i)
        s.rss_max = std::max(s.rss_max, windows[i].rss_bytes), later.push_back(windows[i].ms_per_token);
    s.rss_growth_percent = 100.0 * double(s.rss_max - s.rss_first) / double(s.rss_first);
    const auto lat = util::stats_of(later);
    s.latency_min = lat.min, s.latency_median = lat.median, s.latency_max = lat.max;
    const size_t q = std::max<size_t>(1, later.size() / 4);
    const auto head = util::stats_of(std::vector<double>(later.begin(), later.begin() + q));
    const auto tail = util::stats_of(std::vector<double>(later.end() - q, later.end()));
    s.latency_drift_percent = 100.0 * (tail.median / head.median - 1.0);
    return s;
}

nlohmann::json GenerateReport::to_json() const {
    nlohmann::json j;
    j["model"] = model;
    j["kv"] = kv.str();
    j["positions"] = enum_name(position_mode_table(), positions);
    j["sampler"] = sampler;
    j["threads"] = threads;
    j["report_every"] = report_every;
    j["generated"] = generated;
    if (const auto s = soak()) {
        j["rss_growth_percent"] = s->rss_growth_percent;
        j["latency_drift_percent"] = s->latency_drift_percent;
        j["latency_ms"] = {{"min", s->latency_min}, {"median", s->latency_median}, {"max", s->latency_max}};
    }
    j["windows"] = nlohmann::json::array();
    for (const auto& w : windows)
        j["windows"].push_back({{"tokens", w.tokens}, {"ms_per_token", w.ms_per_token}, {"rss_bytes", w.rss_bytes}});
    return j;
}

StreamRunner::StreamRunner(const GenerateParams& p) : p_((p.validate(), p)), loaded_(load_gpt2_model(p.model)) {
    tok_ = std::make_shared<const Gpt2Tokenizer>(load_gpt2_tokenizer(p.model, loaded_));
    encode_prompt();
}

StreamRunner::StreamRunner(const GenerateParams& p, const LoadedGpt2& model,
                           std::shared_ptr<const Gpt2Tokenizer> tokenizer)
    : p_(p), loaded_(model), tok_(std::move(tokenizer)) {
    if (p_.prompt.empty()) throw ParamError("prompt", "is empty");
    if (p_.max_new_tokens < 0)
        throw ParamError("max_new_tokens", "must be >= 0, got " + std::to_string(p_.max_new_tokens));
    p_.sampling.validate();
    encode_prompt();
}

int64_t estimate_stream_bytes(const Gpt2Config& c, const KvSpec& kv, int64_t prompt_tokens, int64_t max_new_tokens) {
    const double cap = double(kv.mode == KvMode::Full   ? c.n_positions
                              : kv.mode == KvMode::Sink ? kv.sinks + kv.window
                                                        : kv.window);
    const double kv_bytes = kv.mode == KvMode::Recompute ? 0.0 : 2.0 * double(c.n_layer) * cap * double(c.n_embd) * 4;
    const double T = kv.mode == KvMode::Recompute ? cap : std::min(double(prompt_tokens), cap);
    const double work = 4.0 * (T * (6.0 * double(c.n_embd) + 2.0 * double(c.inner())) +
                               2.0 * double(c.n_head) * T * cap + 2.0 * double(c.vocab_size));
    return int64_t(kv_bytes + work + 16.0 * double(max_new_tokens));
}

void StreamRunner::encode_prompt() {
    prompt_ = tok_->encode(p_.prompt, p_.allow_special);
    if (prompt_.empty()) throw ParamError("prompt", "encodes to no tokens");
    const int64_t P = loaded_.config.n_positions, total = static_cast<int64_t>(prompt_.size()) + p_.max_new_tokens;
    if ((p_.kv.mode == KvMode::Full || p_.positions == PositionMode::Absolute) && total > P)
        throw ParamError("max_new_tokens",
                         std::to_string(p_.max_new_tokens) + " after " + std::to_string(prompt_.size()) +
                             " prompted tokens exceeds n_positions " + std::to_string(P) + " with kv " + p_.kv.str() +
                             " positions " + enum_name(position_mode_table(), p_.positions) +
                             "; use kv sink:S,W with positions reencode, wrap or cache to go "
                             "further");
    // A sink buffer longer than the position table: reencode and cache give its later tokens positions past
    // n_positions, which the model has no embedding for (wrap folds them back: the caller may warn).
    if (p_.kv.mode == KvMode::Sink && p_.kv.sinks + p_.kv.window > P &&
        (p_.positions == PositionMode::Reencode || p_.positions == PositionMode::Cache))
        throw ParamError("kv", p_.kv.str() + " holds " + std::to_string(p_.kv.sinks + p_.kv.window) +
                                   " tokens, more than n_positions " + std::to_string(P) + ", which positions " +
                                   enum_name(position_mode_table(), p_.positions) +
                                   " would need; choose S + W <= " + std::to_string(P));
    const auto& c = loaded_.config;
    const double need = double(estimate_stream_bytes(c, p_.kv, int64_t(prompt_.size()), p_.max_new_tokens));
    const double kv_part = double(estimate_stream_bytes(c, p_.kv, 0, 0));
    const double new_part = 16.0 * double(p_.max_new_tokens);
    // The part that dominates the estimate is the one to name.
    check_fits_memory(new_part * 2 > need  ? "max_new_tokens"
                      : kv_part * 2 > need ? "kv"
                                           : "prompt",
                      need,
                      "kv " + p_.kv.str() + " with a prompt of " + std::to_string(prompt_.size()) + " tokens and " +
                          std::to_string(p_.max_new_tokens) + " new ones",
                      new_part * 2 > need ? "choose fewer new tokens" : "choose a smaller kv window or prompt");
}

GenerateReport StreamRunner::run(const std::function<void(const std::string&)>& on_text,
                                 const std::function<void(const SoakWindow&)>& on_window,
                                 const std::function<bool()>& stop) {
    finish_ = "length";
    using Clock = std::chrono::steady_clock;
    Gpt2Stream stream(loaded_.model, p_.kv, p_.positions);
    auto chain = make_sampler_chain(p_.sampling);
    for (auto t : prompt_) chain.accept(t); // the repetition penalty sees the prompt (Hugging Face's semantics)
    GenerateReport r;
    r.model = p_.model.model;
    r.kv = p_.kv;
    r.positions = p_.positions;
    r.sampler = chain.describe();
    r.threads = at::get_num_threads();
    r.prompt_tokens = static_cast<int64_t>(prompt_.size());
    r.report_every = p_.report_every;
    Utf8StreamDecoder dec;
    const auto t0 = Clock::now();
    auto logits = stream.feed(prompt_);
    r.prefill_s = std::chrono::duration<double>(Clock::now() - t0).count();
    const auto t1 = Clock::now();
    auto window_start = Clock::now();
    for (int64_t k = 0; k < p_.max_new_tokens; ++k) {
        const int64_t id = chain.sample(logits);
        chain.accept(id);
        ++r.generated;
        const std::string piece = dec.push(tok_->token_bytes(id));
        if (on_text && !piece.empty()) on_text(piece);
        if (p_.stop_at_eos && id == Gpt2Tokenizer::kEndOfText) {
            finish_ = "eos";
            break;
        }
        if (stop && stop()) {
            finish_ = "stop";
            break;
        }
        if (k + 1 < p_.max_new_tokens) logits = stream.feed(id);
        if (p_.report_every > 0 && r.generated % p_.report_every == 0) {
            const auto now = Clock::now();
            SoakWindow w{r.generated,
                         1e3 * std::chrono::duration<double>(now - window_start).count() / double(p_.report_every),
                         util::rss_now_bytes()};
            r.windows.push_back(w);
            if (on_window) on_window(w);
            window_start = Clock::now(); // the report itself is not timed
        }
    }
    const std::string rest = dec.flush();
    if (on_text && !rest.empty()) on_text(rest);
    r.generate_s = std::chrono::duration<double>(Clock::now() - t1).count();
    r.kv_bytes = stream.kv_bytes();
    r.peak_rss = util::peak_rss_bytes();
    return r;
}

} // namespace anchor::text
