// LibTorch's fused attention operator behind attention() (kernels/attention_sdpa.cpp): against the reference paths
// on random shapes of every formulation, layout and mask, on the CPU (any LibTorch >= 2.1 build) and on a GPU
// ([cuda], skipped with the reason where none is usable); and what a LibTorch without the operator says.
#include "kernels/attention.h"
#include "tests/test_util.h"

#include <catch2/catch.hpp>

#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <iomanip>
#include <iostream>
#include <random>
#include <vector>

using namespace anchor;
using namespace anchor::kernels;
using anchor::test::rel_err;

namespace {

// The reference arithmetic of each formulation in float64: the truth both sides are measured against.
torch::Tensor sdpa_truth(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, AttentionOptions o) {
    auto d = [](const torch::Tensor& t) { return t.to(torch::kCPU).to(torch::kDouble); };
    o.kernel = AttentionKernel::Reference;
    if (o.additive_mask.defined()) o.additive_mask = d(o.additive_mask);
    if (o.formula == ScoreFormula::Diffusers) {
        const int64_t D = q.size(2) / o.heads;
        return attention_reference(d(q), d(k), d(v), o.heads, o.scale >= 0 ? o.scale : 1.0 / std::sqrt(double(D)));
    }
    return attention_matmul(d(q), d(k), d(v), o);
}

// The reference path at the inputs' own precision (float32 on the CPU): its error against the truth bounds the
// operator's (another summation order, the same float32 rounding).
torch::Tensor sdpa_reference(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, AttentionOptions o) {
    auto c = [](const torch::Tensor& t) { return t.to(torch::kCPU).to(torch::kFloat); };
    o.kernel = AttentionKernel::Reference;
    if (o.additive_mask.defined()) o.additive_mask = c(o.additive_mask);
    return attention(c(q), c(k), c(v), o);
}

struct SdpaCase {
    ScoreFormula formula;
    AttentionLayout layout;
    int64_t B, H, N, M, D;
    bool causal, mask;
};

// Random cases: the UNet's (diffusers, projection, no mask), GPT-2's (ScaleAfter, heads, causal with N <= M: a full
// forward and new tokens after a KV cache) and CLIP's (PreScaledQuery, projection, additive causal mask).
std::vector<SdpaCase> sdpa_random_cases(int n, uint64_t seed) {
    std::mt19937_64 rng(seed);
    auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
    std::vector<SdpaCase> cases;
    for (int i = 0; i < n; ++i) {
        const int64_t B = pick(1, 3), H = pick(1, 6), D = std::vector<int64_t>{8, 16, 40, 64}[size_t(pick(0, 3))];
        switch (i % 3) {
        case 0: cases.push_back({ScoreFormula::Diffusers, AttentionLayout::Projection, B, H, pick(1, 300), pick(1, 300),
                                 D, false, false});
            break;
        case 1: {
            const int64_t N = pick(1, 64);
            cases.push_back({ScoreFormula::ScaleAfter, AttentionLayout::Heads, B, H, N, N + pick(0, 1) * pick(0, 100),
                             D, true, false});
            break;
        }
        default: {
            const int64_t N = pick(2, 77);
            cases.push_back({ScoreFormula::PreScaledQuery, AttentionLayout::Projection, B, H, N, N, D, false, true});
        }
        }
    }
    return cases;
}

struct SdpaInputs {
    torch::Tensor q, k, v;
    AttentionOptions o;
};

SdpaInputs sdpa_make_inputs(const SdpaCase& c, torch::Device dev, torch::ScalarType dtype, int64_t seed) {
    torch::manual_seed(uint64_t(seed));
    SdpaInputs in;
    const bool proj = c.layout == AttentionLayout::Projection;
    auto shape = [&](int64_t n) {
        return proj ? std::vector<int64_t>{c.B, n, c.H * c.D} : std::vector<int64_t>{c.B, c.H, n, c.D};
    };
    in.q = torch::randn(shape(c.N)).to(dev, dtype);
    in.k = torch::randn(shape(c.M)).to(dev, dtype);
    in.v = torch::randn(shape(c.M)).to(dev, dtype);
    in.o.heads = proj ? c.H : 1;
    in.o.layout = c.layout;
    in.o.formula = c.formula;
    in.o.causal = c.causal;
    in.o.kernel = AttentionKernel::Fused;
    if (c.mask) // CLIP's causal mask as an additive 0 / -inf matrix
        in.o.additive_mask =
            torch::full({c.N, c.M}, -INFINITY).triu(1).view({1, 1, c.N, c.M}).to(dev, dtype);
    return in;
}

std::string sdpa_describe(const SdpaCase& c) {
    static const char* f[] = {"diffusers", "scale-after", "pre-scaled"};
    return std::string(f[int(c.formula)]) + " B" + std::to_string(c.B) + " H" + std::to_string(c.H) + " N" +
           std::to_string(c.N) + " M" + std::to_string(c.M) + " D" + std::to_string(c.D) + (c.causal ? " causal" : "") +
           (c.mask ? " mask" : "");
}

} // namespace

