#include "text/mdlm_bench.h"

#include "cache/util/bench.h"
#include "text/gpt2_model.h"
#include "text/mdlm_run.h"
#include "text/params.h"
#include "text/token_file.h"

#include <optional>

namespace anchor::text {

namespace {
MdlmModel random_model(int64_t layers, int64_t dim, uint64_t seed) {
    MdlmConfig c;
    c.n_blocks = layers;
    c.hidden_size = dim;
    c.n_heads = std::max<int64_t>(1, dim / 64);
    c.cond_dim = 128;
    MdlmModel m(c);
    randomize_mdlm_weights(m, seed);
    m->eval();
    return m;
}

// Windows of a token file (e.g. held-out text), else random tokens of the model's vocabulary.
std::vector<std::vector<int64_t>> bench_prompts(const DiffusionBenchParams& p, const MdlmModel& model) {
    if (!p.prompts_from.empty())
        return token_file_windows(p.prompts_from, p.repeats, p.prompt_len,
                                  [model](const std::vector<int64_t>& w) { return model->in_vocabulary(w); });
    std::vector<std::vector<int64_t>> prompts;
    const auto& cfg = model->config();
    for (int64_t r = 0; r < p.repeats; ++r) {
        auto gen = at::detail::createCPUGenerator(1000 + static_cast<uint64_t>(r));
        auto pr = torch::randint(0, 50257, {p.prompt_len}, gen, torch::kInt64);
        if (cfg.compact_vocab)
            pr = model->vocab_ids.index_select(
                0, torch::randint(0, cfg.vocab_size - 1, {p.prompt_len}, gen, torch::kInt64));
        prompts.emplace_back(pr.data_ptr<int64_t>(), pr.data_ptr<int64_t>() + p.prompt_len);
    }
    return prompts;
}
} // namespace

void DiffusionBenchParams::validate() const {
    if (n_heads < 0) throw ParamError("n_heads", "must be >= 0, got " + std::to_string(n_heads));
    if (model.empty() && (layers < 1 || dim < 1))
        throw ParamError("layers", "and dim of the random model must be >= 1, got " + std::to_string(layers) + " x " +
                                       std::to_string(dim));
    if (repeats < 1) throw ParamError("repeats", "must be >= 1, got " + std::to_string(repeats));
    if (steps.empty()) throw ParamError("steps", "is empty: give at least one step count");
    if (caches.empty()) throw ParamError("caches", "is empty: give at least one cache mode to measure");
    if (prompt_len < 0) throw ParamError("prompt_len", "must be >= 0, got " + std::to_string(prompt_len));
    SamplerOptions so;
    so.length = length;
    so.prompt.assign(static_cast<size_t>(prompt_len), 0);
    so.rule = unmask;
    so.temperature = temperature;
    for (auto T : steps) so.steps = T, so.validate();
}

nlohmann::json DiffusionBenchRow::to_json() const {
    nlohmann::json o = {{"cache", cache},
                        {"steps", steps},
                        {"off_s", off_s.to_json()},
                        {"cached_s", cached_s.to_json()},
                        {"speedup_median", speedup()},
                        {"reused_fraction", reused},
                        {"token_agreement", agreement},
                        {"store", cache::to_json(store)}};
    if (gen_ppl_off >= 0) o["gen_ppl_off"] = gen_ppl_off, o["gen_ppl_cached"] = gen_ppl_cached;
    return o;
}

nlohmann::json DiffusionBenchReport::to_json() const {
    nlohmann::json j;
    j["model"] = model;
    j["config"] = config;
    j["length"] = length;
    j["prompt_len"] = prompt_len;
    j["prompts"] = prompts;
    j["unmask"] = unmask_rule_name(unmask);
    j["temperature"] = temperature;
    j["repeats"] = repeats;
    j["threads"] = threads;
    if (!score_with.empty()) j["score_with"] = score_with;
    for (const auto& r : rows) j["rows"].push_back(r.to_json());
    return j;
}

DiffusionBenchReport
run_diffusion_bench(const DiffusionBenchParams& p,
                    const std::function<void(const DiffusionBenchReport&, const DiffusionBenchRow*)>& progress) {
    p.validate();
    auto model = p.model.empty() ? random_model(p.layers, p.dim, p.seed) : load_mdlm(p.model, p.n_heads);
    std::optional<LoadedGpt2> scorer;
    if (!p.score_with.empty()) scorer = load_gpt2(p.score_with);
    const auto prompts = bench_prompts(p, model);
    DiffusionBenchReport rep;
    rep.model = p.model.empty() ? "random" : p.model;
    rep.config = model->config().to_json();
    rep.length = p.length;
    rep.prompt_len = p.prompt_len;
    rep.repeats = p.repeats;
    rep.prompts = p.prompts_from.empty() ? "random tokens" : p.prompts_from;
    rep.unmask = p.unmask;
    rep.temperature = p.temperature;
    rep.threads = at::get_num_threads();
    rep.score_with = p.score_with;
    rep.load_start = util::load_average();
    if (progress) progress(rep, nullptr);
    auto gen_ppl = [&](const std::vector<int64_t>& toks) { return generative_ppl(scorer->model, toks, p.prompt_len); };
    const size_t nc = p.caches.size();
    const double R = double(p.repeats);
    for (auto T : p.steps) {
        // Off runs once per repeat; every cache mode is measured against the same runs, interleaved per repeat.
        std::vector<double> toff;
        std::vector<std::vector<double>> tc(nc);
        std::vector<DiffusionBenchRow> rows(nc);
        std::vector<double> ppl_cached(nc, 0.0);
        double ppl_off = 0;
        for (int64_t r = 0; r < p.repeats; ++r) {
            SamplerOptions so;
            so.length = p.length;
            so.steps = T;
            so.rule = p.unmask;
            so.seed = p.seed + static_cast<uint64_t>(r);
            so.temperature = p.temperature;
            so.prompt = prompts[static_cast<size_t>(r)];
            MdlmDenoiser off(model, CacheSpec{});
            auto ro = sample(off, so);
            toff.push_back(ro.seconds);
            if (scorer) ppl_off += gen_ppl(ro.tokens) / R;
            for (size_t k = 0; k < nc; ++k) {
                MdlmDenoiser anc(model, p.caches[k]);
                auto ra = sample(anc, so);
                tc[k].push_back(ra.seconds);
                rows[k].reused += ra.cache.reused_fraction() / R;
                rows[k].agreement += token_agreement(ro.tokens, ra.tokens, p.prompt_len) / R;
                rows[k].store += ra.store;
                if (scorer) ppl_cached[k] += gen_ppl(ra.tokens) / R;
            }
        }
        for (size_t k = 0; k < nc; ++k) {
            auto& row = rows[k];
            row.cache = p.caches[k].to_string();
            row.steps = T;
            row.off_s = Spread::of(toff);
            row.cached_s = Spread::of(tc[k]);
            if (scorer) row.gen_ppl_off = ppl_off, row.gen_ppl_cached = ppl_cached[k];
            rep.rows.push_back(row);
            if (progress) progress(rep, &rep.rows.back());
        }
    }
    rep.load_end = util::load_average();
    return rep;
}

} // namespace anchor::text
