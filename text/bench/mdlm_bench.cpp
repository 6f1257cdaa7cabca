#include "text/bench/mdlm_bench.h"

#include "cache/util/bench.h"
#include "kernels/gemv.h"
#include "text/gpt2/gpt2_model.h"
#include "text/diffusion/mdlm_run.h"
#include "text/params.h"
#include "text/token_file.h"

#include <cmath>
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
    placement.validate();
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
    so.block_length = block_length;
    for (auto T : steps) {
        so.steps = T;
        for (const auto* d : {&baseline}) {
            SamplerOptions o = so;
            d->apply(o);
            o.validate();
        }
        for (const auto& d : caches) {
            SamplerOptions o = so;
            d.apply(o);
            o.validate();
        }
    }
}

MeanCi MeanCi::of(const std::vector<double>& v) {
    MeanCi m;
    if (v.empty()) return m;
    double s = 0, s2 = 0;
    for (double x : v) s += x;
    m.mean = s / double(v.size());
    for (double x : v) s2 += (x - m.mean) * (x - m.mean);
    if (v.size() > 1) m.ci95 = 1.96 * std::sqrt(s2 / double(v.size() - 1) / double(v.size()));
    return m;
}

nlohmann::json DiffusionBenchRow::to_json() const {
    nlohmann::json o = {{"cache", cache},
                        {"resolved", resolved},
                        {"steps", steps},
                        {"off_s", off_s.to_json()},
                        {"cached_s", cached_s.to_json()},
                        {"speedup_median", speedup()},
                        {"speedup_per_prompt", speedups.to_json()},
                        {"reused_fraction", reused},
                        {"token_agreement", agreement},
                        {"forward_passes_off", forwards_off},
                        {"forward_passes_cached", forwards_cached},
                        {"unigram_entropy_off", entropy_off.to_json()},
                        {"unigram_entropy_cached", entropy_cached.to_json()},
                        {"store", cache::to_json(store)}};
    if (gen_ppl_off.mean >= 0) o["gen_ppl_off"] = gen_ppl_off.to_json(), o["gen_ppl_cached"] = gen_ppl_cached.to_json();
    return o;
}

nlohmann::json DiffusionBenchReport::to_json() const {
    nlohmann::json j;
    j["model"] = model;
    j["config"] = config;
    j["length"] = length;
    j["prompt_len"] = prompt_len;
    j["prompts"] = prompts;
    j["baseline"] = baseline;
    j["unmask"] = unmask_rule_name(unmask);
    j["temperature"] = temperature;
    j["repeats"] = repeats;
    j["threads"] = threads;
    j["kernels"] = kernels;
    if (!score_with.empty()) j["score_with"] = score_with;
    for (const auto& r : rows) j["rows"].push_back(r.to_json());
    return j;
}

DiffusionBenchReport
run_diffusion_bench(const DiffusionBenchParams& p,
                    const std::function<void(const DiffusionBenchReport&, const DiffusionBenchRow*)>& progress) {
    p.validate();
    auto model = p.model.empty() ? random_model(p.layers, p.dim, p.seed) : load_mdlm(p.model, p.n_heads);
    configure_mdlm(model, p.attention, p.placement, p.gemm);
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
    rep.baseline = p.baseline.display();
    rep.unmask = p.unmask;
    rep.temperature = p.temperature;
    rep.threads = at::get_num_threads();
    const int64_t streamed = few_rows_limit(p.gemm);
    rep.kernels = "gemm " + enum_name(kernels::gemm_backend_table(), p.gemm) +
                  (streamed > 0 ? " (<= " + std::to_string(streamed) + " rows: " + kernels::gemv_isa() + ")" : "") +
                  ", attention " + enum_name(kernels::attention_kernel_table(), p.attention);
    rep.score_with = p.score_with;
    rep.load_start = util::load_average();
    if (progress) progress(rep, nullptr);
    auto gen_ppl = [&](const std::vector<int64_t>& toks) { return generative_ppl(scorer->model, toks, p.prompt_len); };
    const size_t nc = p.caches.size();
    const double R = double(p.repeats);
    for (auto T : p.steps) {
        // The baseline runs once per repeat; every mode is measured against the same runs, interleaved per repeat.
        std::vector<double> toff, ppl_off, ent_off;
        double fwd_off = 0;
        std::vector<std::vector<double>> tc(nc), ratio(nc), ppl_c(nc), ent_c(nc);
        std::vector<DiffusionBenchRow> rows(nc);
        for (int64_t r = 0; r < p.repeats; ++r) {
            SamplerOptions so;
            so.length = p.length;
            so.steps = T;
            so.rule = p.unmask;
            so.seed = p.seed + static_cast<uint64_t>(r);
            so.temperature = p.temperature;
            so.block_length = p.block_length;
            so.prompt = prompts[static_cast<size_t>(r)];
            SamplerOptions base = so;
            p.baseline.apply(base);
            MdlmDenoiser off(model, p.baseline.cache);
            const auto ro = [&] {
                GemmScope gemm(model, p.baseline, p.gemm);
                return sample(off, base);
            }();
            toff.push_back(ro.seconds);
            fwd_off += double(ro.forward_passes) / R;
            ent_off.push_back(unigram_entropy(ro.tokens, p.prompt_len));
            if (scorer) ppl_off.push_back(gen_ppl(ro.tokens));
            for (size_t k = 0; k < nc; ++k) {
                SamplerOptions o = so;
                p.caches[k].apply(o);
                MdlmDenoiser anc(model, p.caches[k].cache);
                const auto ra = [&] {
                    GemmScope gemm(model, p.caches[k], p.gemm);
                    return sample(anc, o);
                }();
                tc[k].push_back(ra.seconds);
                ratio[k].push_back(ro.seconds / ra.seconds);
                rows[k].reused += ra.cache.reused_fraction() / R;
                rows[k].agreement += token_agreement(ro.tokens, ra.tokens, p.prompt_len) / R;
                rows[k].forwards_cached += double(ra.forward_passes) / R;
                rows[k].store += ra.cache;
                ent_c[k].push_back(unigram_entropy(ra.tokens, p.prompt_len));
                if (scorer) ppl_c[k].push_back(gen_ppl(ra.tokens));
            }
        }
        for (size_t k = 0; k < nc; ++k) {
            auto& row = rows[k];
            row.cache = p.caches[k].display();
            row.resolved = p.caches[k].to_string();
            row.steps = T;
            row.off_s = Spread::of(toff);
            row.cached_s = Spread::of(tc[k]);
            row.speedups = Spread::of(ratio[k]);
            row.forwards_off = fwd_off;
            row.entropy_off = MeanCi::of(ent_off);
            row.entropy_cached = MeanCi::of(ent_c[k]);
            if (scorer) row.gen_ppl_off = MeanCi::of(ppl_off), row.gen_ppl_cached = MeanCi::of(ppl_c[k]);
            rep.rows.push_back(row);
            if (progress) progress(rep, &rep.rows.back());
        }
    }
    rep.load_end = util::load_average();
    return rep;
}

} // namespace anchor::text
