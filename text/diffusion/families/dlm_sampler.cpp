// Samplers of the published masked-diffusion LMs (dlm_sampler.h).
#include "text/diffusion/families/dlm_sampler.h"

#include "cache/io/error.h"
#include "text/params.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace anchor::text {

const EnumTable<DlmRemask>& dlm_remask_table() {
    static const EnumTable<DlmRemask> t = {{"low_confidence", DlmRemask::LowConfidence},
                                           {"random", DlmRemask::Random},
                                           {"maskgit_plus", DlmRemask::MaskgitPlus},
                                           {"topk_margin", DlmRemask::TopkMargin},
                                           {"entropy", DlmRemask::Entropy},
                                           {"origin", DlmRemask::Origin}};
    return t;
}

const EnumTable<DlmCache>& dlm_cache_table() {
    static const EnumTable<DlmCache> t = {{"off", DlmCache::Off}, {"prefix", DlmCache::Prefix}, {"dual", DlmCache::Dual}};
    return t;
}

DlmDraws dlm_seeded_draws(uint64_t seed) {
    auto gen = std::make_shared<at::Generator>(at::detail::createCPUGenerator(seed));
    return [gen](const std::vector<int64_t>& shape, torch::ScalarType dtype) {
        auto u = at::rand(shape, *gen, torch::kFloat64).to(dtype);
        const double tiny = dtype == torch::kFloat64 ? std::numeric_limits<double>::min()
                                                     : double(std::numeric_limits<float>::min());
        // A float64 uniform within 2^-25 of 1 rounds to 1.0f: -log u = 0 would turn a zero probability's p / q (or
        // Gumbel score) into NaN, which argmax picks; the largest float below 1 keeps such a token unreachable.
        const double below_one =
            dtype == torch::kFloat64 ? std::nextafter(1.0, 0.0) : double(std::nextafter(1.0f, 0.0f));
        return u.clamp(tiny, below_one);
    };
}

double DlmSampleOptions::temperature_for(DlmFamily f) const {
    if (temperature) return *temperature;
    return f == DlmFamily::DiffuGpt ? 0.95 : f == DlmFamily::Dream ? 0.2 : 0.0;
}

std::optional<double> DlmSampleOptions::top_p_for(DlmFamily f) const {
    if (top_p) return top_p;
    if (f == DlmFamily::DiffuGpt) return 0.9;
    if (f == DlmFamily::Dream) return 0.95;
    return std::nullopt;
}

DlmRemask DlmSampleOptions::remask_for(DlmFamily f) const {
    if (remask) return *remask;
    return f == DlmFamily::Dream ? DlmRemask::Entropy : DlmRemask::LowConfidence;
}

void DlmSampleOptions::validate(const DlmConfig& c) const {
    const std::string fam = enum_name(dlm_family_table(), c.family);
    if (gen_length < 1) throw ParamError("gen_length", "must be >= 1, got " + std::to_string(gen_length));
    if (steps < 1) throw ParamError("steps", "must be >= 1, got " + std::to_string(steps));
    const int64_t block = block_length > 0 ? block_length : gen_length;
    if (block_length < 0) throw ParamError("block_length", "must be >= 0, got " + std::to_string(block_length));
    if (c.family == DlmFamily::Llada || diffugpt_blockwise(c)) {
        if (gen_length % block != 0)
            throw ParamError("block_length", "must divide gen_length " + std::to_string(gen_length) + ", got " +
                                                 std::to_string(block));
        if (steps % (gen_length / block) != 0)
            throw ParamError("steps", "must be a multiple of the block count " + std::to_string(gen_length / block) +
                                          ", got " + std::to_string(steps));
    } else if (block != gen_length) {
        throw ParamError("block_length", fam + " decodes the whole answer at once (its reference sampler has no " +
                                             "blocks); leave it unset or equal to gen_length");
    }
    if (cache != DlmCache::Off && c.family != DlmFamily::Llada && !diffugpt_blockwise(c))
        throw ParamError("cache", "'" + enum_name(dlm_cache_table(), cache) + "' applies to block-wise decoding " +
                                      "(LLaDA, DiffuGPT with --block-length); " + fam + " runs with off");
    const DlmRemask r = remask_for(c.family);
    const bool blockwise = c.family == DlmFamily::Llada || diffugpt_blockwise(c);
    const bool ok = blockwise                      ? (r == DlmRemask::LowConfidence || r == DlmRemask::Random)
                    : c.family == DlmFamily::Dream ? (r != DlmRemask::LowConfidence && r != DlmRemask::Random)
                                                   : !remask.has_value();
    if (!ok)
        throw ParamError("remask", "'" + enum_name(dlm_remask_table(), r) + "' is not a rule of " + fam +
                                       "'s sampler (LLaDA and block-wise DiffuGPT: low_confidence, random; Dream: " +
                                       "maskgit_plus, topk_margin, entropy, origin; DiffuGPT: its own)");
    const double t = temperature_for(c.family);
    if (!(t >= 0)) throw ParamError("temperature", "must be >= 0");
    if (auto p = top_p_for(c.family); p && !(*p > 0 && *p <= 1)) throw ParamError("top_p", "must be in (0, 1]");
    if (top_k && *top_k < 1) throw ParamError("top_k", "must be >= 1");
    if (!(eps > 0 && eps < 1)) throw ParamError("eps", "must be in (0, 1)");
    if (alg_temp) {
        if (!(*alg_temp >= 0)) throw ParamError("alg_temp", "must be >= 0");
        if (c.family != DlmFamily::Dream || r == DlmRemask::Origin)
            throw ParamError("alg_temp", "draws the committed positions of Dream's maskgit_plus, topk_margin and " +
                                             std::string("entropy; ") + fam + " with '" +
                                             enum_name(dlm_remask_table(), r) + "' has no such choice");
    }
}

