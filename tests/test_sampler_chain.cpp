// The token sampler chain (text/gpt2/sampler_chain.h): every step on a case computed by hand, the chain's distribution in
// both layouts, seeds, and the draws of the samplers it replaced (GPT-2 generate, the MDLM samplers) bit for bit.
#include "text/params.h"
#include "text/gpt2/sampler_chain.h"

#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <map>
#include <random>

using namespace anchor;
using namespace anchor::text;

namespace {

TokenCandidates run(SamplerStep& step, const torch::Tensor& logits, CandidateLayout layout) {
    auto c = TokenCandidates::from_logits(logits, layout);
    step.apply(c);
    return c;
}

// Token ids the candidates still hold, in column order (removed: -inf in the masked layout).
std::vector<int64_t> kept(const TokenCandidates& c, int64_t row = 0) {
    std::vector<int64_t> out;
    auto l = c.logits[row].to(torch::kFloat64).contiguous();
    for (int64_t j = 0; j < c.width(); ++j)
        if (std::isfinite(l[j].item<double>())) out.push_back(c.ids.defined() ? c.ids[row][j].item<int64_t>() : j);
    std::sort(out.begin(), out.end());
    return out;
}

// GPT-2 generate's sampler before the chain (cli/text_gpt2.cpp, 645d4b5), verbatim: the reference for its outputs.
int64_t old_gpt2_sample(const torch::Tensor& logits, double temperature, int64_t top_k, double top_p,
                        std::mt19937_64& rng) {
    if (temperature <= 0.0) return logits.argmax().item<int64_t>();
    auto sorted = (logits.to(torch::kFloat64) / temperature).sort(0, true);
    auto vals = std::get<0>(sorted), idx = std::get<1>(sorted);
    int64_t keep = vals.size(0);
    if (top_k > 0) keep = std::min(keep, top_k);
    auto probs = torch::softmax(vals.narrow(0, 0, keep), 0);
    auto p = probs.accessor<double, 1>();
    if (top_p < 1.0) {
        double cum = 0.0;
        int64_t n = 0;
        while (n < keep) {
            cum += p[n++];
            if (cum >= top_p) break;
        }
        keep = std::max<int64_t>(1, n);
    }
    double total = 0.0;
    for (int64_t i = 0; i < keep; ++i) total += p[i];
    std::uniform_real_distribution<double> u(0.0, total);
    double r = u(rng), acc = 0.0;
    for (int64_t i = 0; i < keep; ++i) {
        acc += p[i];
        if (r < acc) return idx[i].item<int64_t>();
    }
    return idx[keep - 1].item<int64_t>();
}

// The MDLM samplers' draw before the chain (text/diffusion/mdlm_sampler.cpp, 645d4b5), verbatim.
void old_mdlm_draw(const torch::Tensor& logits_in, double temperature, int64_t top_k, at::Generator& gen,
                   torch::Tensor& x0, torch::Tensor& conf) {
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

TEST_CASE("sampler steps on hand-computed cases, in both layouts", "[sampler]") {
    for (auto layout : {CandidateLayout::Sorted, CandidateLayout::Masked}) {
        CAPTURE(int(layout));
        // temperature: l / T
        auto t = run(*temperature_step(2.0), torch::tensor({1.0, 2.0, 3.0}), layout);
        CHECK(t.logits.equal(torch::tensor({{0.5, 1.0, 1.5}}, torch::kFloat64)));
        // top-k: the k largest and every logit tied with the k-th
        CHECK(kept(run(*top_k_step(2), torch::tensor({1.0, 3.0, 2.0, 0.5}), layout)) == std::vector<int64_t>{1, 2});
        CHECK(kept(run(*top_k_step(1), torch::tensor({1.0, 3.0, 2.0, 3.0}), layout)) == std::vector<int64_t>{1, 3});
        CHECK(kept(run(*top_k_step(9), torch::tensor({1.0, 3.0}), layout)) == std::vector<int64_t>{0, 1});
        // top-p over p = (0.2, 0.5, 0.3): 0.5 alone reaches 0.5; 0.5 + 0.3 reaches 0.6 and 0.8
        const auto lp = torch::tensor({0.2, 0.5, 0.3}, torch::kFloat64).log();
        CHECK(kept(run(*top_p_step(0.5), lp, layout)) == std::vector<int64_t>{1});
        CHECK(kept(run(*top_p_step(0.6), lp, layout)) == std::vector<int64_t>{1, 2});
        CHECK(kept(run(*top_p_step(0.81), lp, layout)) == std::vector<int64_t>{0, 1, 2});
        CHECK(kept(run(*top_p_step(1.0), lp, layout)) == std::vector<int64_t>{0, 1, 2});
        // min-p: p_i >= min_p * p_max (0.5): 0.25 keeps 0.3 and 0.5, 0.7 keeps 0.5 alone
        CHECK(kept(run(*min_p_step(0.5), lp, layout)) == std::vector<int64_t>{1, 2});
        CHECK(kept(run(*min_p_step(0.7), lp, layout)) == std::vector<int64_t>{1});
        // repetition penalty (CTRL): positive logits of recent tokens divided, negative ones multiplied
        auto pen = repetition_penalty_step(2.0, 2);
        pen->accept(5); // falls out of the window of 2
        pen->accept(0);
        pen->accept(1);
        auto r = run(*pen, torch::tensor({2.0, -1.0, 0.5, 4.0, 1.0, 3.0}), layout);
        CHECK(r.logits.equal(torch::tensor({{1.0, -2.0, 0.5, 4.0, 1.0, 3.0}}, torch::kFloat64)));
        pen->reset();
        CHECK(
            run(*pen, torch::tensor({2.0, -1.0}), layout).logits.equal(torch::tensor({{2.0, -1.0}}, torch::kFloat64)));
        // greedy: the argmax, its probability as confidence
        auto g = TokenCandidates::from_logits(torch::tensor({0.0, std::log(3.0), 0.0}), layout);
        g.want_confidence = true;
        greedy_step()->apply(g);
        CHECK(g.selected.item<int64_t>() == 1);
        CHECK(g.confidence.item<double>() == Approx(0.6));
    }
    // dist: u ~ U(0, total) walked over the candidates in descending order (drawn here with the same generator)
    auto lp = torch::tensor({0.2, 0.5, 0.3}, torch::kFloat64).log();
    auto d = dist_step(42);
    std::mt19937_64 rng(42);
    for (int i = 0; i < 50; ++i) {
        auto c = TokenCandidates::from_logits(lp, CandidateLayout::Sorted);
        d->apply(c);
        const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
        const int64_t want = u < 0.5 ? 1 : u < 0.8 ? 2 : 0; // p 0.5, 0.3, 0.2 in descending order
        CHECK(c.selected.item<int64_t>() == want);
    }
}

TEST_CASE("sampler chain: distribution, seeds, reset and clone", "[sampler]") {
    // temperature 0.5 squares the probabilities (renormalised); top-k 3 drops the smallest; top-p 0.9 then the
    // prefix reaching 0.9. p = (0.4, 0.3, 0.2, 0.1) -> tempered (16, 9, 4, 1) / 30 -> top-3 (16, 9, 4) / 29 ->
    // cumulative 0.552, 0.862, 1: all three stay -> draw from (16, 9, 4) / 29.
    auto base = torch::tensor({0.4, 0.3, 0.2, 0.1}, torch::kFloat64).log();
    const std::vector<double> want = {16.0 / 29, 9.0 / 29, 4.0 / 29, 0.0};
    SamplingParams p;
    p.temperature = 0.5;
    p.top_k = 3;
    p.top_p = 0.9;
    p.seed = 7;
    auto chain = make_sampler_chain(p);
    CHECK(chain.describe() == "temperature(0.5) -> top_k(3) -> top_p(0.9) -> dist(seed 7)");
    const int n = 20000;
    std::map<int64_t, int> count;
    std::vector<int64_t> first;
    for (int i = 0; i < n; ++i) {
        const auto tok = chain.sample(base);
        ++count[tok];
        if (i < 32) first.push_back(tok);
    }
    for (int64_t tok = 0; tok < 4; ++tok) CHECK(double(count[tok]) / n == Approx(want[size_t(tok)]).margin(0.015));
    // The masked layout with torch::multinomial: the same distribution, every row at once.
    SamplerChain masked(CandidateLayout::Masked);
    masked.add(temperature_step(0.5)).add(top_k_step(3)).add(top_p_step(0.9));
    masked.add(multinomial_step(at::detail::createCPUGenerator(3)));
    auto rows = masked.apply(base.unsqueeze(0).expand({n, 4}), true);
    for (int64_t tok = 0; tok < 4; ++tok)
        CHECK(rows.selected.eq(tok).sum().item<double>() / n == Approx(want[size_t(tok)]).margin(0.015));
    CHECK(rows.confidence[0].item<double>() == Approx(want[size_t(rows.selected[0].item<int64_t>())]).epsilon(1e-9));

    // Seeds: the same seed repeats the draws, reset() starts them again, a clone continues independently.
    auto again = make_sampler_chain(p);
    std::vector<int64_t> second;
    for (int i = 0; i < 32; ++i) second.push_back(again.sample(base));
    CHECK(second == first);
    again.reset();
    auto copy = again;
    std::vector<int64_t> third, fourth;
    for (int i = 0; i < 32; ++i) third.push_back(again.sample(base)), fourth.push_back(copy.sample(base));
    CHECK(third == first);
    CHECK(fourth == first);
    p.seed = 8;
    auto other = make_sampler_chain(p);
    std::vector<int64_t> fifth;
    for (int i = 0; i < 32; ++i) fifth.push_back(other.sample(base));
    CHECK(fifth != first);
}

TEST_CASE("sampler chain: GPT-2 generate's draws are the old sampler's, bit for bit", "[sampler][gpt2]") {
    // The old sampler's semantics: temperature, exact top-k, top-p on the tempered distribution, mt19937_64. The chain
    // keeps ties with the k-th logit, which float logits of random models do not have.
    torch::manual_seed(5);
    std::mt19937 pick_rng(1);
    struct P {
        double t;
        int64_t k;
        double p;
    };
    const std::vector<P> params = {{0.0, 0, 1.0},  {1.0, 0, 1.0},   {0.8, 40, 1.0}, {1.0, 0, 0.9},
                                   {0.7, 0, 0.95}, {1.3, 100, 0.8}, {0.9, 1, 1.0},  {2.0, 5, 0.5}};
    for (const auto& pp : params) {
        for (uint64_t seed : {0ull, 1ull, 12345ull}) {
            SamplingParams sp;
            sp.temperature = pp.t;
            sp.top_k = pp.k;
            sp.top_p = pp.p;
            sp.seed = seed;
            auto chain = make_sampler_chain(sp);
            std::mt19937_64 rng(seed);
            for (int step = 0; step < 60; ++step) {
                const int64_t V = std::uniform_int_distribution<int64_t>(2, 3000)(pick_rng);
                auto logits = torch::randn({V}) * 4.0f;
                CAPTURE(pp.t, pp.k, pp.p, seed, step, V);
                REQUIRE(chain.sample(logits) == old_gpt2_sample(logits, pp.t, pp.k, pp.p, rng));
            }
        }
    }
}

TEST_CASE("sampler chain: the MDLM samplers' draws and confidences are the old ones, bit for bit", "[sampler][mdlm]") {
    torch::manual_seed(9);
    for (double t : {0.0, 1.0, 0.8}) {
        for (int64_t k : {0, 1, 7, 100000}) {
            SamplerChain chain(CandidateLayout::Masked);
            auto gen_new = at::detail::createCPUGenerator(21), gen_old = at::detail::createCPUGenerator(21);
            if (k > 0) chain.add(top_k_step(k));
            if (t > 0)
                chain.add(temperature_step(t)).add(multinomial_step(gen_new));
            else
                chain.add(greedy_step());
            for (int64_t n : {1, 3, 64}) {
                auto logits = torch::randn({n, 500}) * 3.0f;
                auto got = chain.apply(logits, true);
                torch::Tensor x0, conf;
                old_mdlm_draw(logits, t, k, gen_old, x0, conf);
                CAPTURE(t, k, n);
                CHECK(torch::equal(got.selected, x0));
                CHECK(torch::equal(got.confidence, conf));
            }
        }
    }
}

TEST_CASE("sampler chain: parameters and composition errors name what is wrong", "[sampler]") {
    SamplingParams p;
    p.top_p = 0;
    CHECK_THROWS_WITH(make_sampler_chain(p), Catch::Contains("top_p: must be in (0, 1]"));
    p = SamplingParams{};
    p.temperature = -1;
    try {
        p.validate();
        FAIL("expected a ParamError");
    } catch (const ParamError& e) {
        CHECK(e.field() == "temperature");
        CHECK(with_flags(e, {{"temperature", "--temperature"}, {"top_k", "--top-k"}}) ==
              "--temperature: must be a finite number >= 0, got -1");
    }
    CHECK_THROWS_WITH(top_k_step(0), Catch::Contains("top_k"));
    CHECK_THROWS_WITH(repetition_penalty_step(0.0, 4), Catch::Contains("repeat_penalty"));
    SamplerChain c;
    c.add(top_k_step(2));
    CHECK_THROWS_WITH(c.sample(torch::randn({5})), Catch::Contains("no selecting step"));
    c.add(greedy_step());
    CHECK_THROWS_WITH(c.add(top_k_step(2)), Catch::Contains("after the selecting step"));
    CHECK_THROWS_WITH(SamplerChain(CandidateLayout::Sorted).add(greedy_step()).sample(torch::randn({2, 5})),
                      Catch::Contains("one row"));
    // with_flags replaces whole words only, once each
    ParamError e("report_json", "needs report_every >= 1 (report_everything is another word)");
    CHECK(with_flags(e, {{"report_json", "--report-json"}, {"report_every", "--report-every"}}) ==
          "--report-json: needs --report-every >= 1 (report_everything is another word)");
}
