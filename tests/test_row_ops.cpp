// kernels/row_ops.h against its torch-op references on random shapes, on each instruction-set path.
#include "kernels/cpu_features.h"
#include "kernels/row_ops.h"
#include "tests/test_util.h"

#include <catch2/catch.hpp>

#include <random>

using namespace anchor;
using namespace anchor::kernels;

TEST_CASE("row ops: the modulated norm of a few rows is LayerNorm, scale and shift", "[rowops]") {
    torch::NoGradGuard ng;
    torch::manual_seed(3);
    std::mt19937 rng(5);
    for (int trial = 0; trial < 12; ++trial) {
        const int64_t D = std::vector<int64_t>{3, 7, 32, 384}[size_t(trial % 4)], L = 3 + trial;
        CAPTURE(D, L);
        auto x = torch::randn({L, D}) * 3 + 1;
        // The modulation's chunks are views of a [1, 1, 3D] tensor (unit last stride, offset data).
        auto mod = torch::randn({1, 1, 3 * D});
        auto ch = mod.chunk(3, -1);
        auto w = torch::randn({D});
        auto rows = torch::randint(0, L, {1 + trial % 5}, torch::kInt64);
        const double eps = 1e-5;
        for (const torch::Tensor& r : {rows, torch::Tensor()}) {
            const auto ref = modulated_norm_rows_torch(x, r, w, ch[1], ch[0], eps);
            const auto got = modulated_norm_rows(x, r, w, ch[1], ch[0], eps);
            REQUIRE(got.sizes() == ref.sizes());
            CHECK(test::max_abs_diff(got, ref) <= 2e-6 * std::max(1.0, ref.abs().max().item<double>()));
        }
    }
    CHECK_THROWS_WITH(modulated_norm_rows(torch::randn({4, 8}), torch::tensor({9}, torch::kInt64), torch::ones({8}),
                                          torch::zeros({8}), torch::zeros({8}), 1e-5),
                      Catch::Contains("row 9 out of range"));
    CHECK_THROWS_WITH(
        modulated_norm_rows(torch::randn({4, 8}), {}, torch::ones({7}), torch::zeros({8}), torch::zeros({8}), 1e-5),
        Catch::Contains("weight must hold 8"));
}

TEST_CASE("row ops: few-query attention agrees with matmul-softmax-matmul on every path", "[rowops]") {
    torch::NoGradGuard ng;
    torch::manual_seed(4);
    std::vector<SimdPath> paths{SimdPath::Portable};
    if (cpu_features().avx2 && cpu_features().fma) paths.insert(paths.begin(), {SimdPath::Best, SimdPath::Avx2});
    std::mt19937 rng(11);
    auto pick = [&](std::vector<int64_t> v) { return v[std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng)]; };
    for (int trial = 0; trial < 40; ++trial) {
        // Head widths on and off the 8- and 16-lane vectors and past the 64 columns held in registers; key counts
        // around the 8-key score passes; 1-3 queries (the horizontal-add scores) and more (the product kernel).
        const int64_t H = pick({1, 2, 6}), d = pick({2, 8, 16, 24, 64, 80, 128}), M = pick({1, 5, 8, 17, 256}),
                      n = pick({1, 2, 3, 4, 5, 12, 33});
        const double scale = 1.0 / std::sqrt(double(d));
        CAPTURE(H, d, M, n);
        auto q = torch::randn({H, n, d}) * 2, k = torch::randn({H, M, d}), v = torch::randn({H, M, d});
        // Strided rows as the cache and the projection give them: k and v views of wider rows, q from a permute.
        auto kw = torch::randn({H, M, d + 3}), vw = torch::randn({H, M, d + 5});
        auto ks = kw.narrow(2, 0, d), vs = vw.narrow(2, 1, d);
        auto qs = torch::randn({n, H, d}).permute({1, 0, 2});
        const auto ref = few_query_attention_torch(q, k, v, scale),
                   ref_s = few_query_attention_torch(qs, ks, vs, scale);
        for (auto p : paths) {
            CAPTURE(int(p));
            const auto got = few_query_attention(q, k, v, scale, p);
            REQUIRE(got.sizes() == torch::IntArrayRef{n, H * d});
            // Float32 sums over up to 256 keys in another order (the portable path: one running sum).
            CHECK(test::max_abs_diff(got, ref) <= 1e-5 * std::max(1.0, ref.abs().max().item<double>()));
            const auto got_s = few_query_attention(qs, ks, vs, scale, p);
            CHECK(test::max_abs_diff(got_s, ref_s) <= 1e-5 * std::max(1.0, ref_s.abs().max().item<double>()));
        }
    }
    CHECK_FALSE(few_query_attention_applies(torch::randn({2, 3, 8}), torch::randn({2, 4, 8}),
                                            torch::randn({2, 5, 8}))); // k and v disagree
    CHECK_FALSE(few_query_attention_applies(torch::randn({2, 3, 8}), torch::randn({2, 0, 8}), torch::randn({2, 0, 8})));
    CHECK_THROWS_WITH(few_query_attention(torch::randn({2, 3, 8}), torch::randn({2, 4, 7}), torch::randn({2, 4, 7}), 1),
                      Catch::Contains("few_query_attention"));
}

TEST_CASE("row ops: the gated residual of some rows is x + gate * branch[rows]", "[rowops]") {
    torch::NoGradGuard ng;
    torch::manual_seed(6);
    const int64_t L = 19, D = 24;
    auto branch = torch::randn({L, D});
    auto gate = torch::randn({1, 1, 3 * D}).chunk(3, -1)[1];
    for (int64_t u : {int64_t(1), int64_t(5), L}) {
        CAPTURE(u);
        auto x = torch::randn({u, D});
        const auto rows = u == L ? torch::Tensor() : torch::randperm(L, torch::kInt64).narrow(0, 0, u).contiguous();
        const auto picked = rows.defined() ? branch.index_select(0, rows) : branch;
        const auto ref = x + gate.reshape({D}) * picked;
        auto out = torch::empty_like(x);
        kernels::gated_add_rows(x, gate, branch, rows, out);
        CHECK(test::max_abs_diff(out, ref) <= 1e-6 * std::max(1.0, ref.abs().max().item<double>()));
        kernels::gated_add_rows(x, gate, branch, rows, x); // in place
        CHECK(test::max_abs_diff(x, ref) <= 1e-6 * std::max(1.0, ref.abs().max().item<double>()));
    }
    auto x = torch::randn({2, D});
    CHECK_THROWS_WITH(kernels::gated_add_rows(x, gate, branch, torch::tensor({0, 40}, torch::kInt64), x),
                      Catch::Contains("row 40 out of range"));
}