torch::Tensor dlm_top_p(const torch::Tensor& logits, double p) {
    auto sorted = logits.sort(-1, true);
    auto s = std::get<0>(sorted), idx = std::get<1>(sorted);
    auto remove = torch::cumsum(torch::softmax(s, -1), -1) > p;
    // Shift right: the token that crosses p is kept, and always the first.
    auto shifted = torch::zeros_like(remove);
    const int64_t V = remove.size(-1);
    if (V > 1) shifted.narrow(-1, 1, V - 1).copy_(remove.narrow(-1, 0, V - 1));
    auto mask = torch::zeros_like(remove).scatter(-1, idx, shifted);
    return logits.masked_fill(mask, std::numeric_limits<float>::lowest());
}

torch::Tensor dlm_top_k(const torch::Tensor& logits, int64_t k) {
    k = std::min<int64_t>(k, logits.size(-1));
    auto kth = std::get<0>(logits.topk(k, -1)).narrow(-1, k - 1, 1);
    return logits.masked_fill(logits < kth, std::numeric_limits<float>::lowest());
}

namespace {

torch::Tensor dlm_draw(const DlmDraws& draws, const std::vector<int64_t>& shape, torch::ScalarType dt) {
    auto u = draws(shape, dt);
    if (u.sizes().vec() != shape || u.scalar_type() != dt)
        throw Error("diffusion LM sampler: the draw source gave a tensor of another shape or dtype than asked");
    return u;
}

// Gumbel-max: argmax(log p - log(-log u)) is a draw from softmax(scores).
torch::Tensor dlm_gumbel_argmax(const torch::Tensor& scores, const torch::Tensor& u) {
    return (scores - torch::log(-torch::log(u))).argmax(-1);
}

torch::Tensor dlm_shift_right(const torch::Tensor& logits) { // [1, L, V]: row i <- row i - 1, row 0 kept
    const int64_t L = logits.size(1);
    if (L < 2) return logits;
    return torch::cat({logits.narrow(1, 0, 1), logits.narrow(1, 0, L - 1)}, 1);
}

bool dlm_is_eos(const DlmConfig& c, int64_t t) {
    return std::find(c.eos_token_ids.begin(), c.eos_token_ids.end(), t) != c.eos_token_ids.end();
}

} // namespace

torch::Tensor diffugpt_sample(DlmModel& model, const torch::Tensor& x_in, const torch::Tensor& src_mask,
                              int64_t steps, double temperature, double top_p, const DlmDraws& draws) {
    torch::NoGradGuard ng;
    const int64_t mask_id = model.config().mask_token_id;
    auto x = x_in.to(torch::kLong);
    auto maskable = src_mask.to(torch::kBool).logical_not();
    auto xt = x.masked_fill(maskable, mask_id);
    auto propose = [&](const torch::Tensor& xt, const torch::Tensor& maskable) {
        auto logits = model.logits(xt);
        if (temperature > 0) logits = logits / temperature;
        // generate_samples filters with top_p_logits whatever p is (at p = 1 it can still drop a rounding tail).
        auto scores = torch::log_softmax(dlm_top_p(logits, top_p), -1);
        torch::Tensor x0;
        if (temperature > 0)
            x0 = dlm_gumbel_argmax(scores, dlm_draw(draws, scores.sizes().vec(), torch::kFloat32));
        else
            x0 = scores.argmax(-1);
        const int64_t L = x0.size(1);
        if (L > 1) x0 = torch::cat({x.narrow(1, 0, 1), x0.narrow(1, 0, L - 1)}, 1); // the shift
        return torch::where(maskable, x0, xt);
    };
    auto x0 = propose(xt, maskable);
    for (int64_t t = steps - 1; t >= 1; --t) {
        auto u = dlm_draw(draws, x0.sizes().vec(), torch::kFloat32);
        auto move = maskable.logical_and(u < float(1.0 / double(t + 1)));
        xt = torch::where(move, x0, xt);
        maskable = maskable.logical_and(move.logical_not());
        x0 = propose(xt, maskable);
    }
    return x0;
}

