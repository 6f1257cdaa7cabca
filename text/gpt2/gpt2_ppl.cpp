#include "text/gpt2/gpt2_ppl.h"

#include "cache/io/read_file.h"
#include "cache/util/bench.h"
#include "text/params.h"

#include <chrono>
#include <cmath>
#include <optional>
#include <sstream>

namespace anchor::text {

std::vector<KvSpec> parse_kv_list(const std::string& s) {
    std::vector<std::string> parts;
    std::stringstream ss(s);
    for (std::string item; std::getline(ss, item, ',');) {
        if (!parts.empty() && !item.empty() && item.find_first_not_of("0123456789") == std::string::npos &&
            parts.back().rfind("sink:", 0) == 0 && parts.back().find(',') == std::string::npos)
            parts.back() += "," + item;
        else
            parts.push_back(item);
    }
    std::vector<KvSpec> out;
    for (const auto& p : parts) out.push_back(KvSpec::parse(p));
    if (out.empty()) throw ParamError("kv", "is empty: give at least one KV mode");
    return out;
}

void PplParams::validate() const {
    model.validate();
    if (file.empty()) throw ParamError("file", "is empty: a text file to score is needed");
    if (kv.empty()) throw ParamError("kv", "is empty: give at least one KV mode");
    if (max_tokens < 0) throw ParamError("max_tokens", "must be >= 0, got " + std::to_string(max_tokens));
}

nlohmann::json PplRun::to_json() const {
    if (!skipped.empty()) return {{"kv", kv.str()}, {"skipped", skipped}};
    if (!failed.empty()) return {{"kv", kv.str()}, {"failed", failed}};
    return {{"kv", kv.str()},       {"tokens", tokens},     {"scored", tokens - 1}, {"ppl", ppl},
            {"mean_nll", mean_nll}, {"kv_bytes", kv_bytes}, {"seconds", seconds}};
}

nlohmann::json PplReport::to_json() const {
    nlohmann::json j = {{"model", model},
                        {"config", config},
                        {"file", file},
                        {"tokens", tokens},
                        {"positions", enum_name(position_mode_table(), positions)},
                        {"threads", threads},
                        {"runs", nlohmann::json::array()}};
    for (const auto& r : runs) j["runs"].push_back(r.to_json());
    return j;
}

namespace {
// Why `kv` cannot score N tokens of a model with P positions: the parameter at fault and what is wrong with it.
std::optional<ParamError> cannot_run(const KvSpec& kv, PositionMode positions, int64_t N, int64_t P) {
    const std::string text = " (the text has " + std::to_string(N) + " tokens)";
    if (kv.mode == KvMode::Full && N > P)
        return ParamError("kv", "cannot go past n_positions=" + std::to_string(P) + text +
                                    "; use sink:S,W, window:W or recompute:W, or max_tokens " + std::to_string(P));
    if (positions == PositionMode::Absolute && N > P)
        return ParamError("positions", "absolute cannot go past n_positions=" + std::to_string(P) + text +
                                           "; use positions reencode, wrap or cache, or max_tokens " +
                                           std::to_string(P));
    return std::nullopt;
}
} // namespace

PplReport evaluate_ppl(const PplParams& p, const PplProgress& progress) {
    using Clock = std::chrono::steady_clock;
    p.validate();
    const std::string text = read_file(p.file, "text file");
    auto loaded = load_gpt2_model(p.model);
    auto tok = load_gpt2_tokenizer(p.model, loaded);
    auto ids = p.max_tokens > 0 ? tok.encode_first(text, static_cast<size_t>(p.max_tokens)) : tok.encode(text);
    if (ids.size() < 2) throw Error("text file '" + p.file + "' encodes to fewer than 2 tokens; nothing to score");
    const int64_t P = loaded.config.n_positions, N = static_cast<int64_t>(ids.size());
    if (p.kv.size() == 1)
        if (auto refusal = cannot_run(p.kv[0], p.positions, N, P)) throw *refusal;
    PplReport report;
    report.model = p.model.model;
    report.config = loaded.config.describe();
    report.file = p.file;
    report.tokens = N;
    report.positions = p.positions;
    report.threads = at::get_num_threads();
    if (progress.loaded) progress.loaded(report);
    for (const auto& spec : p.kv) {
        if (progress.run_started) progress.run_started(spec);
        PplRun run;
        run.kv = spec;
        if (auto refusal = cannot_run(spec, p.positions, N, P)) {
            run.skipped = refusal->field() == "kv" ? "the text is longer than n_positions"
                                                   : "positions absolute past n_positions";
            run.skipped_why = refusal->field() == "kv" ? refusal->detail() : refusal->what();
        }
        if (run.skipped.empty()) {
            try {
                const auto t0 = Clock::now();
                Gpt2Stream probe(loaded.model, spec, p.positions); // validates S+W against the positions up front
                run.kv_bytes = probe.kv_bytes();
                auto ev = evaluate_stream(loaded.model, ids, spec, p.positions);
                run.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
                run.tokens = ev.tokens;
                run.mean_nll = ev.mean_nll;
                run.ppl = std::exp(ev.mean_nll);
                run.peak_rss = util::peak_rss_bytes();
            } catch (const ParamError&) {
                throw;
            } catch (const Error& e) {
                run.failed = e.what();
            }
        }
        report.runs.push_back(run);
        if (progress.run_finished) progress.run_finished(report.runs.back());
    }
    return report;
}

} // namespace anchor::text
