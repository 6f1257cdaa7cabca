#include "cache/dct.h"
#include "cache/io/error.h"
#include "kernels/attention.h"
#include "kernels/dct_energy.h"
#include "kernels/decode_ops.h"
#include "kernels/dispatch.h"
#include "kernels/geglu.h"
#include "kernels/ring_write.h"
#include "tests/test_util.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <functional>
#include <iomanip>
#include <iostream>
#include <limits>
#include <random>

using namespace anchor;
using namespace anchor::kernels;
using anchor::test::rel_err;

namespace {

// The float32 rounding of the largest score, eps * max sum_i |q_i k_i| * scale (q, k [B, H, n, D] or, with
// heads = H > 0, [B, n, H*D]): a floor of the error any float32 attention has when the softmax is nearly one-hot,
// whatever order the BLAS of this CPU sums the products in.
double score_rounding(const torch::Tensor& q, const torch::Tensor& k, int64_t H, int64_t D) {
    auto heads = [&](const torch::Tensor& t) {
        auto a = t.to(torch::kDouble).abs();
        return H > 0 ? a.view({t.size(0), -1, H, D}).permute({0, 2, 1, 3}) : a;
    };
    return std::ldexp(1.0, -24) * torch::matmul(heads(q), heads(k).transpose(-1, -2)).max().item<double>() /
           std::sqrt(double(D));
}

// One line of the table kernels/device-check.sh prints: "kernel-table | name | shape | max_rel_err | PASS/FAIL".
void table_row(const std::string& name, const std::string& shape, double err, bool pass) {
    std::cout << "kernel-table | " << std::left << std::setw(28) << name << " | " << std::setw(20) << shape << " | "
              << std::scientific << std::setprecision(2) << err << std::defaultfloat << " | "
              << (pass ? "PASS" : "FAIL") << "\n";
}

bool cuda_ready() {
    return cuda_kernels_built() && torch::cuda::is_available();
}

} // namespace

TEST_CASE("ring_slot keeps sinks and rolls the window", "[kernels]") {
    CHECK(ring_slot(0, 4, 8) == 0);
    CHECK(ring_slot(3, 4, 8) == 3);
    CHECK(ring_slot(4, 4, 8) == 4);
    CHECK(ring_slot(11, 4, 8) == 11);
    CHECK(ring_slot(12, 4, 8) == 4); // wraps over the oldest window token, never over the sinks
    CHECK(ring_slot(100, 0, 8) == 4);
    CHECK_THROWS_AS(ring_slot(1, 0, 0), Error);
}

TEST_CASE("ring_write CPU reference writes one slot of every (batch, head) row", "[kernels]") {
    const int64_t B = 2, H = 3, C = 6, D = 5;
    for (auto dtype : {torch::kFloat32, torch::kFloat16, torch::kFloat64}) {
        auto kb = torch::zeros({B, H, C, D}, dtype), vb = torch::zeros({B, H, C, D}, dtype);
        auto k = torch::randn({B, H, D}).to(dtype), v = torch::randn({B, H, 1, D}).to(dtype);
        ring_write(kb, vb, k, v, 4);
        CHECK(torch::equal(kb.select(2, 4), k));
        CHECK(torch::equal(vb.select(2, 4), v.squeeze(2)));
        // Nothing else touched.
        CHECK(kb.to(torch::kFloat64).abs().sum().item<double>() ==
              Approx(k.to(torch::kFloat64).abs().sum().item<double>()));
        CHECK(vb.index_select(2, torch::tensor({0, 1, 2, 3, 5})).abs().sum().item<double>() == 0.0);
    }
    auto kb = torch::zeros({B, H, C, D}), vb = torch::zeros({B, H, C, D});
    auto k = torch::randn({B, H, D});
    CHECK_THROWS_AS(ring_write(kb, vb, k, k, C), Error);                           // slot out of range
    CHECK_THROWS_AS(ring_write(kb, vb, torch::randn({B, H, D + 1}), k, 0), Error); // wrong row shape
    CHECK_THROWS_AS(ring_write(kb, vb, k.to(torch::kFloat16), k, 0), Error);       // dtype mismatch
    auto nc = torch::zeros({B, H, D, C}).transpose(2, 3);
    CHECK_THROWS_AS(ring_write(nc, vb, k, k, 0), Error); // non-contiguous cache
}

TEST_CASE("dct_energy CPU reference equals squared orthonormal DCT-II", "[kernels]") {
    torch::manual_seed(5);
    auto x = torch::randn({2, 4, 6, 10});
    auto e = dct_energy(x);
    CHECK(e.scalar_type() == torch::kFloat32);
    CHECK(e.sizes() == x.sizes());
    CHECK(rel_err(e, cache::dct2(x.to(torch::kFloat64)).square()) < 1e-6);
    // Parseval per map.
    CHECK(rel_err(e.sum({-2, -1}), x.square().sum({-2, -1})) < 1e-5);
    CHECK_THROWS_AS(dct_energy(torch::ones({4}, torch::kFloat32)), Error);
}

