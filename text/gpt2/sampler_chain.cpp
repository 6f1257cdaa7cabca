#include "text/gpt2/sampler_chain.h"

#include "cache/io/error.h"
#include "text/params.h"

#include <cmath>
#include <limits>
#include <set>
#include <sstream>

namespace anchor::text {

namespace {
constexpr double kNegInf = -std::numeric_limits<double>::infinity();

std::string fmt(double v) {
    std::ostringstream os;
    os << v;
    return os.str();
}
} // namespace

// ---- candidates ----------------------------------------------------------------------------------------------------

TokenCandidates TokenCandidates::from_logits(const torch::Tensor& logits, CandidateLayout layout) {
    if (!(logits.dim() == 1 || logits.dim() == 2) || !logits.is_floating_point() || logits.size(-1) < 1)
        throw Error("sampler: logits must be a floating-point [V] or [n, V], got " + shape_str(logits.sizes().vec()));
    if (layout == CandidateLayout::Sorted && logits.dim() == 2 && logits.size(0) != 1)
        throw Error("sampler: the sorted layout takes one row, got " + shape_str(logits.sizes().vec()));
    TokenCandidates c;
    c.layout = layout;
    c.logits = logits.dim() == 1 ? logits.unsqueeze(0) : logits;
    return c;
}

void TokenCandidates::to_f64() {
    if (logits.scalar_type() != torch::kFloat64) logits = logits.to(torch::kFloat64);
}

void TokenCandidates::sort() {
    if (sorted) return;
    to_f64();
    // One row sorted as a 1-D tensor, as GPT-2's sampler always did (the same sort, the same order of ties).
    auto s = rows() == 1 ? logits[0].sort(0, true) : logits.sort(1, true);
    auto vals = std::get<0>(s), idx = std::get<1>(s);
    if (rows() == 1) vals = vals.unsqueeze(0), idx = idx.unsqueeze(0);
    ids = ids.defined() ? ids.gather(1, idx) : idx;
    if (probs.defined()) probs = probs.gather(1, idx);
    logits = vals;
    sorted = true;
}

torch::Tensor TokenCandidates::probabilities() {
    if (!probs.defined()) {
        to_f64();
        // One row as a 1-D tensor (GPT-2's sampler), rows otherwise (the MDLM samplers).
        probs = rows() == 1 && layout == CandidateLayout::Sorted ? torch::softmax(logits[0], 0).unsqueeze(0)
                                                                 : torch::softmax(logits, 1);
    }
    return probs;
}

torch::Tensor TokenCandidates::token_of(const torch::Tensor& column) const {
    return ids.defined() ? ids.gather(1, column.unsqueeze(1)).squeeze(1) : column;
}

void TokenCandidates::keep_prefix(const std::vector<int64_t>& keep) {
    bool same = true;
    for (auto k : keep) same = same && k == keep[0];
    if (same) {
        logits = logits.narrow(1, 0, keep[0]);
        ids = ids.narrow(1, 0, keep[0]);
        if (probs.defined()) probs = probs.narrow(1, 0, keep[0]);
        return;
    }
    auto col = torch::arange(width(), torch::kInt64).view({1, width()});
    mask(col >= torch::tensor(keep, torch::kInt64).view({rows(), 1}));
}

void TokenCandidates::mask(const torch::Tensor& removed) {
    to_f64();
    logits = logits.masked_fill(removed, kNegInf);
    if (probs.defined()) probs = probs.masked_fill(removed, 0.0);
}

// ---- steps ---------------------------------------------------------------------------------------------------------

namespace {

class RepetitionPenalty final : public SamplerStep {
public:
    RepetitionPenalty(double penalty, int64_t last_n) : penalty_(penalty), last_n_(last_n) {
        if (!(penalty > 0) || !std::isfinite(penalty))
            throw ParamError("repeat_penalty", "must be a finite number > 0, got " + fmt(penalty));
        if (last_n < 0) throw ParamError("repeat_last_n", "must be >= 0, got " + std::to_string(last_n));
    }
    std::string name() const override { return "repetition_penalty(" + fmt(penalty_) + ")"; }
    void apply(TokenCandidates& c) override {
        if (recent_.empty()) return;
        c.to_f64();
        std::set<int64_t> tokens(recent_.begin(), recent_.end());
        auto l = c.logits.clone();
        auto acc = l.accessor<double, 2>();
        for (int64_t r = 0; r < c.rows(); ++r) {
            const int64_t* ids = c.ids.defined() ? c.ids[r].contiguous().data_ptr<int64_t>() : nullptr;
            for (int64_t j = 0; j < c.width(); ++j) {
                const int64_t tok = ids ? ids[j] : j;
                if (!tokens.count(tok)) continue;
                double& v = acc[r][j];
                v = v > 0 ? v / penalty_ : v * penalty_;
            }
        }
        c.logits = l;
        c.probs = torch::Tensor();
        c.sorted = false; // the order may have changed
    }
    void accept(int64_t token) override {
        if (last_n_ == 0) return;
        recent_.push_back(token);
        while (static_cast<int64_t>(recent_.size()) > last_n_) recent_.pop_front();
    }
    void reset() override { recent_.clear(); }
    std::unique_ptr<SamplerStep> clone() const override { return std::make_unique<RepetitionPenalty>(*this); }

private:
    double penalty_;
    int64_t last_n_;
    std::deque<int64_t> recent_;
};

class Temperature final : public SamplerStep {
public:
    explicit Temperature(double t) : t_(t) {
        if (!(t > 0) || !std::isfinite(t))
            throw ParamError("temperature", "must be a finite number > 0 for this step, got " + fmt(t));
    }
    std::string name() const override { return "temperature(" + fmt(t_) + ")"; }
    void apply(TokenCandidates& c) override {
        c.to_f64();
        c.logits = c.logits / t_;
        c.probs = torch::Tensor();
    }
    std::unique_ptr<SamplerStep> clone() const override { return std::make_unique<Temperature>(*this); }

private:
    double t_;
};

class TopK final : public SamplerStep {
public:
    explicit TopK(int64_t k) : k_(k) {
        if (k < 1) throw ParamError("top_k", "must be >= 1 for this step, got " + std::to_string(k));
    }
    std::string name() const override { return "top_k(" + std::to_string(k_) + ")"; }
    void apply(TokenCandidates& c) override {
        if (k_ >= c.width()) return;
        c.to_f64();
        if (c.layout == CandidateLayout::Masked) {
            // Everything below the k-th logit of its row goes (ties with it stay).
            auto kth = std::get<0>(torch::topk(c.logits, k_, 1)).narrow(1, k_ - 1, 1);
            c.mask(c.logits < kth);
            return;
        }
        c.sort();
        std::vector<int64_t> keep(static_cast<size_t>(c.rows()));
        auto acc = c.logits.accessor<double, 2>();
        for (int64_t r = 0; r < c.rows(); ++r) {
            int64_t n = k_;
            while (n < c.width() && acc[r][n] == acc[r][k_ - 1]) ++n; // ties with the k-th stay
            keep[static_cast<size_t>(r)] = n;
        }
        c.keep_prefix(keep);
    }
    std::unique_ptr<SamplerStep> clone() const override { return std::make_unique<TopK>(*this); }

private:
    int64_t k_;
};

class TopP final : public SamplerStep {
public:
    explicit TopP(double p) : p_(p) {
        if (!(p > 0 && p <= 1)) throw ParamError("top_p", "must be in (0, 1], got " + fmt(p));
    }
    std::string name() const override { return "top_p(" + fmt(p_) + ")"; }
    void apply(TokenCandidates& c) override {
        if (p_ >= 1.0) return;
        if (c.layout == CandidateLayout::Masked) {
            // Per row: the probabilities in descending order, the prefix that reaches p, everything below its last.
            auto probs = c.probabilities();
            auto sorted = std::get<0>(probs.sort(1, true));
            auto cum = sorted.cumsum(1);
            auto n = ((cum < p_).sum(1, true) + 1).clamp_max(c.width()); // [n, 1]
            c.mask(probs < sorted.gather(1, n - 1));
            return;
        }
        c.sort();
        auto probs = c.probabilities();
        std::vector<int64_t> keep(static_cast<size_t>(c.rows()));
        auto acc = probs.accessor<double, 2>();
        for (int64_t r = 0; r < c.rows(); ++r) {
            // The smallest prefix whose probability reaches p (at least one token), summed in order.
            double cum = 0.0;
            int64_t n = 0;
            while (n < c.width()) {
                cum += acc[r][n++];
                if (cum >= p_) break;
            }
            keep[static_cast<size_t>(r)] = std::max<int64_t>(1, n);
        }
        c.keep_prefix(keep);
    }
    std::unique_ptr<SamplerStep> clone() const override { return std::make_unique<TopP>(*this); }

private:
    double p_;
};

class MinP final : public SamplerStep {
public:
    explicit MinP(double p) : p_(p) {
        if (!(p >= 0 && p <= 1)) throw ParamError("min_p", "must be in [0, 1], got " + fmt(p));
    }
    std::string name() const override { return "min_p(" + fmt(p_) + ")"; }
    void apply(TokenCandidates& c) override {
        if (p_ <= 0.0) return;
        auto probs = c.probabilities();
        auto removed = probs < std::get<0>(probs.max(1, true)) * p_;
        if (c.layout == CandidateLayout::Masked || !c.sorted) {
            c.mask(removed);
            return;
        }
        // Sorted: the kept candidates are a prefix.
        auto n = (~removed).sum(1);
        std::vector<int64_t> keep(n.data_ptr<int64_t>(), n.data_ptr<int64_t>() + n.numel());
        c.keep_prefix(keep);
    }
    std::unique_ptr<SamplerStep> clone() const override { return std::make_unique<MinP>(*this); }

private:
    double p_;
};

void set_confidence(TokenCandidates& c, const torch::Tensor& column) {
    if (c.want_confidence) c.confidence = c.probabilities().gather(1, column.unsqueeze(1)).squeeze(1);
}

class Greedy final : public SamplerStep {
public:
    std::string name() const override { return "greedy"; }
    bool selects() const override { return true; }
    void apply(TokenCandidates& c) override {
        // On the logits as they are (a float32 argmax is the float64 one): no conversion when nothing else ran.
        auto col = c.logits.argmax(1);
        c.selected = c.token_of(col);
        set_confidence(c, col);
    }
    std::unique_ptr<SamplerStep> clone() const override { return std::make_unique<Greedy>(*this); }
};

class Dist final : public SamplerStep {
public:
    explicit Dist(uint64_t seed) : seed_(seed), rng_(seed) {}
    std::string name() const override { return "dist(seed " + std::to_string(seed_) + ")"; }
    bool selects() const override { return true; }
    void apply(TokenCandidates& c) override {
        // Inverse CDF over the candidates in descending order, drawn from their (possibly cut) total: r ~ U(0, sum p).
        c.sort();
        auto probs = c.probabilities();
        std::vector<int64_t> col(static_cast<size_t>(c.rows()));
        auto acc = probs.accessor<double, 2>();
        for (int64_t r = 0; r < c.rows(); ++r) {
            const int64_t m = c.width();
            double total = 0.0;
            for (int64_t i = 0; i < m; ++i) total += acc[r][i];
            std::uniform_real_distribution<double> u(0.0, total);
            const double x = u(rng_);
            double cum = 0.0;
            int64_t pick = m - 1;
            for (int64_t i = 0; i < m; ++i) {
                cum += acc[r][i];
                if (x < cum) {
                    pick = i;
                    break;
                }
            }
            col[static_cast<size_t>(r)] = pick;
        }
        auto column = torch::tensor(col, torch::kInt64);
        c.selected = c.token_of(column);
        set_confidence(c, column);
    }
    void reset() override { rng_.seed(seed_); }
    std::unique_ptr<SamplerStep> clone() const override { return std::make_unique<Dist>(*this); }

private:
    uint64_t seed_;
    std::mt19937_64 rng_;
};

class Multinomial final : public SamplerStep {
public:
    explicit Multinomial(at::Generator gen) : gen_(std::move(gen)) {}
    std::string name() const override { return "multinomial"; }
    bool selects() const override { return true; }
    void apply(TokenCandidates& c) override {
        auto probs = c.probabilities();
        auto col = torch::multinomial(probs, 1, false, gen_).squeeze(1);
        c.selected = c.token_of(col);
        set_confidence(c, col);
    }
    std::unique_ptr<SamplerStep> clone() const override { return std::make_unique<Multinomial>(*this); }

private:
    at::Generator gen_;
};

} // namespace

std::unique_ptr<SamplerStep> repetition_penalty_step(double penalty, int64_t last_n) {
    return std::make_unique<RepetitionPenalty>(penalty, last_n);
}
std::unique_ptr<SamplerStep> temperature_step(double t) {
    return std::make_unique<Temperature>(t);
}
std::unique_ptr<SamplerStep> top_k_step(int64_t k) {
    return std::make_unique<TopK>(k);
}
std::unique_ptr<SamplerStep> top_p_step(double p) {
    return std::make_unique<TopP>(p);
}
std::unique_ptr<SamplerStep> min_p_step(double p) {
    return std::make_unique<MinP>(p);
}
std::unique_ptr<SamplerStep> greedy_step() {
    return std::make_unique<Greedy>();
}
std::unique_ptr<SamplerStep> dist_step(uint64_t seed) {
    return std::make_unique<Dist>(seed);
}
std::unique_ptr<SamplerStep> multinomial_step(at::Generator gen) {
    return std::make_unique<Multinomial>(std::move(gen));
}

// ---- chain ---------------------------------------------------------------------------------------------------------

SamplerChain::SamplerChain(const SamplerChain& o) : layout_(o.layout_) {
    for (const auto& s : o.steps_) steps_.push_back(s->clone());
}

SamplerChain& SamplerChain::operator=(const SamplerChain& o) {
    if (this != &o) *this = SamplerChain(o);
    return *this;
}

SamplerChain& SamplerChain::add(std::unique_ptr<SamplerStep> step) {
    if (!steps_.empty() && steps_.back()->selects())
        throw Error("sampler chain: '" + step->name() + "' after the selecting step '" + steps_.back()->name() + "'");
    steps_.push_back(std::move(step));
    return *this;
}

TokenCandidates SamplerChain::apply(const torch::Tensor& logits, bool want_confidence) {
    if (steps_.empty() || !steps_.back()->selects())
        throw Error("sampler chain '" + describe() + "' has no selecting step at its end");
    auto c = TokenCandidates::from_logits(logits, layout_);
    c.want_confidence = want_confidence;
    for (auto& s : steps_) s->apply(c);
    return c;
}

int64_t SamplerChain::sample(const torch::Tensor& logits) {
    return apply(logits).selected[0].item<int64_t>();
}

void SamplerChain::accept(int64_t token) {
    for (auto& s : steps_) s->accept(token);
}

void SamplerChain::reset() {
    for (auto& s : steps_) s->reset();
}

std::string SamplerChain::describe() const {
    std::string d;
    for (const auto& s : steps_) d += (d.empty() ? "" : " -> ") + s->name();
    return d.empty() ? "(empty)" : d;
}

void SamplingParams::validate() const {
    if (!(temperature >= 0) || !std::isfinite(temperature))
        throw ParamError("temperature", "must be a finite number >= 0, got " + fmt(temperature));
    if (top_k < 0) throw ParamError("top_k", "must be >= 0, got " + std::to_string(top_k));
    if (!(top_p > 0 && top_p <= 1)) throw ParamError("top_p", "must be in (0, 1], got " + fmt(top_p));
    if (!(min_p >= 0 && min_p <= 1)) throw ParamError("min_p", "must be in [0, 1], got " + fmt(min_p));
    if (!(repeat_penalty > 0) || !std::isfinite(repeat_penalty))
        throw ParamError("repeat_penalty", "must be a finite number > 0, got " + fmt(repeat_penalty));
    if (repeat_last_n < 0) throw ParamError("repeat_last_n", "must be >= 0, got " + std::to_string(repeat_last_n));
}

SamplerChain make_sampler_chain(const SamplingParams& p) {
    p.validate();
    SamplerChain chain(CandidateLayout::Sorted);
    if (p.repeat_penalty != 1.0 && p.repeat_last_n > 0)
        chain.add(repetition_penalty_step(p.repeat_penalty, p.repeat_last_n));
    if (p.temperature <= 0) {
        chain.add(greedy_step());
        return chain;
    }
    chain.add(temperature_step(p.temperature));
    if (p.top_k > 0) chain.add(top_k_step(p.top_k));
    if (p.top_p < 1.0) chain.add(top_p_step(p.top_p));
    if (p.min_p > 0.0) chain.add(min_p_step(p.min_p));
    chain.add(dist_step(p.seed));
    return chain;
}

} // namespace anchor::text
