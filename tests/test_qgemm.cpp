// Linear layers on kept weights (kernels/qgemm.h): the tiled fast path against dequantise-then-matmul on random shapes
// (rows and inputs not multiples of the tile or of the 32-value block), the stored-form checks, lookups and
// permutations.
#include "cache/io/error.h"
#include "kernels/qgemm.h"
#include "kernels/qgemm_arith.h"

#include <catch2/catch.hpp>

#include <ATen/Parallel.h>

#include <chrono>
#include <cmath>

namespace anchor::kernels {

namespace {
double qgemm_rel_err(const torch::Tensor& a, const torch::Tensor& b) {
    return (a - b).abs().max().item<double>() / std::max(1e-30, b.abs().max().item<double>());
}
} // namespace

TEST_CASE("qgemm fast path equals dequantise-then-matmul on random shapes, ragged inputs included", "[qgemm]") {
    torch::manual_seed(3);
    // (n activation rows, weight rows, inputs): inputs % 32 != 0 (a zero-padded last block), rows not a tile multiple.
    const std::vector<std::array<int64_t, 3>> shapes = {{1, 1, 32},     {3, 17, 33},   {7, 300, 64},   {16, 1000, 96},
                                                        {5, 64, 1},     {2, 5, 31},    {64, 129, 257}, {33, 4100, 40},
                                                        {256, 96, 320}, {1, 2049, 128}};
    for (auto t : {QWeightType::F32, QWeightType::F16, QWeightType::BF16, QWeightType::Q8_0, QWeightType::Q4_0}) {
        for (const auto& [n, rows, cols] : shapes) {
            CAPTURE(enum_name(qweight_type_table(), t), n, rows, cols);
            auto w = torch::randn({rows, cols});
            auto x = torch::randn({1, n, cols});
            auto b = torch::randn({rows});
            const auto q = QWeight::from_float(w, t);
            CHECK(q.bytes() == rows * QWeight::row_bytes(t, cols));
            auto fast = qlinear(x, q, b), ref = qlinear_ref(x, q, b);
            REQUIRE(fast.sizes() == torch::IntArrayRef({1, n, rows}));
            // The same float32 products of the same dequantised weights; only BLAS's summation order differs.
            CHECK(qgemm_rel_err(fast, ref) < 2e-6);
            CHECK(qgemm_rel_err(qlinear(x, q), ref - b) < 2e-6);
        }
    }
}

TEST_CASE("qgemm float32 weights run the plain linear layer bit for bit", "[qgemm]") {
    torch::manual_seed(4);
    auto w = torch::randn({70, 45}), x = torch::randn({1, 9, 45}), b = torch::randn({70});
    const auto q = QWeight::from_float(w, QWeightType::F32);
    CHECK(torch::equal(qlinear(x, q), torch::matmul(x, w.t())));
    CHECK(torch::equal(qlinear(x, q, b), torch::addmm(b, x.reshape({9, 45}), w.t()).view({1, 9, 70})));
}

TEST_CASE("qgemm quantised weights stay within half a quantisation step of the originals", "[qgemm]") {
    torch::manual_seed(5);
    auto w = torch::randn({40, 70}); // 70 = 2 blocks + 6 values
    for (auto t : {QWeightType::Q8_0, QWeightType::Q4_0}) {
        const auto d = QWeight::from_float(w, t).dequantize();
        // Per 32-value block: q8_0's step is max|v| / 127, q4_0's max|v| / 8 (rounding to nearest: half a step; the
        // float16 scale adds about 2^-11 of max|v|).
        for (int64_t c0 = 0; c0 < 70; c0 += 32) {
            const int64_t m = std::min<int64_t>(32, 70 - c0);
            auto wb = w.narrow(1, c0, m), db = d.narrow(1, c0, m);
            auto amax = std::get<0>(wb.abs().max(1));
            // q4_0 clips the extreme opposite in sign to the block's largest value to code 15: a whole step.
            const double step = t == QWeightType::Q8_0 ? 1.0 / 127 : 1.0 / 8, k = t == QWeightType::Q8_0 ? 0.5 : 1.0;
            CHECK((std::get<0>((wb - db).abs().max(1)) <= amax * (k * step + step * 0.01 + 1e-3)).all().item<bool>());
        }
    }
}

TEST_CASE("qgemm lookups, permutations and stored forms", "[qgemm]") {
    torch::manual_seed(6);
    auto w = torch::randn({12, 64});
    for (auto t : {QWeightType::F32, QWeightType::BF16, QWeightType::Q8_0, QWeightType::Q4_0}) {
        const auto q = QWeight::from_float(w, t);
        const auto full = q.dequantize();
        auto ids = torch::tensor(std::vector<int64_t>{3, 0, 11, 3}, torch::kLong).reshape({2, 2});
        CHECK(torch::equal(q.gather_rows(ids), full.index_select(0, ids.reshape({-1})).reshape({2, 2, 64})));
        CHECK_THROWS_AS(q.gather_rows(torch::tensor(std::vector<int64_t>{12}, torch::kLong)), Error);
        auto perm = torch::tensor(std::vector<int64_t>{1, 0, 2, 3, 5, 4, 6, 7, 8, 9, 11, 10}, torch::kLong);
        CHECK(torch::equal(q.permute_rows(perm).dequantize(), full.index_select(0, perm)));
        const auto again = QWeight::from_stored(q.data, t, 12, 64, "test weight");
        CHECK(torch::equal(again.dequantize(), full));
    }
    try {
        QWeight::from_stored(torch::zeros({12, 35}, torch::kUInt8), QWeightType::Q8_0, 12, 64, "blk.0.attn_q.weight");
        FAIL("a wrong row length was accepted");
    } catch (const Error& e) {
        CHECK(std::string(e.what()).find("blk.0.attn_q.weight") != std::string::npos);
        CHECK(std::string(e.what()).find("[12, 68]") != std::string::npos);
    }
}

} // namespace anchor::kernels