// CUDA vs CPU: only where the kernels are built and a GPU is present; elsewhere the test says it skipped.
TEST_CASE("CUDA kernels match the CPU references", "[kernels][cuda]") {
    if (!cuda_ready()) {
        WARN("skipped: CUDA kernels " << (cuda_kernels_built() ? "built" : "not built")
                                      << ", torch::cuda::is_available() = " << torch::cuda::is_available());
        SUCCEED();
        return;
    }
    const torch::Device dev(torch::kCUDA, 0);
    torch::manual_seed(11);
    // Even, odd, non-square and SD-latent-like shapes (Makhoul reordering differs for odd lengths).
    const std::vector<std::vector<int64_t>> shapes = {{1, 1, 8, 8},     {2, 4, 7, 5},    {1, 3, 16, 9},
                                                      {2, 320, 64, 64}, {1, 1280, 8, 8}, {3, 1, 1}};
    for (const auto& s : shapes) {
        auto x = torch::randn(s);
        auto cpu = dct_energy(x);
        auto gpu = dct_energy(x.to(dev));
        REQUIRE(gpu.is_cuda());
        const double err = rel_err(gpu, cpu);
        const bool pass = err < 1e-4;
        table_row("dct_energy", shape_str(s), err, pass);
        INFO("dct_energy " << shape_str(s) << " rel err " << err);
        CHECK(pass);
    }
    for (auto dtype : {torch::kFloat32, torch::kFloat16, torch::kBFloat16}) {
        for (int64_t D : {64, 80, 3}) {
            const int64_t B = 2, H = 12, C = 4 + 32;
            auto kb = torch::randn({B, H, C, D}).to(dtype), vb = torch::randn({B, H, C, D}).to(dtype);
            auto k = torch::randn({B, H, D}).to(dtype), v = torch::randn({B, H, D}).to(dtype);
            auto kb_gpu = kb.to(dev), vb_gpu = vb.to(dev);
            for (int64_t pos : {0, 3, 4, 35, 36, 100}) {
                const int64_t slot = ring_slot(pos, 4, 32);
                ring_write(kb, vb, k * double(pos + 1), v - double(pos), slot);
                ring_write(kb_gpu, vb_gpu, (k * double(pos + 1)).to(dev), (v - double(pos)).to(dev), slot);
            }
            const bool pass = torch::equal(kb_gpu.cpu(), kb) && torch::equal(vb_gpu.cpu(), vb);
            table_row(std::string("ring_write ") + c10::toString(dtype), shape_str({B, H, C, D}), pass ? 0.0 : 1.0,
                      pass);
            CHECK(pass);
        }
    }
}

// Performance mode (hidden: `anchor_tests "[.kernels-perf]"`, run by kernels/device-check.sh): times each kernel
// against the reference paths on the same data in one run and prints
//   kernel-perf | name | shape | ours ms | torch same-device ms | CPU ms | speed-up vs torch | vs CPU
// "ours" is the dispatched kernel (cuFFT / fused ring write on a GPU; on a CPU-only build the float32 basis-matrix
// DCT and the row loop), "torch" the same computation written with plain torch ops on the same device (basis-matrix
// GEMMs for the DCT, a slice assignment for the ring write), "CPU" the float64 reference of kernels/dct_energy.h.
TEST_CASE("blas_attention is bit-identical to the reference attention on random shapes", "[kernels][attention]") {
    if (!blas_attention_available()) {
        WARN("no BLAS sgemm shared with LibTorch in this build: blas_attention is not used");
        return;
    }
    // As llama.cpp's test-backend-ops does for each backend: many random shapes, both sides of LibTorch's naive/BLAS
    // boundary (400 multiply-adds per head), single queries and keys, one head and many, projection-layout views.
    torch::manual_seed(11);
    std::mt19937 rng(5);
    auto pick = [&](std::vector<int64_t> v) { return v[std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng)]; };
    int naive = 0, blas = 0;
    for (int t = 0; t < 120; ++t) {
        torch::set_num_threads(t % 3 == 2 ? 2 : 1); // OpenBLAS splits products over threads: the same way here
        const int64_t B = pick({1, 2, 3, 4}), N = pick({1, 2, 3, 4, 7, 8, 16, 64, 72, 77, 100}),
                      M = pick({1, 2, 4, 5, 16, 64, 77, 130}), H = pick({1, 2, 3, 4, 8}),
                      D = pick({1, 3, 4, 8, 16, 40, 64});
        const int64_t C = H * D;
        const double mag = pick({1, 1, 1, 30});
        auto q = torch::randn({B, N, C}) * double(mag), k = torch::randn({B, M, C}), v = torch::randn({B, M, C});
        const double scale = 1.0 / std::sqrt(double(D));
        CAPTURE(B, N, M, H, D, mag);
        if (D == 1) { // left to the reference (blas_attention_applies)
            CHECK(!blas_attention_applies(q, k, v, H));
            continue;
        }
        REQUIRE(blas_attention_applies(q, k, v, H));
        (N * M * D < 400 ? naive : blas)++;
        auto ref = attention_reference(q, k, v, H, scale);
        CHECK(torch::equal(blas_attention(q, k, v, H, scale), ref));
        // key/value views into wider tensors (the prompt K/V are reused as views): the same bits
        auto kw = torch::randn({B, M, 2 * C}), vw = torch::randn({B, M, 2 * C});
        auto ks = kw.narrow(2, C, C), vs = vw.narrow(2, 0, C);
        CHECK(torch::equal(blas_attention(q, ks, vs, H, scale), attention_reference(q, ks, vs, H, scale)));
    }
    torch::set_num_threads(1);
    CHECK(naive > 10);
    CHECK(blas > 10);
    // and the reference is what matmul-softmax-matmul computes, up to rounding
    auto q = torch::randn({2, 64, 32}), k = torch::randn({2, 77, 32}), v = torch::randn({2, 77, 32});
    CHECK(rel_err(attention_reference(q, k, v, 4, 0.25), attention_torch(q, k, v, 4, 0.25)) < 2e-6);
    // a NaN reaches the output (the pipeline's NaN check must see broken models), in its own head only
    q[0][3][1] = std::numeric_limits<float>::quiet_NaN();
    auto o = blas_attention(q, k, v, 4, 0.25);
    CHECK(std::isnan(o[0][3][0].item<float>()));
    CHECK_FALSE(std::isnan(o[0][3][8].item<float>()));
    // what it does not take: autograd, other dtypes
    auto qg = torch::randn({1, 8, 8}).requires_grad_(true);
    CHECK_FALSE(blas_attention_applies(qg, qg, qg, 2));
    auto qd = torch::randn({1, 8, 8}, torch::kDouble);
    CHECK_FALSE(blas_attention_applies(qd, qd, qd, 2));
    CHECK_THROWS_WITH(blas_attention(torch::randn({1, 4, 6}), torch::randn({1, 3, 6}), torch::randn({1, 4, 6}), 2, 1.0),
                      Catch::Contains("do not match"));
}