TEST_CASE("scaled_dot_product_attention matches the reference on random shapes", "[kernels][sdpa]") {
    if (!sdpa_available()) {
        // LibTorch 1.13: attention() keeps its own paths, and asking for the operator names the version.
        CHECK(!sdpa_applies(torch::randn({1, 8, 8}), torch::randn({1, 8, 8}), torch::randn({1, 8, 8}), {}));
        CHECK_THROWS_WITH(sdpa_attention(torch::randn({1, 8, 8}), torch::randn({1, 8, 8}), torch::randn({1, 8, 8}), {}),
                          Catch::Contains("has no scaled_dot_product_attention") && Catch::Contains(TORCH_VERSION));
        return;
    }
    int64_t seed = 0;
    for (const auto& c : sdpa_random_cases(24, 58)) {
        INFO(sdpa_describe(c));
        auto in = sdpa_make_inputs(c, torch::kCPU, torch::kFloat, ++seed);
        const auto t = sdpa_truth(in.q, in.k, in.v, in.o);
        const double ref_err = rel_err(sdpa_reference(in.q, in.k, in.v, in.o), t);
        const double err = rel_err(sdpa_attention(in.q, in.k, in.v, in.o), t);
        // Another float32 summation order: a few times the reference's own rounding, never more than 1e-5.
        CHECK(err < std::max(1e-5, 4 * ref_err));
    }
    // On the CPU attention() keeps the project's kernels (sdpa_applies is for CUDA tensors).
    CHECK(!sdpa_applies(torch::randn({1, 8, 8}), torch::randn({1, 8, 8}), torch::randn({1, 8, 8}),
                        [] {
                            AttentionOptions o;
                            o.kernel = AttentionKernel::Fused;
                            return o;
                        }()));
}

TEST_CASE("attention on a GPU runs scaled_dot_product_attention within rounding of the CPU reference",
          "[kernels][cuda]") {
    if (!torch::cuda::is_available() || !sdpa_available()) {
        WARN("skipped: CUDA device " << (torch::cuda::is_available() ? "present" : "absent")
                                     << ", scaled_dot_product_attention "
                                     << (sdpa_available() ? "compiled" : "not in LibTorch " TORCH_VERSION));
        return;
    }
    const torch::Device dev(torch::kCUDA, 0);
    int64_t seed = 100;
    for (const auto& c : sdpa_random_cases(18, 59)) {
        for (const auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16}) {
            INFO(sdpa_describe(c) << " " << c10::toString(dtype));
            auto in = sdpa_make_inputs(c, dev, dtype, ++seed);
            REQUIRE(sdpa_applies(in.q, in.k, in.v, in.o));
            const auto out = attention(in.q, in.k, in.v, in.o);
            REQUIRE(out.is_cuda());
            REQUIRE(out.scalar_type() == dtype);
            // float32 may run on TF32 tensor cores (10-bit mantissa inputs); f16 has 11 bits, bf16 8.
            const double bound = dtype == torch::kFloat ? 2e-3 : dtype == torch::kHalf ? 4e-3 : 3e-2;
            CHECK(rel_err(out, sdpa_truth(in.q, in.k, in.v, in.o)) < bound);
        }
    }
}

