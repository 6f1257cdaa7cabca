#include "text/diffusion/mdlm_sampler.h"

#include "cache/io/enum_table.h"
#include "cache/io/error.h"
#include "text/params.h"

#include <cmath>

#include <chrono>

namespace anchor::text {

const EnumTable<UnmaskRule>& unmask_rule_table() {
    static const EnumTable<UnmaskRule> t = {{"ancestral", UnmaskRule::Ancestral},
                                            {"confidence", UnmaskRule::Confidence},
                                            {"margin", UnmaskRule::Margin},
                                            {"entropy", UnmaskRule::Entropy},
                                            {"random", UnmaskRule::Random}};
    return t;
}

std::string unmask_rule_name(UnmaskRule r) {
    return enum_name(unmask_rule_table(), r);
}

void SamplerOptions::validate() const {
    const int64_t P = static_cast<int64_t>(prompt.size());
    if (length <= 0) throw ParamError("length", "must be positive, got " + std::to_string(length));
    if (P >= length)
        throw ParamError("prompt", "(" + std::to_string(P) + " tokens) leaves nothing to generate in length " +
                                       std::to_string(length));
    if (steps <= 0) throw ParamError("steps", "must be positive, got " + std::to_string(steps));
    if (!(temperature >= 0) || !std::isfinite(temperature))
        throw ParamError("temperature", "must be a finite number >= 0");
    if (top_k < 0) throw ParamError("top_k", "must be >= 0, got " + std::to_string(top_k));
    if (!(top_p > 0 && top_p <= 1)) throw ParamError("top_p", "must be in (0, 1]");
    if (!(min_p >= 0 && min_p <= 1)) throw ParamError("min_p", "must be in [0, 1]");
    if (block_length < 0) throw ParamError("block_length", "must be >= 0, got " + std::to_string(block_length));
    if (!(threshold >= 0 && threshold <= 1)) throw ParamError("threshold", "must be in [0, 1] (0 = off)");
    if (!(factor >= 0) || !std::isfinite(factor)) throw ParamError("factor", "must be a finite number >= 0 (0 = off)");
    if (threshold > 0 && factor > 0) throw ParamError("threshold", "and factor exclude each other: give one");
    if ((threshold > 0 || factor > 0) && rule == UnmaskRule::Ancestral)
        throw ParamError(threshold > 0 ? "threshold" : "factor",
                         "needs a ranking rule (confidence, margin, entropy or random), not ancestral unmasking");
    const int64_t gen = length - P;
    const int64_t bl = block_length > 0 ? std::min(block_length, gen) : gen;
    const int64_t nb = (gen + bl - 1) / bl;
    if (steps % nb != 0)
        throw ParamError("steps", std::to_string(steps) + " must be a multiple of the number of blocks " +
                                      std::to_string(nb) + " (" + std::to_string(gen) +
                                      " generated tokens / block_length " + std::to_string(bl) + ")");
    for (auto id : prompt)
        if (id < 0 || id >= kMdlmMaskId) throw ParamError("prompt", "id " + std::to_string(id) + " out of range");
}

std::vector<int64_t> confidence_schedule(int64_t n, int64_t steps) {
    std::vector<int64_t> k(static_cast<size_t>(steps), n / steps);
    for (int64_t i = 0; i < n % steps; ++i) k[static_cast<size_t>(i)]++;
    return k;
}

int64_t parallel_count(const torch::Tensor& confidence, double threshold, double factor) {
    const int64_t m = confidence.size(0);
    if (m == 0 || (threshold <= 0 && factor <= 0)) return 0;
    if (threshold > 0) return std::max<int64_t>(1, (confidence > threshold).sum().item<int64_t>());
    auto c = std::get<0>(torch::sort(confidence.to(torch::kFloat64), 0, true));
    auto acc = c.accessor<double, 1>();
    int64_t n = 1; // the first is always decoded
    while (n < m && acc[n] >= 1.0 - factor / double(n + 2)) ++n;
    return n;
}

torch::Tensor selection_score(UnmaskRule rule, TokenCandidates& drawn, at::Generator& gen) {
    switch (rule) {
    case UnmaskRule::Margin: {
        auto p = drawn.probabilities();
        p = p / p.sum(1, true);
        auto top2 = std::get<0>(torch::topk(p, std::min<int64_t>(2, p.size(1)), 1));
        return top2.size(1) > 1 ? top2.select(1, 0) - top2.select(1, 1) : top2.select(1, 0);
    }
    case UnmaskRule::Entropy: {
        auto p = drawn.probabilities();
        p = p / p.sum(1, true);
        return torch::xlogy(p, p).sum(1); // -entropy
    }
    case UnmaskRule::Random:
        return torch::rand({drawn.rows()}, gen, torch::kFloat64);
    default:
        return drawn.confidence;
    }
}

// The samplers' token chain over the rows of the positions they decode: top-k (masking, ties kept) before the
// temperature, then torch::multinomial on the sampler's own generator (so the unmasking draws and the token draws
// share one stream, in a fixed order), or the argmax at temperature 0; confidence = the chosen token's probability.
// This order keeps every draw bit for bit what it was before the chain existed (the cut is the same either way).
namespace {
SamplerChain mdlm_token_chain(const SamplerOptions& o, const at::Generator& gen) {
    SamplerChain chain(CandidateLayout::Masked);
    if (o.top_k > 0) chain.add(top_k_step(o.top_k));
    if (o.temperature <= 0) {
        chain.add(greedy_step());
        return chain;
    }
    chain.add(temperature_step(o.temperature));
    if (o.top_p < 1.0) chain.add(top_p_step(o.top_p));
    if (o.min_p > 0.0) chain.add(min_p_step(o.min_p));
    chain.add(multinomial_step(gen));
    return chain;
}
} // namespace

SampleResult sample(MdlmDenoiser& den, const SamplerOptions& opt, const StepCallback& on_step) {
    opt.validate();
    auto t_start = std::chrono::steady_clock::now();
    auto& model = den.model();
    const int64_t L = opt.length, P = static_cast<int64_t>(opt.prompt.size());
    const int64_t gen_len = L - P;
    const int64_t bl = opt.block_length > 0 ? std::min(opt.block_length, gen_len) : gen_len;
    const int64_t n_blocks = (gen_len + bl - 1) / bl;
    const int64_t S = opt.steps / n_blocks;
    const int64_t mask = model->internal_mask_id();

    auto ids = torch::full({L}, mask, torch::kInt64);
    if (P > 0) ids.narrow(0, 0, P).copy_(model->to_internal(torch::tensor(opt.prompt, torch::kInt64)));
    auto gen = at::detail::createCPUGenerator(opt.seed);
    auto chain = mdlm_token_chain(opt, gen);
    den.reset(L);
    den.set_total_steps(opt.steps);

    SampleResult res;
    std::vector<int64_t> ext(static_cast<size_t>(L));
    auto refresh_ext = [&] {
        auto e = model->to_external(ids);
        auto acc = e.accessor<int64_t, 1>();
        for (int64_t i = 0; i < L; ++i) ext[static_cast<size_t>(i)] = acc[i];
    };
    int64_t step = 0;
    const bool parallel = opt.threshold > 0 || opt.factor > 0;
    for (int64_t b = 0; b < n_blocks; ++b) {
        const int64_t lo = P + b * bl, hi = std::min(L, lo + bl);
        den.begin_block(lo, hi);
        auto in_block = torch::zeros({L}, torch::kBool);
        in_block.narrow(0, lo, hi - lo).fill_(true);
        const int64_t n_masked0 = (ids.eq(mask) & in_block).sum().item<int64_t>();
        auto schedule = confidence_schedule(n_masked0, S);
        for (int64_t j = 0; j < S; ++j, ++step) {
            const double t = 1.0 - double(j) / double(S), s = 1.0 - double(j + 1) / double(S);
            auto pos = torch::nonzero(ids.eq(mask) & in_block).reshape(-1);
            int64_t unmasked = 0;
            if (pos.size(0) > 0 && opt.rule == UnmaskRule::Ancestral) {
                // MDLM's reverse step keeps a masked token masked with probability (1 - alpha_s) / (1 - alpha_t),
                // whatever x_theta says (Sahoo et al. 2024, eq. 7), so the unmasking draw comes first and only the
                // positions it picks need logits; a step that unmasks nothing needs no forward pass at all. Same
                // distribution as drawing x0 everywhere and discarding it, at a fraction of the cost.
                const double p = j == S - 1 ? 1.0 : (t - s) / t;
                auto u = torch::rand({pos.size(0)}, gen, torch::kFloat64);
                auto chosen = pos.index_select(0, torch::nonzero(u < p).reshape(-1));
                if (chosen.size(0) > 0) {
                    auto drawn = chain.apply(den.logits(ids, t, step, chosen));
                    ids.index_copy_(0, chosen, drawn.selected);
                    unmasked = chosen.size(0);
                    res.forward_passes++;
                }
            } else if (pos.size(0) > 0) {
                auto drawn = chain.apply(den.logits(ids, t, step, pos), /*want_confidence=*/true);
                int64_t k = std::min<int64_t>(schedule[static_cast<size_t>(j)], pos.size(0));
                if (j == S - 1) k = pos.size(0);
                if (parallel) k = std::max(k, parallel_count(drawn.confidence, opt.threshold, opt.factor));
                const auto score = selection_score(opt.rule, drawn, gen);
                auto chosen = std::get<1>(torch::topk(score, k, 0, true, true));
                ids.index_copy_(0, pos.index_select(0, chosen), drawn.selected.index_select(0, chosen));
                unmasked = chosen.size(0);
                res.forward_passes++;
            } else {
                // Nothing left to decode in this block: the step is still counted (the schedule is fixed).
            }
            res.unmasked_per_step.push_back(unmasked);
            if (on_step) {
                refresh_ext();
                StepInfo info;
                info.step = step, info.block = b, info.local_step = j, info.t = t, info.s = s;
                info.unmasked = unmasked, info.tokens = &ext;
                on_step(info);
            }
        }
    }
    refresh_ext();
    res.tokens = ext;
    res.cache = den.stats();
    res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    return res;
}

} // namespace anchor::text