TEST_CASE("small_attention matches matmul-softmax-matmul on both paths", "[kernels][attention]") {
    torch::manual_seed(7);
    // (B, N, M, heads, D): the fashion UNet's self/cross shapes, keys and widths off the 8-lane grid, one head,
    // a key count of 1 and a large-magnitude case (softmax close to one-hot).
    struct Case {
        int64_t B, N, M, H, D;
        double mag = 1.0;
    };
    for (const auto& c : std::vector<Case>{{20, 64, 64, 4, 8},
                                           {20, 64, 77, 4, 8},
                                           {3, 16, 77, 4, 16},
                                           {2, 13, 13, 3, 5},
                                           {1, 8, 1, 1, 40},
                                           {2, 11, 4, 1, 64},
                                           {2, 9, 23, 2, 12, 30.0}}) {
        const int64_t C = c.H * c.D;
        auto q = torch::randn({c.B, c.N, C}) * c.mag, k = torch::randn({c.B, c.M, C}), v = torch::randn({c.B, c.M, C});
        const double scale = 1.0 / std::sqrt(double(c.D));
        auto ref = attention_torch(q, k, v, c.H, scale);
        CAPTURE(c.B, c.N, c.M, c.H, c.D, c.mag);
        CHECK(small_attention_applies(q, k, v, c.H));
        // As accurate as LibTorch's float32 path, both measured against float64 (scores of magnitude 30 make the
        // softmax nearly one-hot, where float32 itself is only good to ~mag * eps).
        auto truth = attention_torch(q.to(torch::kDouble), k.to(torch::kDouble), v.to(torch::kDouble), c.H, scale);
        const double bound =
            std::max({2e-6, 2 * rel_err(ref, truth), c.mag > 1 ? 2.0 * score_rounding(q, k, c.H, c.D) : 0.0});
        CHECK(rel_err(small_attention(q, k, v, c.H, scale), truth) < bound);
        CHECK(rel_err(small_attention(q, k, v, c.H, scale, /*portable=*/true), truth) < bound);
        // a key/value view into a wider tensor (cached prompt K/V are views): strides are honoured
        auto kw = torch::randn({c.B, c.M, 2 * C}), vw = torch::randn({c.B, c.M, 2 * C});
        auto ks = kw.narrow(2, C, C), vs = vw.narrow(2, 0, C);
        CHECK(rel_err(small_attention(q, ks, vs, c.H, scale), attention_torch(q, ks, vs, c.H, scale)) < 2e-6);
    }
    // Large-magnitude scores (softmax nearly one-hot, most exponentials far below float range): still exact.
    {
        auto q = torch::randn({2, 16, 32}) * 1000, k = torch::randn({2, 40, 32}), v = torch::randn({2, 40, 32});
        auto ref = attention_torch(q, k, v, 4, 0.125);
        CHECK(rel_err(small_attention(q, k, v, 4, 0.125), ref) < 2e-6);
        CHECK(rel_err(small_attention(q, k, v, 4, 0.125, true), ref) < 2e-6);
    }
    // A NaN in q reaches the output of its head (the pipeline's NaN check must see broken models).
    {
        auto q = torch::randn({1, 8, 8}), k = torch::randn({1, 9, 8}), v = torch::randn({1, 9, 8});
        q[0][3][1] = std::numeric_limits<float>::quiet_NaN();
        auto o = small_attention(q, k, v, 2, 0.5);
        CHECK(std::isnan(o[0][3][0].item<float>()));
        CHECK_FALSE(std::isnan(o[0][3][4].item<float>())); // the other head of that row
    }
    // what stays on the BLAS path: large heads, autograd, other dtypes
    auto big = torch::randn({1, 1024, 320});
    CHECK_FALSE(small_attention_applies(big, big, big, 8));
    auto qg = torch::randn({1, 8, 8}).requires_grad_(true);
    CHECK_FALSE(small_attention_applies(qg, qg, qg, 2));
    auto qd = torch::randn({1, 8, 8}, torch::kDouble);
    CHECK_FALSE(small_attention_applies(qd, qd, qd, 2));
    auto q7 = torch::randn({1, 7, 8}); // fewer queries than one tile
    CHECK_FALSE(small_attention_applies(q7, q7, q7, 2));
    CHECK(rel_err(small_attention(q7, q7, q7, 2, 0.5), attention_torch(q7, q7, q7, 2, 0.5)) < 2e-6); // still correct
    CHECK_THROWS_WITH(
        small_attention(torch::randn({1, 4, 6}), torch::randn({1, 3, 6}), torch::randn({1, 4, 6}), 2, 1.0),
        Catch::Contains("do not match"));
}

