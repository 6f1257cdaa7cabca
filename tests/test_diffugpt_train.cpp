// DiffuGPT's adaptation recipe (text/train/diffugpt_train.h) on toy inputs checked by hand, and the block-wise
// DiffuGPT decoding that the prefix / dual caches run on (text/diffusion/families/dlm_sampler.h).
#include "text/diffusion/families/dlm_model.h"
#include "text/diffusion/families/dlm_sampler.h"
#include "text/train/diffugpt_train.h"
#include "text/train/gpt2_train.h"

#include <catch2/catch.hpp>

#include <cmath>

namespace anchor::text {

TEST_CASE("diffugpt anneal ratio rises linearly to full attention", "[diffugpt]") {
    CHECK(diffugpt_anneal_ratio(0, 4) == Approx(0.25));
    CHECK(diffugpt_anneal_ratio(1, 4) == Approx(0.5));
    CHECK(diffugpt_anneal_ratio(3, 4) == 1.0);
    CHECK(diffugpt_anneal_ratio(100, 4) == 1.0);
    CHECK(diffugpt_anneal_ratio(0, 0) == 1.0);
}

TEST_CASE("diffugpt annealed mask: causal at 0, full at 1, causal plus a share of later keys between", "[diffugpt]") {
    auto gen = at::detail::createCPUGenerator(3);
    // Ratio 0: exactly the causal mask (query i sees keys 0..i).
    auto m0 = diffugpt_anneal_mask(3, 0.0, gen);
    const std::vector<std::vector<bool>> causal = {{true, false, false}, {true, true, false}, {true, true, true}};
    for (int i = 0; i < 3; ++i)
        for (int j = 0; j < 3; ++j) CHECK(m0[i][j].item<bool>() == causal[size_t(i)][size_t(j)]);
    CHECK(diffugpt_anneal_mask(3, 1.0, gen).all().item<bool>());
    // Ratio 0.3: the causal part always, about 30 % of the 64 * 63 / 2 later keys.
    const int64_t T = 64;
    auto m = diffugpt_anneal_mask(T, 0.3, gen);
    CHECK(m.to(torch::kLong).tril().sum().item<int64_t>() == T * (T + 1) / 2);
    const double later = double(m.to(torch::kLong).triu(1).sum().item<int64_t>()) / double(T * (T - 1) / 2);
    CHECK(later > 0.25);
    CHECK(later < 0.35);
}

TEST_CASE("diffugpt shifted loss: row i predicts token i + 1 where x_t is masked, weighted by 1/t", "[diffugpt]") {
    const int64_t M = 3; // [MASK] id of a 4-token vocabulary
    auto x0 = torch::tensor({0, 1, 2}, torch::kLong).view({1, 3});
    // Positions 0 and 1 masked: position 0 has no row predicting it, so only position 1 (row 0 -> token 1) counts.
    auto xt = torch::tensor(std::vector<int64_t>{M, M, 2}, torch::kLong).view({1, 3});
    auto logits = torch::zeros({1, 3, 4});
    logits[0][2][0] = 50.0; // the last row predicts nothing: no effect
    auto t = torch::tensor({0.25}, torch::kFloat64);
    auto l = diffugpt_shift_loss(logits, x0, xt, M, t);
    CHECK(l.masked == 1);
    CHECK(l.unweighted.item<double>() == Approx(std::log(4.0)));
    CHECK(l.weighted.item<double>() == Approx(4.0 * std::log(4.0)));
    // Row 0 favouring token 1 by 10 nats: CE = log(1 + 3 e^-10).
    logits[0][0][1] = 10.0;
    auto lr = logits.clone().requires_grad_(true);
    auto l2 = diffugpt_shift_loss(lr, x0, xt, M, t);
    // (float32 log-softmax this close to 0 carries ~1e-3 relative rounding)
    CHECK(l2.unweighted.item<double>() == Approx(std::log1p(3.0 * std::exp(-10.0))).epsilon(1e-2));
    l2.weighted.backward();
    CHECK(lr.grad()[0][0].abs().sum().item<double>() > 0);  // row 0 is in the loss
    CHECK(lr.grad()[0][1].abs().sum().item<double>() == 0); // row 1 predicts position 2, not masked
    CHECK(lr.grad()[0][2].abs().sum().item<double>() == 0); // the last row
    // Two sequences, one masked position each (CE log 4), t = 0.5 and 1: (2 log 4 + log 4) / 2.
    auto x0b = torch::tensor({0, 1, 2, 0, 1, 2}, torch::kLong).view({2, 3});
    auto xtb = torch::tensor(std::vector<int64_t>{0, M, 2, 0, 1, M}, torch::kLong).view({2, 3});
    auto lb = diffugpt_shift_loss(torch::zeros({2, 3, 4}), x0b, xtb, M, torch::tensor({0.5, 1.0}, torch::kFloat64));
    CHECK(lb.masked == 2);
    CHECK(lb.weighted.item<double>() == Approx(1.5 * std::log(4.0)));
    // Nothing masked: 0.
    CHECK(diffugpt_shift_loss(torch::zeros({1, 3, 4}), x0, x0, M, t).weighted.item<double>() == 0.0);
}

TEST_CASE("diffugpt times span eps to 1 evenly and the noise masks about t of the tokens", "[diffugpt]") {
    auto gen = at::detail::createCPUGenerator(5);
    auto t = std::get<0>(diffugpt_times(4, 1e-3, gen).sort());
    for (int i = 0; i < 4; ++i) {
        CHECK(t[i].item<double>() >= 1e-3);
        CHECK(t[i].item<double>() <= 1.0);
    }
    for (int i = 0; i < 3; ++i) CHECK(t[i + 1].item<double>() - t[i].item<double>() == Approx(0.999 / 4));
    auto x0 = torch::zeros({2, 4000}, torch::kLong);
    auto xt = diffugpt_noise(x0, torch::tensor({0.0, 0.5}, torch::kFloat64), 7, gen);
    CHECK(xt[0].eq(7).sum().item<int64_t>() == 0);
    const double share = double(xt[1].eq(7).sum().item<int64_t>()) / 4000.0;
    CHECK(share > 0.46);
    CHECK(share < 0.54);
}

TEST_CASE("diffugpt training forward with the causal mask is GPT-2's causal forward", "[diffugpt]") {
    Gpt2Config c;
    // One layer: the last position attends to every key either way, so full attention leaves it unchanged.
    c.vocab_size = 11, c.n_positions = 8, c.n_embd = 8, c.n_head = 2, c.n_layer = 1;
    Gpt2Model m(c);
    init_gpt2_weights(m, 1);
    auto ids = torch::tensor({1, 4, 2, 9, 3, 0}, torch::kLong).view({1, 6});
    auto gen = at::detail::createCPUGenerator(0);
    auto ar = gpt2_train_hidden(m, ids);
    auto causal = diffugpt_train_hidden(m, ids, diffugpt_anneal_mask(6, 0.0, gen));
    CHECK(torch::allclose(ar, causal, 1e-5, 1e-6));
    // Full attention changes the early positions (they now see later tokens); the last one sees everything anyway.
    auto full = diffugpt_train_hidden(m, ids, torch::Tensor());
    CHECK_FALSE(torch::allclose(ar[0][0], full[0][0], 1e-5, 1e-6));
    CHECK(torch::allclose(ar[0][5], full[0][5], 1e-5, 1e-6));
}

TEST_CASE("block-wise diffugpt: the caches recompute the block and the row before it", "[diffugpt]") {
    auto loaded = load_dlm(std::string(ANCHOR_SOURCE_DIR) + "/tests/golden/text/dlm/diffugpt_tiny", {}, 100);
    auto& model = *loaded.model;
    const std::vector<int64_t> prompt = {5, 17, 3, 40};
    const int64_t P = 4, G = 8, L = P + G;
    DlmSampleOptions o;
    o.gen_length = G, o.block_length = 4, o.steps = 8, o.temperature = 0.0;
    auto run = [&](DlmCache cache) {
        o.cache = cache;
        return dlm_generate(model, prompt, o, dlm_seeded_draws(1));
    };
    const auto off = run(DlmCache::Off), dual = run(DlmCache::Dual), prefix = run(DlmCache::Prefix);
    // Two blocks of four steps: off computes every position each step; dual a full step, then three times the block
    // and the position before it; prefix a full step, then three times everything from the position before the block.
    CHECK(off.positions_computed == 8 * L);
    CHECK(dual.positions_computed == 2 * (L + 3 * 5));
    CHECK(prefix.positions_computed == 2 * L + 3 * (L - (P - 1)) + 3 * (L - (P + 4 - 1)));
    REQUIRE(off.generated.size() == size_t(G));
    REQUIRE(dual.generated.size() == size_t(G));
    for (auto t : off.generated) CHECK(t != model.config().mask_token_id);
    // One step per block: every step is the block's first (a full forward), so the caches change nothing.
    o.steps = 2;
    const auto off1 = run(DlmCache::Off), dual1 = run(DlmCache::Dual);
    CHECK(off1.generated == dual1.generated);
    // The reference sampler stays the default; a cache without a block length decodes one block.
    DlmSampleOptions ref;
    ref.gen_length = G, ref.steps = 4;
    CHECK_FALSE(ref.diffugpt_blockwise(model.config()));
    ref.cache = DlmCache::Dual;
    CHECK(ref.diffugpt_blockwise(model.config()));
    CHECK_NOTHROW(ref.validate(model.config()));
}

} // namespace anchor::text