torch::Tensor llada_sample(DlmModel& model, const torch::Tensor& prompt, int64_t steps, int64_t gen_length,
                           int64_t block_length, double temperature, DlmRemask remask, const DlmDraws& draws,
                           DlmCache cache, bool stop_at_eos, const DlmBlockCallback& on_block,
                           int64_t* positions_computed, std::optional<double> top_p) {
    torch::NoGradGuard ng;
    const auto& c = model.config();
    const int64_t mask_id = c.mask_token_id, P = prompt.size(1), L = P + gen_length;
    auto x = torch::full({1, L}, mask_id, torch::kLong);
    x.narrow(1, 0, P).copy_(prompt);
    const int64_t nb = gen_length / block_length, spb = steps / nb;
    DlmKvCache kv;
    int64_t computed = 0;
    for (int64_t b = 0; b < nb; ++b) {
        const int64_t lo = P + b * block_length, hi = lo + block_length;
        const int64_t n_mask = x.narrow(1, lo, block_length).eq(mask_id).sum().item<int64_t>();
        for (int64_t i = 0; i < spb; ++i) {
            const int64_t count = n_mask / spb + (i < n_mask % spb ? 1 : 0);
            // The rows this step recomputes; the others keep the K/V of the block's first step (Fast-dLLM).
            int64_t r0 = 0, r1 = L;
            if (cache != DlmCache::Off && i > 0) r0 = lo, r1 = cache == DlmCache::Dual ? hi : L;
            // With the shift (DiffuGPT) position j reads row j - 1: the forward starts a row earlier, so the K/V of
            // the position before the block are recomputed with it.
            const int64_t f0 = c.shift && r0 > 0 ? r0 - 1 : r0;
            auto raw = model.forward(x, f0, r1, cache == DlmCache::Off ? nullptr : &kv); // [1, r1 - f0, V]
            computed += r1 - f0;
            auto logits = !c.shift ? raw : f0 < r0 ? raw.narrow(1, 0, r1 - r0) : dlm_shift_right(raw);
            int64_t s0 = r0, s1 = r1; // the rows sampled (LLaDA's reference draws for every computed row)
            if (c.family == DlmFamily::DiffuGpt) {
                // Only the block's rows can be committed: block-wise DiffuGPT draws for them alone, so every cache mode
                // makes the same draws. Its [MASK] row is an input symbol appended to GPT-2's table, never a training
                // target: it is not proposed (LLaDA's reference keeps its own mask id in the softmax, and so do we).
                logits = logits.narrow(1, lo - r0, hi - lo)
                             .index_fill(-1, torch::tensor({mask_id}, torch::kLong),
                                         -std::numeric_limits<float>::infinity());
                s0 = lo, s1 = hi;
            }
            auto xr = x.narrow(1, s0, s1 - s0);
            auto mask_index = xr.eq(mask_id);
            torch::Tensor x0;
            if (temperature == 0) {
                x0 = logits.argmax(-1);
            } else {
                // generate.py's add_gumbel_noise: exp(l) / (-log u)^T in float64 (argmax-equivalent to Gumbel-max
                // at temperature T).
                auto l64 = (top_p && *top_p < 1 ? dlm_top_p(logits, *top_p) : logits).to(torch::kFloat64);
                auto noise = dlm_draw(draws, l64.sizes().vec(), torch::kFloat64);
                x0 = (l64.exp() / torch::pow(-torch::log(noise), temperature)).argmax(-1);
            }
            torch::Tensor x0_p;
            if (remask == DlmRemask::LowConfidence)
                x0_p = torch::softmax(logits, -1).gather(-1, x0.unsqueeze(-1)).squeeze(-1);
            else
                x0_p = dlm_draw(draws, x0.sizes().vec(), torch::kFloat32);
            if (hi < s1) x0_p.narrow(1, hi - s0, s1 - hi).fill_(-std::numeric_limits<float>::infinity());
            x0 = torch::where(mask_index, x0, xr);
            auto conf = torch::where(mask_index, x0_p,
                                     torch::full_like(x0_p, -std::numeric_limits<float>::infinity()));
            if (count > 0) {
                auto sel = std::get<1>(conf[0].topk(count));
                auto xrow = x[0];
                xrow.index_copy_(0, sel + s0, x0[0].index_select(0, sel));
            }
        }
        if (on_block || stop_at_eos) {
            auto acc = x[0].narrow(0, P, hi - P).contiguous();
            std::vector<int64_t> done(acc.data_ptr<int64_t>(), acc.data_ptr<int64_t>() + acc.numel());
            if (on_block) on_block(done);
            if (stop_at_eos && std::any_of(done.begin(), done.end(), [&](int64_t t) { return dlm_is_eos(c, t); }))
                break;
        }
    }
    if (positions_computed) *positions_computed = computed;
    return x;
}