TEST_CASE("flash_attention matches float64 attention on random shapes, every instruction set", "[kernels][attention]") {
    // As llama.cpp's test-backend-ops: many random shapes for each path this CPU has, against float64, bounded by
    // twice LibTorch's own float32 error (and 2e-6): query counts on and off the tiles (8..300), keys across the
    // 192-key blocks (1, 77 = CLIP's prompt, 193, 600), head widths off the lanes (5, 40 = SD 1.5, 64, 80, 160),
    // both layouts, causal masks aligned to the last key, CLIP's pre-scaled query, large-magnitude scores.
    torch::manual_seed(13);
    std::mt19937 rng(3);
    auto pick = [&](std::vector<int64_t> v) { return v[std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng)]; };
    std::vector<FlashIsa> isas;
    for (auto isa : {FlashIsa::Avx512, FlashIsa::Avx2, FlashIsa::Portable})
        if (flash_isa_available(isa)) isas.push_back(isa);
    for (int t = 0; t < 60; ++t) {
        torch::set_num_threads(t % 2 ? 2 : 1);
        const int64_t B = pick({1, 2, 3}), N = pick({8, 9, 17, 64, 65, 130, 300}), H = pick({1, 2, 3, 8}),
                      D = pick({1, 5, 8, 40, 64, 80, 160});
        const bool causal = t % 5 == 4, heads_layout = t % 3 == 1, prescaled = t % 7 == 3;
        const int64_t M = causal ? N + pick({0, 0, 5}) : pick({1, 8, 77, 193, 600});
        const double mag = pick({1, 1, 1, 20});
        AttentionOptions o;
        o.heads = H;
        o.causal = causal;
        o.layout = heads_layout ? AttentionLayout::Heads : AttentionLayout::Projection;
        o.formula = prescaled ? ScoreFormula::PreScaledQuery : ScoreFormula::ScaleAfter;
        auto shape = [&](int64_t n) {
            return heads_layout ? std::vector<int64_t>{B, H, n, D} : std::vector<int64_t>{B, n, H * D};
        };
        auto q = torch::randn(shape(N)) * mag, k = torch::randn(shape(M)), v = torch::randn(shape(M));
        CAPTURE(t, B, N, M, H, D, causal, heads_layout, prescaled, mag);
        REQUIRE(flash_attention_applies(q, k, v, o));
        auto ref = attention_matmul(q, k, v, o);
        auto truth = attention_matmul(q.to(torch::kDouble), k.to(torch::kDouble), v.to(torch::kDouble), o);
        // Nearly one-hot softmax (scores of magnitude ~20 sqrt(D)): both sides are at the scores' own rounding,
        // |s| eps, which the order of the D products decides; there the bound is 3x torch's error, or the rounding
        // of the largest score sum_i |q_i k_i| scale itself (torch's BLAS may order the sum more luckily).
        double bound = std::max(2e-6, (mag > 1 ? 3 : 2) * rel_err(ref, truth));
        if (mag > 1) bound = std::max(bound, 2.0 * score_rounding(q, k, heads_layout ? 0 : H, D));
        for (auto isa : isas) {
            CAPTURE(enum_name(flash_isa_table(), isa));
            CHECK(rel_err(flash_attention(q, k, v, o, isa), truth) < bound);
        }
    }
    torch::set_num_threads(1);
    // The UNet's formulation through the entry point: flash and fused against the reference, with K/V as views into
    // wider tensors (the reused prompt K/V), at SD 1.5's level-0 head width.
    {
        auto q = torch::randn({2, 300, 320}), kw = torch::randn({2, 300, 640}), vw = torch::randn({2, 300, 640});
        auto k = kw.narrow(2, 320, 320), v = vw.narrow(2, 0, 320);
        AttentionOptions o;
        o.heads = 8;
        auto truth = attention_reference(q.to(torch::kDouble), k.to(torch::kDouble), v.to(torch::kDouble), 8,
                                         1.0 / std::sqrt(40.0));
        const double bound = std::max(2e-6, 2 * rel_err(attention_reference(q, k, v, 8, 1.0 / std::sqrt(40.0)), truth));
        for (auto kernel : {AttentionKernel::Flash, AttentionKernel::Fused}) {
            o.kernel = kernel;
            CHECK(rel_err(attention(q, k, v, o), truth) < bound);
        }
    }
    // A NaN in q reaches its row's output in its own head, on every path.
    for (auto isa : isas) {
        auto q = torch::randn({1, 20, 16}), k = torch::randn({1, 300, 16}), v = torch::randn({1, 300, 16});
        q[0][3][1] = std::numeric_limits<float>::quiet_NaN();
        AttentionOptions o;
        o.heads = 2;
        auto out = flash_attention(q, k, v, o, isa);
        CHECK(std::isnan(out[0][3][0].item<float>()));
        CHECK_FALSE(std::isnan(out[0][3][8].item<float>()));
        CHECK_FALSE(std::isnan(out[0][4][0].item<float>()));
    }
    // What it does not take: fewer queries than a tile, additive masks, autograd, other dtypes.
    AttentionOptions o;
    o.heads = 2;
    auto q7 = torch::randn({1, 7, 8});
    CHECK_FALSE(flash_attention_applies(q7, q7, q7, o));
    auto qg = torch::randn({1, 8, 8}).requires_grad_(true);
    CHECK_FALSE(flash_attention_applies(qg, qg, qg, o));
    auto qd = torch::randn({1, 8, 8}, torch::kDouble);
    CHECK_FALSE(flash_attention_applies(qd, qd, qd, o));
    AttentionOptions om = o;
    om.additive_mask = torch::zeros({8, 8});
    auto q8 = torch::randn({1, 8, 8});
    CHECK_FALSE(flash_attention_applies(q8, q8, q8, om));
    CHECK_THROWS_WITH(flash_attention(torch::randn({1, 8, 6}), torch::randn({1, 3, 6}), torch::randn({1, 4, 6}), o),
                      Catch::Contains("do not match"));
}

