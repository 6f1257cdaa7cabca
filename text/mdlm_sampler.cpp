#include "text/mdlm_sampler.h"

#include "cache/io/enum_table.h"
#include "cache/io/error.h"

#include <chrono>

namespace anchor::text {

const std::vector<std::pair<std::string, UnmaskRule>>& unmask_rule_table() {
    static const std::vector<std::pair<std::string, UnmaskRule>> t = {{"ancestral", UnmaskRule::Ancestral},
                                                                      {"confidence", UnmaskRule::Confidence}};
    return t;
}

UnmaskRule unmask_rule_from_string(const std::string& s) {
    return enum_from_string(unmask_rule_table(), s, "unmasking rule");
}

std::string unmask_rule_name(UnmaskRule r) {
    return enum_name(unmask_rule_table(), r);
}

void SamplerOptions::validate() const {
    const int64_t P = static_cast<int64_t>(prompt.size());
    if (length <= 0) throw UsageError("--length must be positive");
    if (P >= length)
        throw UsageError("the prompt (" + std::to_string(P) + " tokens) leaves nothing to generate in --length " +
                         std::to_string(length));
    if (steps <= 0) throw UsageError("--steps must be positive");
    if (temperature < 0) throw UsageError("--temperature must be >= 0");
    if (top_k < 0) throw UsageError("--top-k must be >= 0");
    if (block_length < 0) throw UsageError("--block-length must be >= 0");
    const int64_t gen = length - P;
    const int64_t bl = block_length > 0 ? std::min(block_length, gen) : gen;
    const int64_t nb = (gen + bl - 1) / bl;
    if (steps % nb != 0)
        throw UsageError("--steps " + std::to_string(steps) + " must be a multiple of the number of blocks " +
                         std::to_string(nb) + " (" + std::to_string(gen) + " generated tokens / block length " +
                         std::to_string(bl) + ")");
    for (auto id : prompt)
        if (id < 0 || id >= kMdlmMaskId) throw UsageError("prompt id " + std::to_string(id) + " out of range");
}

std::vector<int64_t> confidence_schedule(int64_t n, int64_t steps) {
    std::vector<int64_t> k(static_cast<size_t>(steps), n / steps);
    for (int64_t i = 0; i < n % steps; ++i) k[static_cast<size_t>(i)]++;
    return k;
}

namespace {
// Draws x0 for each row of logits [n, V] (temperature, top-k) and returns it with its probability (confidence).
void draw(const torch::Tensor& logits_in, double temperature, int64_t top_k, at::Generator& gen, torch::Tensor& x0,
          torch::Tensor& conf) {
    auto logits = logits_in.to(torch::kFloat64);
    if (top_k > 0 && top_k < logits.size(1)) {
        auto kth = std::get<0>(torch::topk(logits, top_k, 1)).narrow(1, top_k - 1, 1);
        logits = logits.masked_fill(logits < kth, -std::numeric_limits<double>::infinity());
    }
    if (temperature <= 0) {
        x0 = logits.argmax(1);
        conf = torch::softmax(logits, 1).gather(1, x0.unsqueeze(1)).squeeze(1);
        return;
    }
    auto probs = torch::softmax(logits / temperature, 1);
    x0 = torch::multinomial(probs, 1, false, gen).squeeze(1);
    conf = probs.gather(1, x0.unsqueeze(1)).squeeze(1);
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
    for (int64_t b = 0; b < n_blocks; ++b) {
        const int64_t lo = P + b * bl, hi = std::min(L, lo + bl);
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
                    auto logits = den.logits(ids, t, step, chosen);
                    torch::Tensor x0, conf;
                    draw(logits, opt.temperature, opt.top_k, gen, x0, conf);
                    ids.index_copy_(0, chosen, x0);
                    unmasked = chosen.size(0);
                    res.forward_passes++;
                }
            } else if (pos.size(0) > 0) {
                auto logits = den.logits(ids, t, step, pos);
                torch::Tensor x0, conf;
                draw(logits, opt.temperature, opt.top_k, gen, x0, conf);
                int64_t k = std::min<int64_t>(schedule[static_cast<size_t>(j)], pos.size(0));
                if (j == S - 1) k = pos.size(0);
                auto chosen = std::get<1>(torch::topk(conf, k, 0, true, true));
                ids.index_copy_(0, pos.index_select(0, chosen), x0.index_select(0, chosen));
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
    res.store = den.store_stats();
    res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    return res;
}

} // namespace anchor::text
