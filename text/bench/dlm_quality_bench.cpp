// The published families' caches on real prompts (dlm_quality_bench.h).
#include "text/bench/dlm_quality_bench.h"

#include "cache/io/error.h"
#include "text/diffusion/mdlm_run.h"
#include "text/token_file.h"

#include <algorithm>
#include <chrono>

namespace anchor::text {

nlohmann::json DlmQualityRow::to_json() const {
    nlohmann::json j = {{"cache", enum_name(dlm_cache_table(), cache)},
                        {"seconds", seconds},
                        {"speedups", speedups},
                        {"positions_per_prompt", positions},
                        {"full_forwards_per_prompt", full_forwards},
                        {"agreement", agreement},
                        {"unigram_entropy", entropy.to_json()},
                        {"answers", answers}};
    if (gen_ppl.mean >= 0) j["gen_ppl"] = gen_ppl.to_json();
    return j;
}

double DlmQualityReport::median_speedup(size_t i) const {
    auto v = rows.at(i).speedups;
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

nlohmann::json DlmQualityReport::to_json() const {
    nlohmann::json r = nlohmann::json::array();
    for (size_t i = 0; i < rows.size(); ++i) {
        auto j = rows[i].to_json();
        j["median_speedup"] = median_speedup(i);
        j["forward_ratio"] = forward_ratio(i);
        if (rows[0].gen_ppl.mean > 0) j["gen_ppl_change"] = gen_ppl_change(i);
        if (rows[0].entropy.mean > 0) j["entropy_change"] = entropy_change(i);
        r.push_back(j);
    }
    return {{"rows", r},         {"prompts", prompts},         {"prompt_len", prompt_len},
            {"gen_length", gen_length}, {"block_length", block_length}, {"steps", steps},
            {"temperature", temperature}};
}

std::vector<std::vector<int64_t>> dlm_prompts_from(const std::string& path, const DlmConfig& c, int64_t n,
                                                   int64_t len) {
    return token_file_windows(path, n, len, [&c](const std::vector<int64_t>& w) {
        for (auto t : w)
            if (t < 0 || t >= c.vocab_size || t == c.mask_token_id ||
                std::count(c.eos_token_ids.begin(), c.eos_token_ids.end(), t))
                return false;
        return true;
    });
}

DlmQualityReport dlm_quality_bench(DlmModel& model, const std::vector<std::vector<int64_t>>& prompts,
                                   const DlmSampleOptions& o, const std::vector<DlmCache>& modes, uint64_t seed,
                                   Gpt2Model* scorer, const std::function<void(size_t)>& on_prompt) {
    const auto& c = model.config();
    if (prompts.empty()) throw ParamError("prompts", "no prompt to run");
    if (modes.empty()) throw ParamError("cache", "no cache mode given");
    for (auto m : modes) {
        DlmSampleOptions om = o;
        om.cache = m;
        om.validate(c);
    }
    DlmQualityReport rep;
    rep.prompts = static_cast<int64_t>(prompts.size());
    rep.prompt_len = static_cast<int64_t>(prompts.front().size());
    rep.gen_length = o.gen_length, rep.block_length = o.block_length, rep.steps = o.steps;
    rep.temperature = o.temperature_for(c.family);
    rep.rows.resize(modes.size());
    std::vector<std::vector<double>> ent(modes.size()), ppl(modes.size()), agree(modes.size());
    std::vector<double> pos(modes.size(), 0.0);
    for (size_t k = 0; k < prompts.size(); ++k) {
        const auto& p = prompts[k];
        const auto L = static_cast<double>(p.size()) + double(o.gen_length);
        std::vector<int64_t> first;
        double first_s = 0;
        for (size_t m = 0; m < modes.size(); ++m) {
            DlmSampleOptions om = o;
            om.cache = modes[m];
            const auto t0 = std::chrono::steady_clock::now();
            const auto r = dlm_generate(model, p, om, dlm_seeded_draws(seed + k));
            const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            auto& row = rep.rows[m];
            row.cache = modes[m];
            row.seconds.push_back(s);
            if (m == 0) first_s = s, first = r.generated;
            row.speedups.push_back(s > 0 ? first_s / s : 0);
            pos[m] += double(r.positions_computed);
            size_t same = 0;
            for (size_t i = 0; i < std::min(first.size(), r.generated.size()); ++i) same += first[i] == r.generated[i];
            agree[m].push_back(first.empty() ? 1.0 : double(same) / double(first.size()));
            ent[m].push_back(unigram_entropy(r.sequence, r.prompt_tokens));
            if (scorer) ppl[m].push_back(generative_ppl(*scorer, r.sequence, r.prompt_tokens));
            row.answers.push_back(r.generated);
            row.full_forwards += double(r.positions_computed) / L;
        }
        if (on_prompt) on_prompt(k);
    }
    const double n = double(prompts.size());
    for (size_t m = 0; m < modes.size(); ++m) {
        auto& row = rep.rows[m];
        row.positions = pos[m] / n;
        row.full_forwards /= n;
        double a = 0;
        for (auto x : agree[m]) a += x;
        row.agreement = a / n;
        row.entropy = MeanCi::of(ent[m]);
        if (scorer) row.gen_ppl = MeanCi::of(ppl[m]);
    }
    return rep;
}

} // namespace anchor::text