TEST_CASE("flash_attention with bf16 products: float64 attention of the bf16 operands within the probabilities' "
          "rounding", "[kernels][attention]") {
    if (!flash_bf16_available()) return; // elsewhere bf16_products is ignored (the float32 kernel runs)
    // q, k, v are rounded to bfloat16 once and their products are exact in float32 sums, so the reference is
    // float64 attention of the rounded operands; what is left is the probabilities' own rounding to bfloat16 (relative
    // 2^-9 per term) before P V, bounded by 2^-8 of the output, and far below the rounding of the operands themselves.
    torch::manual_seed(17);
    std::mt19937 rng(5);
    auto pick = [&](std::vector<int64_t> v) { return v[std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng)]; };
    auto rounded = [](const torch::Tensor& t) { return t.to(torch::kBFloat16).to(torch::kDouble); };
    double worst = 0;
    for (int t = 0; t < 40; ++t) {
        torch::set_num_threads(t % 2 ? 2 : 1);
        const int64_t B = pick({1, 2}), N = pick({8, 17, 64, 65, 300}), H = pick({1, 3, 8}),
                      D = pick({1, 5, 8, 40, 64, 80, 160});
        const bool causal = t % 5 == 4, heads_layout = t % 3 == 1;
        const int64_t M = causal ? N + pick({0, 5}) : pick({1, 8, 77, 193, 600});
        AttentionOptions o;
        o.heads = H;
        o.causal = causal;
        o.layout = heads_layout ? AttentionLayout::Heads : AttentionLayout::Projection;
        o.formula = ScoreFormula::ScaleAfter;
        auto shape = [&](int64_t n) {
            return heads_layout ? std::vector<int64_t>{B, H, n, D} : std::vector<int64_t>{B, n, H * D};
        };
        auto q = torch::randn(shape(N)), k = torch::randn(shape(M)), v = torch::randn(shape(M));
        CAPTURE(t, B, N, M, H, D, causal, heads_layout);
        const auto truth_rounded = attention_matmul(rounded(q), rounded(k), rounded(v), o);
        const auto truth = attention_matmul(q.to(torch::kDouble), k.to(torch::kDouble), v.to(torch::kDouble), o);
        o.bf16_products = true;
        const auto y = flash_attention(q, k, v, o);
        const double e = rel_err(y, truth_rounded);
        CHECK(e < std::ldexp(1.0, -8));
        if (D >= 8) CHECK(e < rel_err(truth_rounded, truth)); // the operands' rounding dominates
        worst = std::max(worst, e);
    }
    torch::set_num_threads(1);
    WARN("bf16 flash attention vs float64 of the bf16 operands, worst relative error of 40 cases: " << worst);
    // Through the entry point with the UNet's formulation (77 keys: CLIP's prompt, padded to the key step with masked
    // keys), and a NaN reaching only its own row - on both paths (the vector maximum skips a NaN next to the masked
    // keys' -inf; the softmax step looks for it there).
    auto q = torch::randn({2, 300, 320}), k = torch::randn({2, 77, 320}), v = torch::randn({2, 77, 320});
    AttentionOptions o;
    o.heads = 8;
    o.kernel = AttentionKernel::Flash;
    o.bf16_products = true;
    const double scale = 1.0 / std::sqrt(40.0);
    const auto truth = attention_reference(rounded(q), rounded(k), rounded(v), 8, scale);
    CHECK(rel_err(attention(q, k, v, o), truth) < std::ldexp(1.0, -8));
    q[0][3][1] = std::numeric_limits<float>::quiet_NaN();
    for (bool bf16 : {false, true}) {
        o.bf16_products = bf16;
        const auto out = attention(q, k, v, o);
        CHECK(std::isnan(out[0][3][0].item<float>()));
        CHECK(std::isnan(out[0][3][39].item<float>()));
        CHECK_FALSE(std::isnan(out[0][3][40].item<float>())); // the next head
        CHECK_FALSE(std::isnan(out[0][4][0].item<float>()));
    }
}

namespace {
// The attention the text models computed before kernels::attention served them, kept verbatim as references.
// nanoGPT (GPT-2): full causal forward (M == N) and new tokens after a KV cache (M > N); SEDD/MDLM: no mask.
torch::Tensor gpt2_reference(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, bool causal) {
    const int64_t T = q.size(2), L = k.size(2);
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
    auto att = torch::matmul(q, k.transpose(-2, -1)) * scale;
    if (causal && L == T) {
        auto mask = torch::ones({T, T}, torch::kBool).triu(1);
        att = att.masked_fill(mask, -std::numeric_limits<float>::infinity());
    } else if (causal && T > 1) {
        auto key_slot = torch::arange(L, torch::kLong).view({1, L});
        auto limit = (torch::arange(T, torch::kLong) + (L - T)).view({T, 1});
        att = att.masked_fill(key_slot > limit, -std::numeric_limits<float>::infinity());
    }
    return torch::matmul(att.softmax(-1), v);
}
torch::Tensor mdlm_reference(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
    auto scores = torch::matmul(q, k.transpose(-1, -2)) * scale;
    return torch::matmul(torch::softmax(scores, -1), v);
}
// Hugging Face CLIPAttention on projections [B, T, C] with an additive mask.
torch::Tensor clip_reference(const torch::Tensor& qp, const torch::Tensor& kp, const torch::Tensor& vp, int64_t heads,
                             const torch::Tensor& mask) {
    const auto B = qp.size(0), T = qp.size(1), C = qp.size(2), hd = C / heads;
    const double scale = 1.0 / std::sqrt(double(hd));
    auto split = [&](const torch::Tensor& t) { return t.view({B, T, heads, hd}).transpose(1, 2); };
    auto q = split(qp * scale), k = split(kp), v = split(vp);
    auto scores = torch::matmul(q, k.transpose(-1, -2));
    scores.add_(mask);
    return torch::matmul(scores.softmax(-1), v).transpose(1, 2).reshape({B, T, C});
}
// softmax(q k^T scale + mask) v in float64, heads layout.
torch::Tensor attention_f64(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, bool causal) {
    auto s = torch::matmul(q.to(torch::kDouble), k.to(torch::kDouble).transpose(-2, -1)) / std::sqrt(double(q.size(3)));
    const int64_t N = q.size(2), M = k.size(2);
    if (causal)
        s = s.masked_fill(torch::arange(M).view({1, M}) > (torch::arange(N) + (M - N)).view({N, 1}),
                          -std::numeric_limits<double>::infinity());
    return torch::matmul(s.softmax(-1), v.to(torch::kDouble));
}
} // namespace