// Timing (hidden; run by hand): LibTorch's operator against the project's CPU kernels on the attention shapes of the
// models here, the measurement behind sdpa_applies() keeping the CPU on the project's kernels.
TEST_CASE("scaled_dot_product_attention vs the CPU kernels (timing)", "[.sdpa-perf]") {
    if (!sdpa_available()) {
        WARN("LibTorch " TORCH_VERSION " has no scaled_dot_product_attention");
        return;
    }
    auto time_ms = [](const std::function<void()>& f, int reps) {
        f();
        std::vector<double> t;
        for (int r = 0; r < reps; ++r) {
            const auto t0 = std::chrono::steady_clock::now();
            f();
            t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
        }
        std::sort(t.begin(), t.end());
        return t[t.size() / 2];
    };
    std::cout << "sdpa-perf | shape [B, N, M, heads x D] | ours (Fused) ms | sdpa ms | ours/sdpa\n";
    // Fashion UNet 8x8 self/cross (batch 20), SD 1.5 16x16 at 128x128, SD 1.5 512x512 level 0 self/cross and
    // level 1, the VAE mid-block, GPT-2-small prefill of 256 tokens (heads layout, causal).
    const std::vector<std::vector<int64_t>> shapes = {{20, 64, 64, 4, 8},    {20, 64, 77, 4, 8},
                                                      {2, 256, 77, 8, 40},   {2, 4096, 4096, 8, 40},
                                                      {2, 4096, 77, 8, 40},  {2, 1024, 1024, 8, 80},
                                                      {1, 4096, 4096, 1, 512}};
    for (const auto& s : shapes) {
        const int64_t C = s[3] * s[4];
        auto q = torch::randn({s[0], s[1], C}), k = torch::randn({s[0], s[2], C}), v = torch::randn({s[0], s[2], C});
        AttentionOptions o;
        o.heads = s[3];
        o.kernel = AttentionKernel::Fused;
        const int reps = s[1] * s[2] > 1000000 ? 3 : 20;
        const double ours = time_ms([&] { (void)attention(q, k, v, o); }, reps);
        const double sdpa = time_ms([&] { (void)sdpa_attention(q, k, v, o); }, reps);
        std::cout << "sdpa-perf | " << s[0] << "x" << s[1] << "x" << s[2] << " " << s[3] << "x" << s[4] << " | "
                  << std::fixed << std::setprecision(3) << ours << " | " << sdpa << " | " << std::setprecision(2)
                  << ours / sdpa << std::defaultfloat << "\n";
    }
    {
        AttentionOptions o;
        o.layout = AttentionLayout::Heads;
        o.formula = ScoreFormula::ScaleAfter;
        o.causal = true;
        o.kernel = AttentionKernel::Fused;
        for (const int64_t n : {16, 256}) {
            auto q = torch::randn({1, 12, n, 64}), k = torch::randn({1, 12, n, 64}), v = torch::randn({1, 12, n, 64});
            const double ours = time_ms([&] { (void)attention(q, k, v, o); }, 20);
            const double sdpa = time_ms([&] { (void)sdpa_attention(q, k, v, o); }, 20);
            std::cout << "sdpa-perf | gpt2 causal 1x12x" << n << "x" << n << "x64 | " << std::fixed
                      << std::setprecision(3) << ours << " | " << sdpa << " | " << std::setprecision(2) << ours / sdpa
                      << std::defaultfloat << "\n";
        }
    }
}
