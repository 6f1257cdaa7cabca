// Cache modes of the published families timed against each other (dlm_bench.h).
#include "text/diffusion/families/dlm_bench.h"

#include "cache/io/error.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <sstream>

#include <sys/resource.h>

namespace anchor::text {

std::vector<DlmCache> parse_dlm_cache_list(const std::vector<std::string>& lists, const std::string& field) {
    std::vector<DlmCache> out;
    for (const auto& list : lists) {
        std::string item;
        std::stringstream ss(list);
        while (std::getline(ss, item, list.find(';') != std::string::npos ? ';' : ',')) {
            if (item.empty()) continue;
            const std::string head = item.substr(0, item.find_first_of(":="));
            if (item.find(':') != std::string::npos && (head == "off" || head == "prefix" || head == "dual"))
                throw ParamError(field, "'" + item + "': the keys after ':' (window=, drift=, decoded=, masked=, " +
                                            "refresh=) are settings of the MDLM path's modes; the published " +
                                            "families run off, prefix or dual as Fast-dLLM defines them");
            if (head == "anchor" || head == "window" || head == "drift" || head == "freq" || head == "sink")
                throw ParamError(field, "'" + item + "' is one of the MDLM path's modes (time-anchor gates and " +
                                            "reuse windows built on the MDLM's own modules and schedule); " +
                                            "the published families run off, prefix or dual (Fast-dLLM's K/V caches)");
            out.push_back(enum_from_string(dlm_cache_table(), item, field));
        }
    }
    if (out.empty()) throw ParamError(field, "no cache mode given (" + enum_choices(dlm_cache_table()) + ")");
    return out;
}

namespace {
std::vector<double> dlm_bench_sorted(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v;
}
} // namespace

double DlmBenchRow::median_s() const {
    if (seconds.empty()) return 0;
    const auto s = dlm_bench_sorted(seconds);
    return s.size() % 2 ? s[s.size() / 2] : 0.5 * (s[s.size() / 2 - 1] + s[s.size() / 2]);
}
double DlmBenchRow::min_s() const {
    return seconds.empty() ? 0 : *std::min_element(seconds.begin(), seconds.end());
}
double DlmBenchRow::max_s() const {
    return seconds.empty() ? 0 : *std::max_element(seconds.begin(), seconds.end());
}

double DlmBenchReport::speedup(size_t row) const {
    const double m = rows.at(row).median_s();
    return m > 0 ? rows.at(0).median_s() / m : 0;
}

nlohmann::json DlmBenchReport::to_json() const {
    nlohmann::json r = nlohmann::json::array();
    for (size_t i = 0; i < rows.size(); ++i) {
        const auto& w = rows[i];
        r.push_back({{"cache", enum_name(dlm_cache_table(), w.cache)},
                     {"seconds", w.seconds},
                     {"median_s", w.median_s()},
                     {"steps", w.steps},
                     {"seconds_per_step", w.per_step_s()},
                     {"positions_computed", w.positions},
                     {"speedup", speedup(i)},
                     {"agreement", w.agreement}});
    }
    return {{"rows", r},
            {"prompt_tokens", prompt_tokens},
            {"weight_bytes", weight_bytes},
            {"peak_rss_bytes", peak_rss_bytes},
            {"threads", threads}};
}

int64_t dlm_peak_rss_bytes() {
    struct rusage u {};
    if (getrusage(RUSAGE_SELF, &u) != 0) return 0;
    return int64_t(u.ru_maxrss) * 1024; // Linux reports kilobytes
}

std::vector<int64_t> dlm_synthetic_prompt(const DlmConfig& c, int64_t n) {
    std::vector<int64_t> out;
    for (int64_t i = 0; int64_t(out.size()) < n; ++i) {
        const int64_t id = (i * 7919 + 13) % c.vocab_size;
        if (id == c.mask_token_id || std::count(c.eos_token_ids.begin(), c.eos_token_ids.end(), id)) continue;
        out.push_back(id);
    }
    return out;
}

DlmBenchReport dlm_bench(DlmModel& model, const std::vector<int64_t>& prompt, const DlmSampleOptions& o,
                         const std::vector<DlmCache>& modes, int repeats, uint64_t seed,
                         const std::function<void(const DlmBenchReport&, size_t row)>& on_row) {
    if (repeats < 1) throw ParamError("repeats", "must be >= 1, got " + std::to_string(repeats));
    for (auto m : modes) {
        auto om = o;
        om.cache = m;
        om.validate(model.config());
    }
    DlmBenchReport rep;
    rep.prompt_tokens = int64_t(prompt.size());
    rep.weight_bytes = model.weight_bytes();
    rep.threads = at::get_num_threads();
    for (auto m : modes) {
        DlmBenchRow row;
        row.cache = m;
        auto om = o;
        om.cache = m;
        for (int r = 0; r < repeats; ++r) {
            const auto t0 = std::chrono::steady_clock::now();
            const auto res = dlm_generate(model, prompt, om, dlm_seeded_draws(seed));
            row.seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
            row.steps = res.steps_run, row.positions = res.positions_computed, row.generated = res.generated;
        }
        if (!rep.rows.empty()) {
            const auto& base = rep.rows.front().generated;
            const size_t n = std::max(base.size(), row.generated.size());
            size_t same = 0;
            for (size_t i = 0; i < std::min(base.size(), row.generated.size()); ++i) same += base[i] == row.generated[i];
            row.agreement = n ? double(same) / double(n) : 1.0;
        }
        rep.rows.push_back(row);
        rep.peak_rss_bytes = dlm_peak_rss_bytes();
        if (on_row) on_row(rep, rep.rows.size() - 1);
    }
    return rep;
}

} // namespace anchor::text