TEST_CASE("attention formulations: each model family's bits, on random shapes", "[kernels][attention]") {
    // The ScaleAfter and PreScaledQuery formulations have one path each (their reference arithmetic); the Diffusers
    // one's fast paths are tested above. Here: attention() against the code each model ran before, bit for bit, and
    // every formulation and layout against float64.
    torch::manual_seed(3);
    std::mt19937 rng(17);
    auto pick = [&](std::vector<int64_t> v) { return v[std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng)]; };
    for (int t = 0; t < 60; ++t) {
        const int64_t B = pick({1, 2}), H = pick({1, 2, 4, 12}), D = pick({1, 4, 8, 32, 64}),
                      N = pick({1, 2, 5, 16, 33}), extra = pick({0, 0, 1, 7, 40}), M = N + extra;
        const double mag = pick({1, 1, 20});
        CAPTURE(B, H, D, N, M, mag);
        auto q = torch::randn({B, H, N, D}) * mag, k = torch::randn({B, H, M, D}), v = torch::randn({B, H, M, D});
        // GPT-2's KV cache hands over views of a larger buffer.
        auto kbuf = torch::randn({B, H, M + 3, D}), vbuf = torch::randn({B, H, M + 3, D});
        kbuf.narrow(2, 0, M).copy_(k);
        vbuf.narrow(2, 0, M).copy_(v);
        AttentionOptions gpt2;
        gpt2.layout = AttentionLayout::Heads;
        gpt2.formula = ScoreFormula::ScaleAfter;
        gpt2.causal = true;
        const auto ours = attention(q, kbuf.narrow(2, 0, M), vbuf.narrow(2, 0, M), gpt2);
        CHECK(torch::equal(ours, gpt2_reference(q, kbuf.narrow(2, 0, M), vbuf.narrow(2, 0, M), true)));
        const double tol = 2e-6 * std::max(1.0, mag);
        CHECK(rel_err(ours, attention_f64(q, k, v, true)) < tol);
        AttentionOptions mdlm = gpt2;
        mdlm.causal = false;
        const auto bidir = attention(q, k, v, mdlm);
        CHECK(torch::equal(bidir, mdlm_reference(q, k, v)));
        CHECK(rel_err(bidir, attention_f64(q, k, v, false)) < tol);

        // Projection layout [B, T, H*D]: CLIP's formulation with its additive causal mask (self-attention, M = N).
        auto to_proj = [&](const torch::Tensor& x) { return x.transpose(1, 2).reshape({B, x.size(2), H * D}); };
        const auto qp = to_proj(q), kp = to_proj(k.narrow(2, 0, N)), vp = to_proj(v.narrow(2, 0, N));
        auto mask = torch::full({N, N}, -std::numeric_limits<float>::infinity()).triu(1);
        AttentionOptions clip;
        clip.heads = H;
        clip.formula = ScoreFormula::PreScaledQuery;
        clip.additive_mask = mask;
        const auto c = attention(qp, kp, vp, clip);
        CHECK(torch::equal(c, clip_reference(qp, kp, vp, H, mask)));
        const auto truth = to_proj(attention_f64(q, k.narrow(2, 0, N), v.narrow(2, 0, N), true));
        CHECK(rel_err(c, truth) < tol);
        // The same attention through the other formulations and layouts agrees up to rounding.
        AttentionOptions proj_causal = clip;
        proj_causal.formula = ScoreFormula::ScaleAfter;
        proj_causal.additive_mask = torch::Tensor();
        proj_causal.causal = true;
        CHECK(rel_err(attention(qp, kp, vp, proj_causal), truth) < tol);
        AttentionOptions diffusers;
        diffusers.heads = H;
        const auto full_truth = to_proj(attention_f64(q, k, v, false));
        CHECK(rel_err(attention(qp, to_proj(k), to_proj(v), diffusers), full_truth) < tol);
        AttentionOptions proj = diffusers;
        proj.formula = ScoreFormula::ScaleAfter;
        CHECK(rel_err(attention(qp, to_proj(k), to_proj(v), proj), full_truth) < tol);
    }
    // What the formulations refuse.
    auto q = torch::randn({1, 4, 8}), k = torch::randn({1, 5, 8});
    AttentionOptions bad;
    bad.heads = 2;
    bad.causal = true; // the diffusers formulation has no mask
    CHECK_THROWS_WITH(attention(q, k, k, bad), Catch::Contains("no mask"));
    bad.causal = false;
    bad.formula = ScoreFormula::ScaleAfter;
    CHECK_THROWS_WITH(attention(q, torch::randn({1, 5, 6}), k, bad), Catch::Contains("do not match"));
    bad.layout = AttentionLayout::Heads;
    CHECK_THROWS_WITH(attention(q, k, k, bad), Catch::Contains("[B, heads, tokens, head_dim]"));
}