torch::Tensor dream_sample(DlmModel& model, const torch::Tensor& prompt, int64_t gen_length, int64_t steps, double eps,
                           double temperature, std::optional<double> top_p, std::optional<int64_t> top_k,
                           DlmRemask alg, const DlmDraws& draws, std::optional<double> alg_temp) {
    torch::NoGradGuard ng;
    const int64_t mask_id = model.config().mask_token_id, P = prompt.size(1), L = P + gen_length;
    auto x = torch::full({1, L}, mask_id, torch::kLong);
    x.narrow(1, 0, P).copy_(prompt);
    const auto ts = torch::linspace(1.0, eps, steps + 1, torch::kFloat32);
    // Dream's sample_tokens: confidence and token of each row of logits [n, V].
    auto sample_tokens = [&](torch::Tensor ml) -> std::pair<torch::Tensor, torch::Tensor> {
        if (temperature > 0) ml = ml / temperature;
        if (top_p && *top_p < 1) ml = dlm_top_p(ml, *top_p);
        if (top_k) ml = dlm_top_k(ml, *top_k);
        auto probs = torch::softmax(ml, -1);
        torch::Tensor conf, x0;
        if (temperature > 0) {
            // dists.Categorical(probs).sample(): torch.multinomial(probs / sum, 1), which torch computes as
            // argmax(p / q) with q ~ Exp(1) (its Gumbel-max), q = -log u.
            auto q = torch::log(dlm_draw(draws, probs.sizes().vec(), torch::kFloat32)).neg();
            x0 = (probs / probs.sum(-1, true) / q).argmax(-1);
            conf = probs.gather(-1, x0.unsqueeze(-1)).squeeze(-1);
        } else {
            auto mx = probs.max(-1);
            conf = std::get<0>(mx), x0 = std::get<1>(mx);
        }
        if (alg == DlmRemask::TopkMargin && probs.size(0) > 0) {
            auto sp = std::get<0>(probs.sort(-1, true));
            conf = sp.select(-1, 0) - sp.select(-1, 1);
        }
        if (alg == DlmRemask::Entropy) conf = (probs * torch::log(probs + 1e-10)).sum(-1);
        return {conf, x0};
    };
    for (int64_t i = 0; i < steps; ++i) {
        auto mask_index = x.eq(mask_id);
        auto logits = dlm_shift_right(model.logits(x));
        auto ml = logits.index({mask_index}); // [n_mask, V]
        auto t = ts[i], s = ts[i + 1];
        if (alg == DlmRemask::Origin) {
            auto x0 = torch::full({ml.size(0)}, mask_id, torch::kLong);
            auto u = dlm_draw(draws, {ml.size(0)}, torch::kFloat32);
            auto tr = i < steps - 1 ? u.lt((s / t).neg().add(1)) : u.lt(1.0);
            auto picked = sample_tokens(ml.index({tr})).second;
            x0.index_put_({tr}, picked);
            x.index_put_({mask_index}, x0);
        } else {
            auto [conf, x0] = sample_tokens(ml);
            const int64_t n_mask = mask_index.sum().item<int64_t>();
            int64_t n = n_mask;
            if (i < steps - 1) {
                // int(num_mask * (1 - s / t)) with Dream's float32 arithmetic.
                const float ratio = 1.0f - s.item<float>() / t.item<float>();
                n = static_cast<int64_t>(static_cast<float>(n_mask) * ratio);
            }
            if (n > 0) {
                auto full = torch::full({L}, -std::numeric_limits<float>::infinity());
                full.index_put_({mask_index[0]}, conf);
                torch::Tensor sel;
                if (!alg_temp || *alg_temp == 0) {
                    sel = std::get<1>(full.topk(n));
                } else {
                    // torch.multinomial(softmax(conf / alg_temp), n) without replacement: topk(p / q, n), q ~ Exp(1)
                    // (Gumbel-top-k); positions already committed have p = 0.
                    auto w = torch::softmax(full / *alg_temp, -1);
                    auto q = torch::log(dlm_draw(draws, {1, L}, torch::kFloat32)).neg()[0];
                    sel = std::get<1>((w / q).topk(n));
                }
                auto x_ = torch::full({L}, mask_id, torch::kLong);
                x_.index_put_({mask_index[0]}, x0);
                x[0].index_copy_(0, sel, x_.index_select(0, sel));
            }
        }
    }
    return x;
}