// ---- the arithmetic of kernels/qgemm_arith.h ----------------------------------------------------------------------

namespace anchor::kernels {

namespace {
// Shapes with ragged everything: activation rows not a multiple of the kernels' passes (6 for Int8, 12 for Bf16),
// weight rows not a multiple of the 32-row panel, inputs not a multiple of the 32-value block (odd too: Bf16's pairs),
// and one past Bf16's 2048-input chunk.
const std::vector<std::array<int64_t, 3>>& qgemm_arith_shapes() {
    static const std::vector<std::array<int64_t, 3>> s = {{1, 1, 32},    {3, 17, 33},  {7, 33, 64},    {13, 100, 96},
                                                          {5, 64, 1},    {2, 5, 31},   {19, 129, 257}, {6, 40, 70},
                                                          {25, 96, 320}, {4, 31, 4100}};
    return s;
}

// |x| per 32-value block, max: [n, blocks]; and |W| per block, summed: [rows, blocks].
torch::Tensor qgemm_block_amax(const torch::Tensor& x) {
    const int64_t cols = x.size(-1), nb = (cols + 31) / 32;
    auto p = torch::constant_pad_nd(x.abs(), {0, nb * 32 - cols});
    return std::get<0>(p.reshape({x.size(0), nb, 32}).max(-1));
}
torch::Tensor qgemm_block_l1(const torch::Tensor& w) {
    const int64_t cols = w.size(-1), nb = (cols + 31) / 32;
    return torch::constant_pad_nd(w.abs(), {0, nb * 32 - cols}).reshape({w.size(0), nb, 32}).sum(-1);
}
} // namespace

TEST_CASE("qgemm int8 equals its reference arithmetic and stays within the activations' rounding of float32",
          "[qgemm]") {
    torch::manual_seed(7);
    for (auto t : {QWeightType::Q8_0, QWeightType::Q4_0}) {
        for (const auto& [n, rows, cols] : qgemm_arith_shapes()) {
            CAPTURE(enum_name(qweight_type_table(), t), n, rows, cols);
            auto w = torch::randn({rows, cols});
            auto x = torch::randn({n, cols}) * (1 + torch::rand({n, 1}) * 3);
            auto b = torch::randn({rows});
            const auto q = QWeight::from_float(w, t);
            const auto fast = qlinear_int8(x.view({1, n, cols}), q, b);
            REQUIRE(fast.sizes() == torch::IntArrayRef({1, n, rows}));
            // The same quantised activations and exact int32 block dots; float32 against double sums.
            const auto ref = qlinear_int8_ref(x, q, b).view({1, n, rows});
            CHECK(qgemm_rel_err(fast, ref) < 1e-5);
            CHECK(qgemm_rel_err(qlinear_with(x.view({1, n, cols}), q, b, QGemmArithmetic::Int8), ref) < 1e-5);
            // Against the float32 product of the dequantised weights: each activation moves by at most half its
            // block's step max|x_block| / 127, so a result by at most sum_blocks |w_block|_1 max|x_block| / 254
            // (1 % for float32's own rounding of the scales and sums).
            const auto exact = qlinear_ref(x, q, b);
            const auto bound = torch::matmul(qgemm_block_amax(x) / 254.0, qgemm_block_l1(q.dequantize()).t());
            CHECK(((fast.view({n, rows}) - exact).abs() <= bound * 1.01 + 1e-5).all().item<bool>());
        }
    }
}

TEST_CASE("qgemm bf16 stays within bfloat16's rounding of both operands", "[qgemm]") {
    if (!qgemm_arithmetic_unavailable(QGemmArithmetic::Bf16).empty()) {
        CHECK_THROWS_AS(
            qlinear_bf16(torch::randn({2, 32}), QWeight::from_float(torch::randn({4, 32}), QWeightType::Q8_0)), Error);
        return;
    }
    torch::manual_seed(8);
    for (auto t : {QWeightType::F16, QWeightType::BF16, QWeightType::Q8_0, QWeightType::Q4_0}) {
        for (const auto& [n, rows, cols] : qgemm_arith_shapes()) {
            CAPTURE(enum_name(qweight_type_table(), t), n, rows, cols);
            auto w = torch::randn({rows, cols});
            auto x = torch::randn({1, n, cols});
            auto b = torch::randn({rows});
            const auto q = QWeight::from_float(w, t);
            const auto fast = qlinear_with(x, q, b, QGemmArithmetic::Bf16);
            REQUIRE(fast.sizes() == torch::IntArrayRef({1, n, rows}));
            // Each operand rounded to nearest bfloat16 (8 significant bits: relative 2^-8): a product moves by at most
            // (2^-7 + 2^-16) of |w x|; float32 sums add K 2^-24 of sum |w x| (inside the 1 % margin), and the bias'
            // addition rounds each side to float32 (two units in the last place of the result).
            const auto bound = torch::matmul(x.abs(), q.dequantize().abs().t()) * (std::ldexp(1.0, -7) * 1.01);
            const auto exact = qlinear_ref(x, q, b);
            CHECK(((fast - exact).abs() <= bound + exact.abs() * std::ldexp(1.0, -22) + 1e-6).all().item<bool>());
            // The same operands rounded by LibTorch, multiplied in double: only the summation order differs.
            const auto xr = x.to(torch::kBFloat16).to(torch::kDouble),
                       wr = q.dequantize().to(torch::kBFloat16).to(torch::kDouble);
            const auto same = (torch::matmul(xr, wr.t()) + b.to(torch::kDouble)).to(torch::kFloat32);
            CHECK(qgemm_rel_err(fast, same) < 1e-5);
        }
    }
}

TEST_CASE("qgemm arithmetic dispatch: float32 weights stay float32, int8 leaves float16 weights to float32",
          "[qgemm]") {
    torch::manual_seed(9);
    auto w = torch::randn({37, 45}), x = torch::randn({1, 9, 45}), b = torch::randn({37});
    for (auto a : {QGemmArithmetic::F32, QGemmArithmetic::Int8}) {
        const auto f32 = QWeight::from_float(w, QWeightType::F32), f16 = QWeight::from_float(w, QWeightType::F16);
        CHECK(torch::equal(qlinear_with(x, f32, b, a), qlinear(x, f32, b)));
        CHECK(torch::equal(qlinear_with(x, f16, b, a), qlinear(x, f16, b)));
    }
    const auto q4 = QWeight::from_float(w, QWeightType::Q4_0);
    CHECK(torch::equal(qlinear_with(x, q4, b, QGemmArithmetic::F32), qlinear(x, q4, b)));
    CHECK(enum_from_string(qgemm_arithmetic_table(), "int8", "qgemm") == QGemmArithmetic::Int8);
    CHECK(qgemm_arithmetic_unavailable(QGemmArithmetic::Int8).empty());
    CHECK_THROWS_AS(qlinear_int8(x, QWeight::from_float(w, QWeightType::BF16)), Error);
}

// The measurement behind default_qgemm_arithmetic(): one LLaDA-8B-shaped slice (320 positions, 4096 inputs; 14336 for
// the down projection) in each arithmetic, the minimum of several runs, one thread. Hidden: run it by name,
//   build/tests/anchor_tests "[.qgemm-bench]"
TEST_CASE("qgemm arithmetic microbenchmark", "[.qgemm-bench]") {
    const int threads = at::get_num_threads();
    at::set_num_threads(1);
    torch::manual_seed(10);
    for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{512, 4096}, {256, 14336}}) {
        auto x = torch::randn({1, 320, cols});
        for (auto t : {QWeightType::Q4_0, QWeightType::Q8_0}) {
            const auto q = QWeight::from_float(torch::randn({rows, cols}), t);
            std::string line = enum_name(qweight_type_table(), t) + " 320x" + std::to_string(cols) + " x " +
                               std::to_string(rows) + " rows:";
            for (auto a : {QGemmArithmetic::F32, QGemmArithmetic::Bf16, QGemmArithmetic::Int8}) {
                if (!qgemm_arithmetic_unavailable(a).empty()) continue;
                double best = 1e30;
                for (int rep = 0; rep < 7; ++rep) {
                    const auto t0 = std::chrono::steady_clock::now();
                    auto y = qlinear_with(x, q, {}, a);
                    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
                }
                line += " " + enum_name(qgemm_arithmetic_table(), a) + " " + std::to_string(best * 1e3) + " ms (" +
                        std::to_string(2.0 * 320 * rows * cols / best / 1e9) + " GFLOP/s)";
            }
            WARN(line);
        }
    }
    at::set_num_threads(threads);
}

} // namespace anchor::kernels