TEST_CASE("kernel performance vs reference paths", "[.kernels-perf]") {
    const bool gpu = cuda_ready();
    const torch::Device dev = gpu ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
    auto sync = [&] {
        if (gpu) torch::cuda::synchronize();
    };
    auto time_ms = [&](const std::function<void()>& f, int reps) {
        f(); // warm-up: plans, bases, allocator
        sync();
        std::vector<double> t;
        for (int r = 0; r < reps; ++r) {
            const auto t0 = std::chrono::steady_clock::now();
            f();
            sync();
            t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
        }
        std::sort(t.begin(), t.end());
        return t[t.size() / 2]; // median
    };
    auto row = [](const std::string& name, const std::string& shape, double ours, double torch_ms, double cpu) {
        std::cout << "kernel-perf | " << std::left << std::setw(22) << name << " | " << std::setw(18) << shape << " | "
                  << std::fixed << std::setprecision(3) << ours << " | " << torch_ms << " | " << cpu << " | "
                  << std::setprecision(2) << torch_ms / ours << "x | " << cpu / ours << "x" << std::defaultfloat
                  << "\n";
    };
    // SD feature maps: conv_in at 256 and 512 (CFG batch 2), the mid block at 512 (8x8), a deep 16x16 level.
    for (const auto& s :
         std::vector<std::vector<int64_t>>{{2, 320, 32, 32}, {2, 320, 64, 64}, {2, 1280, 8, 8}, {2, 1280, 16, 16}}) {
        auto x_cpu = torch::randn(s);
        auto x = x_cpu.to(dev);
        const int reps = gpu ? 50 : 5;
        const double ours = time_ms([&] { (void)dct_energy(x); }, reps);
        const double tor = time_ms([&] { (void)cache::spectral_energy(x); }, reps);
        const double cpu = time_ms([&] { (void)dct_energy_cpu(x_cpu); }, gpu ? 3 : 2);
        CHECK(rel_err(dct_energy(x), dct_energy_cpu(x_cpu)) < 1e-4);
        row("dct_energy", shape_str(s), ours, tor, cpu);
    }
    // Attention of the fashion UNet's 8x8 level (batch 20 = 10 prompts x guidance, 4 heads of 8; self and cross with
    // 77 prompt tokens) and of SD 1.5's 16x16 level at 128x128 (heads of 40): fused kernel vs matmul-softmax-matmul.
    if (!gpu)
        for (const auto& s :
             std::vector<std::vector<int64_t>>{{20, 64, 64, 4, 8}, {20, 64, 77, 4, 8}, {2, 256, 77, 8, 40}}) {
            const int64_t C = s[3] * s[4];
            auto q = torch::randn({s[0], s[1], C}), k = torch::randn({s[0], s[2], C}),
                 v = torch::randn({s[0], s[2], C});
            const double sc = 1.0 / std::sqrt(double(s[4]));
            const double ours = time_ms([&] { (void)small_attention(q, k, v, s[3], sc); }, 50);
            const double tor = time_ms([&] { (void)attention_torch(q, k, v, s[3], sc); }, 50);
            const double port = time_ms([&] { (void)small_attention(q, k, v, s[3], sc, true); }, 20);
            CHECK(rel_err(small_attention(q, k, v, s[3], sc), attention_torch(q, k, v, s[3], sc)) < 2e-6);
            row("small_attention", shape_str(s), ours, tor, port);
            if (blas_attention_available()) {
                const double exact = time_ms([&] { (void)blas_attention(q, k, v, s[3], sc); }, 50);
                const double refp = time_ms([&] { (void)attention_reference(q, k, v, s[3], sc); }, 50);
                row("blas_attention", shape_str(s), exact, refp, ours);
            }
        }
    // SD 1.5 at 512x512 (CFG batch 2): level-0 self attention (4096 tokens, 8 heads of 40) and cross attention (77
    // prompt tokens), level 1 (1024 tokens, heads of 80), the VAE mid-block (one head of 512 over 4096 tokens):
    // the tiled kernel vs the exact BLAS path (the reference's arithmetic) and the portable tiled path.
    if (!gpu)
        for (const auto& s : std::vector<std::vector<int64_t>>{
                 {2, 4096, 4096, 8, 40}, {2, 4096, 77, 8, 40}, {2, 1024, 1024, 8, 80}, {1, 4096, 4096, 1, 512}}) {
            const int64_t C = s[3] * s[4];
            auto q = torch::randn({s[0], s[1], C}), k = torch::randn({s[0], s[2], C}),
                 v = torch::randn({s[0], s[2], C});
            AttentionOptions o;
            o.heads = s[3];
            const double sc = 1.0 / std::sqrt(double(s[4]));
            const double ours = time_ms([&] { (void)flash_attention(q, k, v, o); }, 3);
            const double exact = blas_attention_available()
                                     ? time_ms([&] { (void)blas_attention(q, k, v, s[3], sc); }, 3)
                                     : time_ms([&] { (void)attention_reference(q, k, v, s[3], sc); }, 3);
            const double port = time_ms([&] { (void)flash_attention(q, k, v, o, FlashIsa::Portable); }, 1);
            auto truth =
                attention_reference(q.to(torch::kDouble), k.to(torch::kDouble), v.to(torch::kDouble), s[3], sc);
            CHECK(rel_err(flash_attention(q, k, v, o), truth) <
                  std::max(2e-6, 2 * rel_err(attention_reference(q, k, v, s[3], sc), truth)));
            row("flash_attention", shape_str(s), ours, exact, port);
        }
    // One decode step of GPT-2 small (12 heads x 64) and of a large model (32 x 128), every layer: the per-token
    // cache write of sink-rolling KV.
    for (const auto& s : std::vector<std::vector<int64_t>>{{1, 12, 1024, 64}, {8, 32, 4096, 128}}) {
        auto kb = torch::zeros(s, torch::TensorOptions().device(dev)), vb = torch::zeros_like(kb);
        auto k = torch::randn({s[0], s[1], s[3]}).to(dev), v = torch::randn({s[0], s[1], s[3]}).to(dev);
        int64_t pos = 0;
        const int reps = 200;
        const double ours = time_ms([&] { ring_write(kb, vb, k, v, ring_slot(pos++, 4, s[2] - 4)); }, reps);
        const double tor = time_ms(
            [&] {
                const int64_t slot = ring_slot(pos++, 4, s[2] - 4);
                kb.select(2, slot).copy_(k);
                vb.select(2, slot).copy_(v);
            },
            reps);
        auto kc = kb.cpu(), vc = vb.cpu(), k1 = k.cpu(), v1 = v.cpu();
        const double cpu = time_ms([&] { ring_write_cpu(kc, vc, k1, v1, ring_slot(pos++, 4, s[2] - 4)); }, reps);
        row("ring_write f32", shape_str(s), ours, tor, cpu);
    }
    SUCCEED();
}

