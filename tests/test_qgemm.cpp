// Linear layers on kept weights (kernels/qgemm.h): the tiled fast path against dequantise-then-matmul on random shapes
// (rows and inputs not multiples of the tile or of the 32-value block), the stored-form checks, lookups and
// permutations.
#include "cache/io/error.h"
#include "kernels/qgemm.h"

#include <catch2/catch.hpp>

namespace anchor::kernels {

namespace {
double qgemm_rel_err(const torch::Tensor& a, const torch::Tensor& b) {
    return (a - b).abs().max().item<double>() / std::max(1e-30, b.abs().max().item<double>());
}
} // namespace

TEST_CASE("qgemm fast path equals dequantise-then-matmul on random shapes, ragged inputs included", "[qgemm]") {
    torch::manual_seed(3);
    // (n activation rows, weight rows, inputs): inputs % 32 != 0 (a zero-padded last block), rows not a tile multiple.
    const std::vector<std::array<int64_t, 3>> shapes = {{1, 1, 32},   {3, 17, 33},  {7, 300, 64},  {16, 1000, 96},
                                                        {5, 64, 1},   {2, 5, 31},   {64, 129, 257}, {33, 4100, 40},
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