DlmSampleResult dlm_generate(DlmModel& model, const std::vector<int64_t>& prompt, const DlmSampleOptions& o,
                             const DlmDraws& draws, const DlmBlockCallback& on_block) {
    const auto& c = model.config();
    o.validate(c);
    for (auto t : prompt)
        if (t < 0 || t >= c.vocab_size)
            throw ParamError("prompt", "token id " + std::to_string(t) + " outside the model's vocabulary (" +
                                           std::to_string(c.vocab_size) + ")");
    const int64_t P = static_cast<int64_t>(prompt.size());
    if (c.max_positions > 0 && P + o.gen_length > c.max_positions)
        throw ParamError("gen_length", "prompt " + std::to_string(P) + " + answer " + std::to_string(o.gen_length) +
                                           " tokens exceed the model's " + std::to_string(c.max_positions) +
                                           " positions");
    auto p = torch::tensor(prompt, torch::kLong).reshape({1, P});
    DlmSampleResult r;
    r.prompt_tokens = P;
    const double temp = o.temperature_for(c.family);
    torch::Tensor out;
    switch (c.family) {
    case DlmFamily::DiffuGpt: {
        if (P < 1) throw ParamError("prompt", "DiffuGPT needs at least one prompt token (its first position is kept)");
        if (o.diffugpt_blockwise(c)) {
            // LLaDA's semi-autoregressive blocks and low-confidence remasking with the shift, so that Fast-dLLM's
            // prefix and dual caches apply (dlm_sampler.h).
            const int64_t block = o.block_length > 0 ? o.block_length : o.gen_length;
            out = llada_sample(model, p, o.steps, o.gen_length, block, temp, o.remask_for(DlmFamily::Llada), draws,
                               o.cache, o.stop_at_eos, on_block, &r.positions_computed, o.top_p_for(c.family));
            r.steps_run = o.steps;
            break;
        }
        auto x = torch::cat({p, torch::zeros({1, o.gen_length}, torch::kLong)}, 1);
        auto src = torch::zeros({1, P + o.gen_length}, torch::kBool);
        src.narrow(1, 0, P).fill_(true);
        out = diffugpt_sample(model, x, src, o.steps, temp, o.top_p_for(c.family).value_or(1.0), draws);
        r.steps_run = o.steps;
        r.positions_computed = o.steps * (P + o.gen_length);
        if (on_block) on_block(std::vector<int64_t>(out.data_ptr<int64_t>() + P, out.data_ptr<int64_t>() + out.numel()));
        break;
    }
    case DlmFamily::Llada: {
        const int64_t block = o.block_length > 0 ? o.block_length : o.gen_length;
        out = llada_sample(model, p, o.steps, o.gen_length, block, temp, o.remask_for(c.family), draws, o.cache,
                           o.stop_at_eos, on_block, &r.positions_computed);
        r.steps_run = o.steps;
        break;
    }
    case DlmFamily::Dream:
        out = dream_sample(model, p, o.gen_length, o.steps, o.eps, temp, o.top_p_for(c.family), o.top_k,
                           o.remask_for(c.family), draws, o.alg_temp);
        r.steps_run = o.steps;
        r.positions_computed = o.steps * (P + o.gen_length);
        if (on_block) on_block(std::vector<int64_t>(out.data_ptr<int64_t>() + P, out.data_ptr<int64_t>() + out.numel()));
        break;
    }
    out = out.contiguous();
    r.sequence.assign(out.data_ptr<int64_t>(), out.data_ptr<int64_t>() + out.numel());
    r.generated.assign(r.sequence.begin() + P, r.sequence.end());
    if (o.stop_at_eos) {
        auto it = std::find_if(r.generated.begin(), r.generated.end(), [&](int64_t t) { return dlm_is_eos(c, t); });
        r.generated.erase(it, r.generated.end());
    }
    // Masks left (an answer cut by stop_at_eos after its block) are not text.
    r.generated.erase(std::remove(r.generated.begin(), r.generated.end(), c.mask_token_id), r.generated.end());
    return r;
}

} // namespace anchor::text