TEST_CASE("batch-1 decode ops match the tensor operations", "[kernels][decode_ops]") {
    torch::manual_seed(21);
    for (int64_t n : {1, 7, 16, 64, 100, 768, 3072, 3073}) {
        auto x = torch::randn({n}) * 3.0;
        auto g = torch::randn({n}), b = torch::randn({n});
        auto y = torch::empty({n});
        kernels::layer_norm_row(x.data_ptr<float>(), g.data_ptr<float>(), b.data_ptr<float>(), y.data_ptr<float>(), n,
                                1e-5f);
        auto want = torch::layer_norm(x.to(torch::kDouble), {n}, g.to(torch::kDouble), b.to(torch::kDouble), 1e-5);
        INFO("n " << n);
        CHECK((y.to(torch::kDouble) - want).abs().max().item<double>() < 1e-5 * (1 + want.abs().max().item<double>()));
        // GELU over a wide range (|x| up to ~15: tanh saturates, and the small-|x| side where 1 - e cancels).
        auto gx = torch::randn({n}) * 5.0;
        auto fast = gx.clone(), ref = gx.clone(), erf = gx.clone();
        kernels::gelu_tanh_row(fast.data_ptr<float>(), n);
        kernels::gelu_tanh_row_ref(ref.data_ptr<float>(), n);
        kernels::gelu_erf_row(erf.data_ptr<float>(), n);
        auto want_t = torch::gelu(gx.to(torch::kDouble), "tanh");
        CHECK((fast.to(torch::kDouble) - want_t).abs().max().item<double>() <
              2e-6 * (1 + gx.abs().max().item<double>()));
        CHECK((ref.to(torch::kDouble) - want_t).abs().max().item<double>() <
              2e-6 * (1 + gx.abs().max().item<double>()));
        CHECK((erf.to(torch::kDouble) - torch::gelu(gx.to(torch::kDouble))).abs().max().item<double>() <
              2e-6 * (1 + gx.abs().max().item<double>()));
    }
    for (auto [heads, d, len, slots] : std::vector<std::array<int64_t, 4>>{
             {1, 16, 1, 1}, {12, 64, 16, 20}, {4, 16, 33, 40}, {3, 8, 5, 9}, {2, 24, 17, 17}, {12, 64, 900, 1024}}) {
        auto q = torch::randn({heads * d});
        auto k = torch::randn({heads, slots, d}) * 0.5, v = torch::randn({heads, slots, d});
        const float scale = 1.f / std::sqrt(float(d));
        auto fast = torch::empty({heads * d}), ref = torch::empty({heads * d});
        kernels::attend_one_query(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), fast.data_ptr<float>(),
                                  heads, d, len, slots * d, scale);
        kernels::attend_one_query_ref(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
                                      ref.data_ptr<float>(), heads, d, len, slots * d, scale);
        auto kd = k.narrow(1, 0, len).to(torch::kDouble), vd = v.narrow(1, 0, len).to(torch::kDouble);
        auto qd = q.view({heads, 1, d}).to(torch::kDouble);
        auto want = torch::matmul(torch::softmax(torch::matmul(qd, kd.transpose(1, 2)) * double(scale), -1), vd)
                        .reshape({heads * d});
        INFO(heads << " heads x " << d << ", " << len << " of " << slots << " slots");
        CHECK((fast.to(torch::kDouble) - want).abs().max().item<double>() < 1e-5);
        CHECK((ref.to(torch::kDouble) - want).abs().max().item<double>() < 1e-5);
    }
}

TEST_CASE("geglu equals chunk, gelu and mul within erf's approximation", "[kernels][geglu]") {
    c10::InferenceMode guard;
    torch::manual_seed(11);
    // Rows of several widths (vector bodies and scalar tails), values out to the tails, zeros, signs, a NaN.
    for (const int64_t F : {1, 7, 8, 16, 23, 40, 1280}) {
        auto h = torch::randn({3, 5, 2 * F}) * 3;
        h.view(-1).narrow(0, 0, 4).copy_(torch::tensor({0.f, -0.f, -12.f, 12.f}));
        const auto ref = kernels::geglu_torch(h.to(torch::kDouble)).to(torch::kFloat);
        const auto got = kernels::geglu(h);
        REQUIRE(got.sizes() == ref.sizes());
        // |error| of GELU(x) = x/2 (1 + erf): |x|/2 * 1.5e-7 from erf, plus float32 rounding of the products.
        const auto a = h.narrow(-1, 0, F).abs(), x = h.narrow(-1, F, F).abs();
        const auto bound = a * (x * 1e-7 + 2e-7 * x.clamp_min(1)) + 1e-30;
        const double worst = ((got - ref).abs() / bound).max().item<double>();
        INFO("F " << F << ": worst error / bound " << worst);
        CHECK(worst <= 1.0);
    }
    auto h = torch::randn({2, 32});
    h[1][20] = std::numeric_limits<float>::quiet_NaN();
    const auto y = kernels::geglu(h);
    CHECK(std::isnan(y[1][4].item<float>()));
    CHECK(torch::isfinite(y[0]).all().item<bool>());
    CHECK_FALSE(kernels::geglu_applies(torch::zeros({2, 3})));
    CHECK_FALSE(kernels::geglu_applies(torch::zeros({4, 6}).t()));
    CHECK_FALSE(kernels::geglu_applies(torch::zeros({2, 4}, torch::kDouble)));
}
