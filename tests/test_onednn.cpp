// oneDNN's inference kernels (kernels/onednn.h) against float64 on random shapes, beside LibTorch's own float32
// error; the UNet and the VAE on both backends; and (hidden) their speed on SD's shapes.
#include "cache/util/heap.h"
#include "kernels/onednn.h"
#include "kernels/op_timing.h"
#include "kernels/winograd.h"
#include "tests/test_util.h"
#include "unet/model/checkpoint.h"
#include "unet/model/unet_model.h"
#include "unet/model/vae.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <functional>
#include <random>

using namespace anchor;
using anchor::test::rel_err;

namespace {

// Both float32 results differ from float64 by rounding only: oneDNN's within max(2e-6, 4x LibTorch's).
void check_close(double onednn, double torch32) {
    INFO("oneDNN " << onednn << ", LibTorch " << torch32);
    CHECK(onednn <= std::max(2e-6, 4 * torch32));
}

// SD's UNet layout narrowed to run in a test: two levels (cross-attention, plain), one layer each, 32-wide context.
unet::UNet2DConditionModel small_unet(std::vector<int> channels, int64_t groups, uint64_t seed) {
    unet::UNetConfig c;
    c.block_out_channels = std::move(channels);
    c.down_block_types = {"CrossAttnDownBlock2D", "DownBlock2D"};
    c.up_block_types = {"UpBlock2D", "CrossAttnUpBlock2D"};
    c.layers_per_block = {1, 1};
    c.heads = {2, 2};
    c.transformer_layers_per_block = {1, 1};
    c.norm_num_groups = groups;
    c.cross_attention_dim = 32;
    torch::manual_seed(seed);
    return unet::UNet2DConditionModel(c);
}

// SD's VAE layout narrowed to run in a test (groups of 8 channels), in eval mode.
unet::AutoencoderKL small_vae(std::vector<int> channels) {
    unet::VaeConfig vc;
    vc.block_out_channels = std::move(channels);
    vc.norm_num_groups = 8;
    unet::AutoencoderKL vae(vc);
    vae->eval();
    return vae;
}

// The decode of z with every layer of `vae` on `backend`.
torch::Tensor decode_on(unet::AutoencoderKL& vae, const torch::Tensor& z, kernels::GemmBackend backend) {
    unet::perf::set_gemm_backend(*vae, backend);
    return vae->decode(z);
}

} // namespace

TEST_CASE("onednn_linear matches float64 on random shapes", "[kernels][onednn]") {
    if (!kernels::onednn_available()) {
        WARN("built without oneDNN: only the refusal is tested");
        CHECK_FALSE(kernels::onednn_linear_applies(torch::zeros({2, 3}), torch::zeros({4, 3})));
        return;
    }
    std::mt19937 rng(7);
    auto pick = [&](std::initializer_list<int64_t> v) { return *(v.begin() + rng() % v.size()); };
    for (int i = 0; i < 40; ++i) {
        const int64_t M = pick({1, 2, 7, 77, 154, 300}), K = pick({1, 3, 40, 320, 768, 1280}),
                      N = pick({1, 5, 64, 320, 1000});
        torch::manual_seed(uint64_t(i));
        auto x = torch::randn({M, K}) * double(pick({1, 20}));
        if (i % 4 == 1) x = x.view({1, M, K});                            // batch dims
        if (i % 4 == 2) x = torch::randn({K + 3, M}).narrow(0, 1, K).t(); // a transposed view
        if (i % 4 == 3) x = torch::randn({M, K + 5}).narrow(1, 2, K);     // rows with a gap
        const auto w = torch::randn({N, K}) / std::sqrt(double(K));
        const auto b = i % 3 == 0 ? torch::Tensor() : torch::randn({N});
        INFO("x " << x.sizes() << " strides " << x.strides() << ", w " << w.sizes() << (b.defined() ? ", bias" : ""));
        REQUIRE(kernels::onednn_linear_applies(x, w));
        const auto y = kernels::onednn_linear(x, w, b);
        const auto ref = at::linear(x.to(torch::kDouble), w.to(torch::kDouble), b.defined() ? b.to(torch::kDouble) : b);
        REQUIRE(y.sizes() == ref.sizes());
        check_close(rel_err(y, ref), rel_err(at::linear(x, w, b), ref));
    }
}

TEST_CASE("onednn_conv2d matches float64 on random shapes", "[kernels][onednn]") {
    if (!kernels::onednn_available()) {
        CHECK_FALSE(kernels::onednn_conv2d_applies(torch::zeros({1, 3, 8, 8}), torch::zeros({4, 3, 3, 3}), 1));
        return;
    }
    std::mt19937 rng(11);
    auto pick = [&](std::initializer_list<int64_t> v) { return *(v.begin() + rng() % v.size()); };
    for (int i = 0; i < 40; ++i) {
        const int64_t N = pick({1, 2, 3}), C = pick({3, 4, 16, 32, 40, 96}), K = pick({3, 8, 16, 48, 64});
        const int64_t kh = pick({1, 3}), stride = pick({1, 1, 2}), pad = kh == 3 ? pick({0, 1, 1}) : 0,
                      dil = kh == 3 ? pick({1, 1, 2}) : 1;
        // From a few positions (the plain-weight path, N * H * W <= kPlainWeightMaxPositions) to many.
        const int64_t H = pick({5, 8, 9, 16, 33}), W = pick({5, 7, 16, 24});
        torch::manual_seed(uint64_t(100 + i));
        auto x = torch::randn({N, C, H, W}) * double(pick({1, 10}));
        const bool channels_last = i % 2 == 1;
        if (channels_last) x = x.contiguous(torch::MemoryFormat::ChannelsLast);
        const auto w = torch::randn({K, C, kh, kh}) / std::sqrt(double(C * kh * kh));
        const auto b = i % 3 == 0 ? torch::Tensor() : torch::randn({K});
        const std::vector<int64_t> st{stride, stride}, pd{pad, pad}, dl{dil, dil};
        INFO("x " << x.sizes() << (channels_last ? " channels-last" : "") << ", w " << w.sizes() << ", stride "
                  << stride << ", padding " << pad << ", dilation " << dil << (b.defined() ? ", bias" : ""));
        if (H + 2 * pad < dil * (kh - 1) + 1 || W + 2 * pad < dil * (kh - 1) + 1) continue;
        REQUIRE(kernels::onednn_conv2d_applies(x, w, 1));
        const auto y = kernels::onednn_conv2d(x, w, b, st, pd, dl);
        const auto ref =
            at::conv2d(x.to(torch::kDouble), w.to(torch::kDouble), b.defined() ? b.to(torch::kDouble) : b, st, pd, dl);
        REQUIRE(y.sizes() == ref.sizes());
        // The input's layout is kept (a tensor with one channel or one position is both).
        CHECK(y.is_contiguous(channels_last ? torch::MemoryFormat::ChannelsLast : torch::MemoryFormat::Contiguous));
        check_close(rel_err(y, ref), rel_err(at::conv2d(x, w, b, st, pd, dl), ref));
    }
}

TEST_CASE("onednn_conv2d runs an optimised oneDNN kernel on the UNet's and VAE's shapes", "[kernels][onednn]") {
    if (!kernels::onednn_available()) {
        CHECK(kernels::onednn_conv2d_kernel(torch::zeros({1, 4, 8, 8}), torch::zeros({4, 4, 3, 3}), true, {1, 1},
                                            {1, 1}, {1, 1})
                  .rfind("none", 0) == 0);
        return;
    }
    // oneDNN falls back to its scalar reference kernel ("ref:any", ~100x slower) for operand layouts it has no
    // optimised kernel for: e.g. channels-last activations with a plain weight, which a tiny model's VAE (fashion-sd:
    // 8x8 to 32x32) once ran into at every decode.
    const std::vector<bool> arithmetics = kernels::onednn_bf16_native() ? std::vector<bool>{false, true}
                                                                        : std::vector<bool>{false};
    for (bool bf16 : arithmetics)
        for (bool channels_last : {false, true})
            for (int64_t n : {1, 2})
                for (int64_t hw : {4, 8, 16, 32})
                    for (auto ck : std::vector<std::pair<int64_t, int64_t>>{{4, 32}, {32, 32}, {64, 32}, {64, 64},
                                                                             {64, 256}, {128, 128}, {320, 320}})
                        for (auto kpad : std::vector<std::pair<int64_t, int64_t>>{{3, 1}, {1, 0}, {2, 1}}) {
                            auto x = torch::zeros({n, ck.first, hw, hw});
                            if (channels_last) x = x.contiguous(torch::MemoryFormat::ChannelsLast);
                            const auto w = torch::zeros({ck.second, ck.first, kpad.first, kpad.first});
                            const int64_t p = kpad.second;
                            const auto kernel = kernels::onednn_conv2d_kernel(x, w, true, {1, 1}, {p, p}, {1, 1}, bf16);
                            INFO("x " << x.sizes() << (channels_last ? " channels-last" : "") << ", w " << w.sizes()
                                      << (bf16 ? ", bf16" : "") << ": " << kernel);
                            CHECK(kernel.rfind("ref", 0) != 0);
                        }
}

TEST_CASE("onednn kernels: strided inputs, NaN, refusals", "[kernels][onednn]") {
    if (!kernels::onednn_available()) return;
    torch::manual_seed(3);
    // A channel slice (not contiguous) gives what its contiguous copy gives.
    const auto big = torch::randn({2, 64, 12, 12});
    const auto x = big.slice(1, 16, 48), w = torch::randn({32, 32, 3, 3}) * 0.1, b = torch::randn({32});
    const std::vector<int64_t> one{1, 1};
    CHECK(torch::equal(kernels::onednn_conv2d(x, w, b, one, one, one),
                       kernels::onednn_conv2d(x.contiguous(), w, b, one, one, one)));
    // NaN in, NaN out.
    auto xn = torch::randn({1, 16, 8, 8});
    xn.index_put_({0, 3, 4, 4}, std::numeric_limits<float>::quiet_NaN());
    CHECK(torch::isnan(kernels::onednn_conv2d(xn, torch::randn({16, 16, 3, 3}), {}, one, one, one)).any().item<bool>());
    auto ln = torch::randn({4, 8});
    ln.index_put_({2, 1}, std::numeric_limits<float>::infinity());
    CHECK_FALSE(torch::isfinite(kernels::onednn_linear(ln, torch::randn({3, 8}), {})).all().item<bool>());
    // Where they do not apply: other dtypes, groups, autograd, mismatched widths.
    CHECK_FALSE(
        kernels::onednn_linear_applies(torch::zeros({2, 3}, torch::kDouble), torch::zeros({4, 3}, torch::kDouble)));
    CHECK_FALSE(kernels::onednn_linear_applies(torch::zeros({2, 3}), torch::zeros({4, 5})));
    CHECK_FALSE(kernels::onednn_conv2d_applies(torch::zeros({1, 32, 8, 8}), torch::zeros({32, 16, 3, 3}), 2));
    CHECK_FALSE(
        kernels::onednn_conv2d_applies(torch::zeros({1, 16, 8, 8}).requires_grad_(), torch::zeros({16, 16, 3, 3}), 1));
    CHECK_THROWS_WITH(kernels::onednn_linear(torch::zeros({2, 3}), torch::zeros({4, 5}), {}),
                      Catch::Contains("matching width"));
    CHECK_THROWS_WITH(kernels::onednn_linear(torch::zeros({2, 3}), torch::zeros({4, 3}), torch::zeros({5})),
                      Catch::Contains("bias"));
    CHECK_THROWS_WITH(kernels::onednn_conv2d(torch::zeros({1, 16, 2, 2}), torch::zeros({16, 16, 5, 5}), {}, one,
                                             std::vector<int64_t>{0, 0}, one),
                      Catch::Contains("smaller than the kernel"));
}

TEST_CASE("UNet and VAE forwards on oneDNN stay within 1e-5 of LibTorch's", "[kernels][onednn]") {
    if (!kernels::onednn_available()) return;
    c10::InferenceMode guard;
    // SD's layout narrowed to run in a test: groups of >= 8 channels (what default_gemm_backend gives oneDNN).
    unet::UNet2DConditionModel model = small_unet({32, 64}, 4, 5);
    model->eval();
    const auto x = torch::randn({2, 4, 16, 16}), t = torch::tensor(int64_t(500));
    const unet::UNetCond ctx{torch::randn({2, 7, 32})};
    unet::perf::set_gemm_backend(*model, kernels::GemmBackend::Torch);
    const auto y_torch = model->forward(x, t, ctx);
    unet::perf::set_gemm_backend(*model, kernels::GemmBackend::OneDnn);
    const auto y_onednn = model->forward(x, t, ctx);
    const double rel = (y_onednn - y_torch).abs().max().item<double>() / y_torch.abs().max().item<double>();
    INFO("UNet relative difference " << rel);
    CHECK(rel > 0); // it ran
    CHECK(rel < 1e-5);
    // The plain module forwards (the reference) ignore the backend.
    model->set_fast_paths(false);
    const auto plain_onednn = model->forward(x, t, ctx);
    unet::perf::set_gemm_backend(*model, kernels::GemmBackend::Torch);
    CHECK(torch::equal(model->forward(x, t, ctx), plain_onednn));

    auto vae = small_vae({32, 32, 64});
    const auto z = torch::randn({1, 4, 16, 16});
    const auto d_torch = decode_on(vae, z, kernels::GemmBackend::Torch);
    const auto d_onednn = decode_on(vae, z, kernels::GemmBackend::OneDnn);
    const double vrel = (d_onednn - d_torch).abs().max().item<double>() / d_torch.abs().max().item<double>();
    INFO("VAE relative difference " << vrel);
    CHECK(vrel > 0);
    CHECK(vrel < 1e-5);
}

TEST_CASE("UNet and VAE forwards with Winograd convolutions stay within 1e-5 of LibTorch's", "[kernels][winograd]") {
    if (!kernels::onednn_available()) return;
    c10::InferenceMode guard;
    // Wide enough and large enough that the outer levels' 3x3 convolutions take the Winograd kernel.
    unet::UNet2DConditionModel model = small_unet({64, 64}, 8, 6);
    model->eval();
    const auto x = torch::randn({2, 4, 32, 32}), t = torch::tensor(int64_t(500));
    const std::vector<int64_t> one{1, 1};
    REQUIRE(kernels::winograd_applies(torch::zeros({2, 64, 32, 32}), torch::zeros({64, 64, 3, 3}), one, one, one));
    const unet::UNetCond ctx{torch::randn({2, 7, 32})};
    unet::perf::set_gemm_backend(*model, kernels::GemmBackend::Torch);
    const auto y_torch = model->forward(x, t, ctx);
    unet::perf::set_gemm_backend(*model, kernels::GemmBackend::OneDnn);
    const auto y_direct = model->forward(x, t, ctx);
    unet::perf::set_gemm_backend(*model, kernels::GemmBackend::Winograd);
    const auto y_wino = model->forward(x, t, ctx);
    auto rel = [](const torch::Tensor& a, const torch::Tensor& b) {
        return (a - b).abs().max().item<double>() / b.abs().max().item<double>();
    };
    INFO("UNet: Winograd " << rel(y_wino, y_torch) << ", direct " << rel(y_direct, y_torch));
    CHECK(!torch::equal(y_wino, y_direct)); // it ran
    CHECK(rel(y_wino, y_torch) < 1e-5);

    auto vae = small_vae({64, 64});
    const auto z = torch::randn({1, 4, 32, 32});
    const auto d_torch = decode_on(vae, z, kernels::GemmBackend::Torch);
    const auto d_direct = decode_on(vae, z, kernels::GemmBackend::OneDnn);
    const auto d_wino = decode_on(vae, z, kernels::GemmBackend::Winograd);
    INFO("VAE: Winograd " << rel(d_wino, d_torch) << ", direct " << rel(d_direct, d_torch));
    CHECK(!torch::equal(d_wino, d_direct));
    CHECK(rel(d_wino, d_torch) < 1e-5);
}

// The bf16 backend rounds both operands to bfloat16 and sums their products in float32: a product of two bfloat16
// numbers is exact in float32, so against float64 products of the ROUNDED operands only the float32 summation
// differs, within the float32 kernels' own bound. Random shapes, float32 and bfloat16-stored weights, and the packed
// weight kept per weight (a repeated call gives the same bits; a weight changed in place is packed again).
TEST_CASE("bf16 linear and convolution equal float64 products of the bf16-rounded operands", "[kernels][onednn]") {
    if (!kernels::onednn_bf16_native()) {
        WARN("no native bfloat16 on this CPU (or no oneDNN): only the refusal is tested");
        CHECK_THAT(kernels::gemm_backend_unavailable(kernels::GemmBackend::Bf16), Catch::Contains("bf16"));
        return;
    }
    CHECK(kernels::gemm_backend_unavailable(kernels::GemmBackend::Bf16).empty());
    CHECK(kernels::gemm_backend_unavailable(kernels::GemmBackend::OneDnn).empty());
    const auto rounded = [](const torch::Tensor& t) { return t.to(torch::kBFloat16).to(torch::kDouble); };
    std::mt19937 rng(17);
    auto pick = [&](std::initializer_list<int64_t> v) { return *(v.begin() + rng() % v.size()); };
    for (int i = 0; i < 24; ++i) {
        const int64_t M = pick({1, 7, 77, 300}), K = pick({3, 40, 320, 768}), N = pick({1, 5, 64, 320});
        torch::manual_seed(uint64_t(300 + i));
        auto x = torch::randn({M, K}) * double(pick({1, 20}));
        if (i % 3 == 1) x = x.view({1, M, K});
        if (i % 3 == 2) x = torch::randn({M, K + 5}).narrow(1, 2, K);
        auto w = torch::randn({N, K}) / std::sqrt(double(K));
        if (i % 2) w = w.to(torch::kBFloat16); // as --weights-dtype bf16 stores it
        const auto b = i % 4 == 0 ? torch::Tensor() : torch::randn({N});
        INFO("linear x " << x.sizes() << " strides " << x.strides() << ", w " << w.sizes() << " " << w.scalar_type());
        REQUIRE(kernels::onednn_linear_applies(x, w, true));
        CHECK_FALSE(kernels::onednn_linear_applies(x, torch::zeros({N, K}, torch::kBFloat16), false));
        const auto y = kernels::onednn_linear(x, w, b, true);
        const auto ref = at::linear(rounded(x), rounded(w), b.defined() ? b.to(torch::kDouble) : b);
        REQUIRE(y.scalar_type() == torch::kFloat);
        CHECK(rel_err(y, ref) <= std::max(2e-6, 4 * rel_err(at::linear(x, w.to(torch::kFloat), b), at::linear(
                                                                x.to(torch::kDouble), w.to(torch::kDouble),
                                                                b.defined() ? b.to(torch::kDouble) : b))));
        CHECK(torch::equal(kernels::onednn_linear(x, w, b, true), y)); // the packed weight, again
    }
    for (int i = 0; i < 24; ++i) {
        const int64_t N = pick({1, 2}), C = pick({16, 32, 96}), K = pick({16, 48, 64});
        const int64_t kh = pick({1, 3}), stride = pick({1, 2}), pad = kh == 3 ? 1 : 0;
        const int64_t H = pick({5, 8, 16, 33}), W = pick({7, 16, 24});
        torch::manual_seed(uint64_t(400 + i));
        auto x = torch::randn({N, C, H, W}) * double(pick({1, 10}));
        if (i % 3 == 2) x = x.contiguous(torch::MemoryFormat::ChannelsLast);
        auto w = torch::randn({K, C, kh, kh}) / std::sqrt(double(C * kh * kh));
        if (i % 2) w = w.to(torch::kBFloat16);
        const auto b = i % 4 == 0 ? torch::Tensor() : torch::randn({K});
        const std::vector<int64_t> st{stride, stride}, pd{pad, pad}, dl{1, 1};
        INFO("conv x " << x.sizes() << ", w " << w.sizes() << " " << w.scalar_type() << ", stride " << stride);
        REQUIRE(kernels::onednn_conv2d_applies(x, w, 1, true));
        const auto y = kernels::onednn_conv2d(x, w, b, st, pd, dl, kernels::ConvArithmetic::Bf16);
        const auto ref = at::conv2d(rounded(x), rounded(w), b.defined() ? b.to(torch::kDouble) : b, st, pd, dl);
        REQUIRE(y.sizes() == ref.sizes());
        const auto wf = w.to(torch::kFloat);
        CHECK(rel_err(y, ref) <=
              std::max(2e-6, 4 * rel_err(at::conv2d(x, wf, b, st, pd, dl),
                                         at::conv2d(x.to(torch::kDouble), wf.to(torch::kDouble),
                                                    b.defined() ? b.to(torch::kDouble) : b, st, pd, dl))));
        CHECK(torch::equal(kernels::onednn_conv2d(x, w, b, st, pd, dl, kernels::ConvArithmetic::Bf16), y));
    }
    // A weight changed in place (its version moves) is packed again, not read from the stale copy.
    const std::vector<int64_t> one{1, 1};
    auto x = torch::randn({1, 32, 16, 16}), w = torch::randn({32, 32, 3, 3});
    const auto y1 = kernels::onednn_conv2d(x, w, {}, one, one, one, kernels::ConvArithmetic::Bf16);
    w.mul_(2);
    CHECK(torch::allclose(kernels::onednn_conv2d(x, w, {}, one, one, one, kernels::ConvArithmetic::Bf16), 2 * y1));
    auto xl = torch::randn({9, 40}), wl = torch::randn({24, 40});
    const auto l1 = kernels::onednn_linear(xl, wl, {}, true);
    wl.mul_(2);
    CHECK(torch::allclose(kernels::onednn_linear(xl, wl, {}, true), 2 * l1));
    kernels::onednn_drop_packed_weights();
    CHECK(torch::allclose(kernels::onednn_linear(xl, wl, {}, true), 2 * l1));
}

// The whole UNet and VAE on the bf16 backend: within bfloat16's rounding of the float32 reference (each operand
// rounded by at most 2^-9 relative; a few layers deep that is ~1e-2 of the output's range), and not the same bits.
TEST_CASE("UNet and VAE forwards on the bf16 backend stay within bfloat16's rounding of LibTorch's",
          "[kernels][onednn]") {
    if (!kernels::onednn_bf16_native()) return;
    c10::InferenceMode guard;
    unet::UNet2DConditionModel model = small_unet({32, 64}, 4, 7);
    model->eval();
    const auto x = torch::randn({2, 4, 16, 16}), t = torch::tensor(int64_t(500));
    const unet::UNetCond ctx{torch::randn({2, 7, 32})};
    auto rel = [](const torch::Tensor& a, const torch::Tensor& b) {
        return (a - b).norm().item<double>() / b.norm().item<double>();
    };
    unet::perf::set_gemm_backend(*model, kernels::GemmBackend::Torch);
    const auto y_torch = model->forward(x, t, ctx);
    unet::perf::set_gemm_backend(*model, kernels::GemmBackend::Bf16);
    const auto y_bf16 = model->forward(x, t, ctx);
    unet::store_weights_as(*model, torch::kBFloat16); // the weights as --weights-dtype bf16 keeps them
    const auto y_bf16w = model->forward(x, t, ctx);
    INFO("UNet relative L2 difference " << rel(y_bf16, y_torch) << ", bf16-stored weights " << rel(y_bf16w, y_torch));
    CHECK(rel(y_bf16, y_torch) > 1e-5); // it ran, in bfloat16
    CHECK(rel(y_bf16, y_torch) < 2e-2);
    CHECK(rel(y_bf16w, y_torch) < 2e-2); // the resize-convolution's summed taps round differently; the rest alike

    auto vae = small_vae({32, 32, 64});
    const auto z = torch::randn({1, 4, 16, 16});
    const auto d_torch = decode_on(vae, z, kernels::GemmBackend::Torch);
    const auto d_bf16 = decode_on(vae, z, kernels::GemmBackend::Bf16);
    INFO("VAE relative L2 difference " << rel(d_bf16, d_torch));
    CHECK(rel(d_bf16, d_torch) > 1e-5);
    CHECK(rel(d_bf16, d_torch) < 2e-2);
}

// Performance mode (hidden: `anchor_tests "[.onednn-perf]"`): LibTorch and oneDNN interleaved on SD 1.5's shapes,
// UNet layers at batch 2 (one CFG step) and the VAE decoder's 3x3 convolutions at batch 1; min of 3 each.
TEST_CASE("oneDNN kernel performance on SD shapes", "[.onednn-perf]") {
    if (!kernels::onednn_available()) return;
    util::configure_heap(); // as the programs run (cache/util/heap.h): fresh pages would dominate the large outputs
    c10::InferenceMode guard;
    auto time_of = [](const std::function<torch::Tensor()>& f) {
        double best = 1e30;
        for (int r = 0; r < 4; ++r) {
            const auto t0 = std::chrono::steady_clock::now();
            f();
            const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            if (r > 0) best = std::min(best, t);
        }
        return best;
    };
    auto report = [](const std::string& what, double gflop, double torch_s, double onednn_s) {
        WARN(what << ": LibTorch " << torch_s * 1e3 << " ms (" << gflop / torch_s << " GFLOP/s), oneDNN "
                  << onednn_s * 1e3 << " ms (" << gflop / onednn_s << " GFLOP/s), " << torch_s / onednn_s << "x");
    };
    struct Lin {
        const char* what;
        int64_t m, k, n;
    };
    for (const Lin& s :
         {Lin{"unet 512 level 0 attention projection", 8192, 320, 320}, Lin{"unet 512 level 0 GEGLU", 8192, 320, 2560},
          Lin{"unet 512 level 0 FF out", 8192, 1280, 320}, Lin{"unet 256 level 0 GEGLU", 2048, 320, 2560},
          Lin{"unet 256 level 2 GEGLU", 128, 1280, 10240}, Lin{"unet context K/V", 154, 768, 1280}}) {
        torch::manual_seed(1);
        const auto x = torch::randn({s.m, s.k}), w = torch::randn({s.n, s.k}) * 0.02, b = torch::randn({s.n});
        report(std::string("linear ") + s.what + " [" + std::to_string(s.m) + "x" + std::to_string(s.k) + "] x [" +
                   std::to_string(s.k) + "x" + std::to_string(s.n) + "]",
               2e-9 * double(s.m * s.k * s.n), time_of([&] { return at::linear(x, w, b); }),
               time_of([&] { return kernels::onednn_linear(x, w, b); }));
    }
    struct Conv {
        const char* what;
        int64_t n, c, k, h;
    };
    for (const Conv& s : {Conv{"unet 512 level 0", 2, 320, 320, 64}, Conv{"unet 512 level 1", 2, 640, 640, 32},
                          Conv{"unet 512 level 2", 2, 1280, 1280, 16}, Conv{"unet 256 level 0", 2, 320, 320, 32},
                          Conv{"unet 256 level 2", 2, 1280, 1280, 8}, Conv{"unet 256 level 3", 2, 1280, 1280, 4},
                          Conv{"vae 512 mid", 1, 512, 512, 64}, Conv{"vae 512 up1", 1, 512, 512, 128},
                          Conv{"vae 512 up2", 1, 256, 256, 256}, Conv{"vae 512 up3", 1, 128, 128, 512}}) {
        torch::manual_seed(1);
        const auto x = torch::randn({s.n, s.c, s.h, s.h}), w = torch::randn({s.k, s.c, 3, 3}) * 0.02,
                   b = torch::randn({s.k});
        const std::vector<int64_t> one{1, 1};
        report(std::string("conv3x3 ") + s.what + " [" + std::to_string(s.n) + "," + std::to_string(s.c) + "," +
                   std::to_string(s.h) + "," + std::to_string(s.h) + "] -> " + std::to_string(s.k),
               2e-9 * double(s.n * s.c * s.k * 9 * s.h * s.h), time_of([&] { return at::conv2d(x, w, b, 1, 1); }),
               time_of([&] { return kernels::onednn_conv2d(x, w, b, one, one, one); }));
    }
}

TEST_CASE("Winograd against oneDNN's direct convolution on SD shapes", "[.winograd-perf]") {
    if (!kernels::onednn_available()) return;
    util::configure_heap();
    c10::InferenceMode guard;
    util::HeapScope heap;
    auto time_of = [](const std::function<torch::Tensor()>& f) {
        std::vector<double> t;
        for (int r = 0; r < 5; ++r) {
            const auto t0 = std::chrono::steady_clock::now();
            f();
            if (r > 0) t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
        std::sort(t.begin(), t.end());
        return t[t.size() / 2];
    };
    struct Conv {
        const char* what;
        int64_t n, c, k, h;
        bool channels_last;
    };
    for (const Conv& s :
         {Conv{"unet 512 level 0", 2, 320, 320, 64, false}, Conv{"unet 512 level 0 up", 2, 640, 320, 64, false},
          Conv{"unet 512 level 1", 2, 640, 640, 32, false}, Conv{"unet 512 level 2", 2, 1280, 1280, 16, false},
          Conv{"unet 256 level 0", 2, 320, 320, 32, false}, Conv{"unet 256 level 1", 2, 640, 640, 16, false},
          Conv{"unet 256 level 2", 2, 1280, 1280, 8, false}, Conv{"vae 512 mid", 1, 512, 512, 64, true},
          Conv{"vae 512 up1", 1, 512, 512, 128, true}, Conv{"vae 512 up2 in", 1, 512, 256, 256, true},
          Conv{"vae 512 up2", 1, 256, 256, 256, true}, Conv{"vae 512 up3 in", 1, 256, 128, 512, true},
          Conv{"vae 512 up3", 1, 128, 128, 512, true}}) {
        torch::manual_seed(1);
        auto x = torch::randn({s.n, s.c, s.h, s.h});
        if (s.channels_last) x = x.contiguous(torch::MemoryFormat::ChannelsLast);
        const auto w = torch::randn({s.k, s.c, 3, 3}) * 0.02, b = torch::randn({s.k});
        const std::vector<int64_t> one{1, 1};
        const double direct = time_of([&] { return kernels::onednn_conv2d(x, w, b, one, one, one); }),
                     wino = time_of([&] { return kernels::winograd_conv3x3(x, w, b); }),
                     gflop = 2e-9 * double(s.n * s.c * s.k * 9 * s.h * s.h);
        WARN("conv3x3 " << s.what << " [" << s.n << "," << s.c << "," << s.h << "," << s.h << "]"
                        << (s.channels_last ? " NHWC" : " NCHW") << " -> " << s.k << ": direct " << direct * 1e3
                        << " ms (" << gflop / direct << " GFLOP/s), Winograd " << wino * 1e3 << " ms ("
                        << gflop / wino << " GFLOP/s equivalent), " << direct / wino << "x");
    }
}

TEST_CASE("onednn_upsample2x_conv3x3 equals the convolution of the upsampled input", "[kernels][onednn]") {
    if (!kernels::onednn_available()) return;
    std::mt19937 rng(23);
    auto pick = [&](std::initializer_list<int64_t> v) { return *(v.begin() + rng() % v.size()); };
    const std::vector<int64_t> one{1, 1};
    for (int i = 0; i < 24; ++i) {
        const int64_t N = pick({1, 2}), C = pick({4, 16, 32, 64}), K = pick({3, 16, 48}), H = pick({1, 2, 5, 8, 13}),
                      W = pick({1, 3, 8, 11});
        torch::manual_seed(uint64_t(200 + i));
        auto x = torch::randn({N, C, H, W});
        if (i % 2) x = x.contiguous(torch::MemoryFormat::ChannelsLast);
        const auto w = torch::randn({K, C, 3, 3}) / std::sqrt(double(9 * C));
        const auto b = i % 3 == 0 ? torch::Tensor() : torch::randn({K});
        INFO("x " << x.sizes() << (i % 2 ? " channels-last" : "") << ", w " << w.sizes());
        const auto y = kernels::onednn_upsample2x_conv3x3(x, w, b);
        const auto up = torch::upsample_nearest2d(x.to(torch::kDouble), {2 * H, 2 * W});
        const auto ref = at::conv2d(up, w.to(torch::kDouble), b.defined() ? b.to(torch::kDouble) : b, one, one);
        REQUIRE(y.sizes() == ref.sizes());
        CHECK(y.is_contiguous(i % 2 && C > 1 && H * W > 1 ? torch::MemoryFormat::ChannelsLast
                                                          : torch::MemoryFormat::Contiguous));
        check_close(rel_err(y, ref),
                    rel_err(at::conv2d(torch::upsample_nearest2d(x, {2 * H, 2 * W}), w, b, one, one), ref));
        // The phase weights are kept for the weight: a second call gives the same bits; made for this call alone
        // (keep = false) they are the same.
        CHECK(torch::equal(kernels::onednn_upsample2x_conv3x3(x, w, b), y));
        CHECK(torch::equal(kernels::onednn_upsample2x_conv3x3(x, w, b, false, false), y));
    }
    // A weight changed in place (LoRA merged into it, a training step) is seen: its kept phase weights are made again.
    auto x = torch::randn({1, 8, 5, 6});
    auto w = torch::randn({4, 8, 3, 3});
    const auto before = kernels::onednn_upsample2x_conv3x3(x, w, {});
    w.mul_(-2.0);
    const auto after = kernels::onednn_upsample2x_conv3x3(x, w, {});
    CHECK(torch::allclose(after, before * -2.0, 1e-5, 1e-5));
}

TEST_CASE("winograd_conv3x3 matches float64 in strips, both layouts, both GEMMs", "[kernels][onednn][winograd]") {
    const std::vector<int64_t> one{1, 1};
    std::mt19937 rng(31);
    auto pick = [&](std::initializer_list<int64_t> v) { return *(v.begin() + rng() % v.size()); };
    for (int i = 0; i < 40; ++i) {
        const int64_t N = pick({1, 2}), C = pick({1, 3, 16, 48, 64}), K = pick({1, 5, 16, 80}),
                      H = pick({1, 3, 4, 5, 9, 17}), W = pick({1, 4, 7, 16, 21});
        // Strips from one tile row up to the whole map.
        const int64_t strip_bytes = pick({1, 20000, 200000, int64_t(64) << 20});
        const auto gemm = kernels::onednn_available() && i % 4 != 3 ? kernels::WinogradGemm::OneDnn
                                                                     : kernels::WinogradGemm::Torch;
        torch::manual_seed(uint64_t(300 + i));
        auto x = torch::randn({N, C, H, W}) * double(pick({1, 10}));
        if (i % 2) x = x.contiguous(torch::MemoryFormat::ChannelsLast);
        const auto w = torch::randn({K, C, 3, 3}) / std::sqrt(double(9 * C));
        const auto b = i % 3 == 0 ? torch::Tensor() : torch::randn({K});
        INFO("x " << x.sizes() << (i % 2 ? " channels-last" : "") << ", w " << w.sizes() << ", strips of "
                  << strip_bytes << " bytes, " << (gemm == kernels::WinogradGemm::OneDnn ? "oneDNN" : "LibTorch"));
        const auto y = kernels::winograd_conv3x3(x, w, b, gemm, strip_bytes);
        const auto ref = at::conv2d(x.to(torch::kDouble), w.to(torch::kDouble), b.defined() ? b.to(torch::kDouble) : b,
                                    one, one);
        REQUIRE(y.sizes() == ref.sizes());
        CHECK(y.is_contiguous(i % 2 && C > 1 && K > 1 && H * W > 1 ? torch::MemoryFormat::ChannelsLast
                                                                   : torch::MemoryFormat::Contiguous));
        // The transforms' constants (up to 8 and 1/24) cost a few bits more than a direct sum.
        const double e = rel_err(y, ref), t = rel_err(at::conv2d(x, w, b, one, one), ref);
        INFO("Winograd " << e << ", LibTorch " << t);
        CHECK(e <= std::max(1e-5, 16 * t));
    }
    // NaN in, NaN out; refusals name the operands.
    auto xn = torch::randn({1, 16, 8, 8});
    xn.index_put_({0, 3, 4, 4}, std::numeric_limits<float>::quiet_NaN());
    CHECK(torch::isnan(kernels::winograd_conv3x3(xn, torch::randn({16, 16, 3, 3}), {})).any().item<bool>());
    CHECK_THROWS_WITH(kernels::winograd_conv3x3(torch::zeros({1, 4, 8, 8}), torch::zeros({4, 4, 5, 5}), {}),
                      Catch::Contains("[K, C, 3, 3]"));
    CHECK_THROWS_WITH(kernels::winograd_conv3x3(torch::zeros({1, 4, 8, 8}), torch::zeros({4, 4, 3, 3}), torch::zeros({3})),
                      Catch::Contains("bias"));
    // Through onednn_conv2d: taken where winograd_applies, the direct kernel elsewhere (narrow, few positions, 1x1).
    if (!kernels::onednn_available()) return;
    const int64_t c = kernels::kWinogradMinChannels, side = 64;
    const auto x = torch::randn({1, c, side, side}), w = torch::randn({c, c, 3, 3}) * 0.05;
    REQUIRE(kernels::winograd_applies(x, w, one, one, one));
    CHECK(torch::equal(kernels::onednn_conv2d(x, w, {}, one, one, one, kernels::ConvArithmetic::Winograd), kernels::winograd_conv3x3(x, w, {})));
    const auto narrow = torch::randn({1, 4, side, side}), wn = torch::randn({c, 4, 3, 3});
    CHECK_FALSE(kernels::winograd_applies(narrow, wn, one, one, one));
    CHECK(torch::equal(kernels::onednn_conv2d(narrow, wn, {}, one, one, one, kernels::ConvArithmetic::Winograd),
                       kernels::onednn_conv2d(narrow, wn, {}, one, one, one)));
    const auto few = torch::randn({1, c, 4, 4});
    CHECK_FALSE(kernels::winograd_applies(few, w, one, one, one));
    CHECK(torch::equal(kernels::onednn_conv2d(few, w, {}, one, one, one, kernels::ConvArithmetic::Winograd),
                       kernels::onednn_conv2d(few, w, {}, one, one, one)));
    CHECK_FALSE(kernels::winograd_applies(x, w, {2, 2}, one, one));
}

TEST_CASE("group_norm_silu_ equals GroupNorm then SiLU, in the input's storage", "[kernels][group_norm]") {
    std::mt19937 rng(41);
    auto pick = [&](std::initializer_list<int64_t> v) { return *(v.begin() + rng() % v.size()); };
    for (int i = 0; i < 24; ++i) {
        const int64_t N = pick({1, 2, 3}), G = pick({1, 2, 32}), C = G * pick({1, 3, 8}), H = pick({1, 5, 16}),
                      W = pick({1, 7, 16});
        torch::manual_seed(uint64_t(400 + i));
        // Activations with an offset: the statistics must not lose the variance to the mean.
        auto x = torch::randn({N, C, H, W}) * double(pick({1, 30})) + double(pick({0, 5}));
        if (i % 2) x = x.contiguous(torch::MemoryFormat::ChannelsLast);
        const bool affine = i % 3 != 0;
        const auto w = affine ? torch::randn({C}) : torch::Tensor(), b = affine ? torch::randn({C}) : torch::Tensor();
        INFO("x " << x.sizes() << (i % 2 ? " channels-last" : "") << ", " << G << " groups");
        const auto ref = torch::silu(torch::group_norm(x.to(torch::kDouble), G, affine ? w.to(torch::kDouble) : w,
                                                       affine ? b.to(torch::kDouble) : b, 1e-6));
        auto y = x.clone(i % 2 ? torch::MemoryFormat::ChannelsLast : torch::MemoryFormat::Contiguous);
        const void* storage = y.data_ptr();
        y = kernels::group_norm_silu_(y, G, w, b, 1e-6);
        CHECK(y.data_ptr() == storage);
        const double e = rel_err(y, ref),
                     t = rel_err(torch::silu(torch::group_norm(x, G, w, b, 1e-6)), ref);
        INFO("in place " << e << ", LibTorch " << t);
        CHECK(e <= std::max(2e-6, 4 * t));
    }
    CHECK_THROWS_WITH(kernels::group_norm_silu_(torch::zeros({1, 6, 2, 2}), 4, {}, {}, 1e-6),
                      Catch::Contains("6, 2, 2"));
}

TEST_CASE("a resnet block normalises its input in place only when it owns it", "[kernels][group_norm]") {
    if (!kernels::onednn_available()) return;
    c10::InferenceMode guard;
    torch::manual_seed(8);
    unet::ResnetBlock2D block(64, 32, 0, 8, 1e-6); // a shortcut convolution: the input is free after it
    block->eval();
    unet::perf::set_gemm_backend(*block, kernels::GemmBackend::OneDnn);
    const auto x = torch::randn({1, 64, 16, 16}).contiguous(torch::MemoryFormat::ChannelsLast);
    const auto kept = x.clone();
    const auto shared = block->forward(x, {}); // x is still the caller's: left as it is
    CHECK(torch::equal(x, kept));
    auto owned_in = x.clone();
    const auto owned = block->forward(std::move(owned_in), {}); // moved in: normalised in its own storage
    const double rel = (owned - shared).abs().max().item<double>() / shared.abs().max().item<double>();
    INFO("owned vs shared input: " << rel);
    CHECK(rel < 1e-5);
    unet::perf::set_gemm_backend(*block, kernels::GemmBackend::Torch); // the reference path never writes its input
    const auto y = x.clone();
    block->forward(y, {});
    CHECK(torch::equal(y, kept));
}

TEST_CASE("op timing records each fast-kernel call once, with its shape and MACs", "[kernels][op_timing]") {
    if (!kernels::onednn_available()) return;
    c10::InferenceMode guard;
    torch::manual_seed(9);
    const auto x = torch::randn({5, 12}), w = torch::randn({7, 12}), b = torch::randn({7});
    const auto img = torch::randn({2, 8, 9, 11}), k3 = torch::randn({6, 8, 3, 3}), k1 = torch::randn({6, 8, 1, 1});
    kernels::onednn_linear(x, w, b); // not recorded: timing is off
    kernels::op_timing_start();
    CHECK(kernels::op_timing_on());
    kernels::onednn_linear(x, w, b);
    kernels::onednn_conv2d(img, k1, {}, {1, 1}, {0, 0}, {1, 1});
    kernels::onednn_conv2d(img, k3, {}, {2, 2}, {1, 1}, {1, 1});
    kernels::winograd_conv3x3(img, k3, {}, kernels::WinogradGemm::OneDnn); // its batched GEMM is part of it
    kernels::onednn_linear(x, w, b);
    const auto calls = kernels::op_timing_stop();
    CHECK_FALSE(kernels::op_timing_on());
    kernels::onednn_linear(x, w, b);
    REQUIRE(calls.size() == 5);
    CHECK(calls[0].kind == "linear");
    CHECK(calls[0].shape == "5x12 @ 12x7");
    CHECK(calls[0].macs == 5.0 * 12 * 7);
    CHECK(calls[1].kind == "conv");
    CHECK(calls[1].shape == "2x8x9x11 * 6x8x1x1");
    CHECK(calls[1].macs == 2.0 * 6 * 9 * 11 * 8);
    CHECK(calls[2].shape == "2x8x9x11 * 6x8x3x3 /2");
    CHECK(calls[2].macs == 2.0 * 6 * 5 * 6 * 8 * 9); // output 5x6
    CHECK(calls[3].kind == "winograd3x3");
    CHECK(calls[3].macs == 2.0 * 6 * 9 * 11 * 8 * 9);
    for (const auto& c : calls) CHECK(c.ms >= 0);
    const auto groups = kernels::group_op_times(calls);
    REQUIRE(groups.size() == 4);
    const auto lin = std::find_if(groups.begin(), groups.end(), [](const auto& g) { return g.kind == "linear"; });
    REQUIRE(lin != groups.end());
    CHECK(lin->calls == 2);
    CHECK(lin->macs == 2 * 5.0 * 12 * 7);
    for (size_t i = 1; i < groups.size(); ++i) CHECK(groups[i - 1].ms >= groups[i].ms);
    const auto kinds = kernels::group_op_times(calls, false); // by kind alone: the two convolutions together
    REQUIRE(kinds.size() == 3);
    const auto conv = std::find_if(kinds.begin(), kinds.end(), [](const auto& g) { return g.kind == "conv"; });
    REQUIRE(conv != kinds.end());
    CHECK(conv->calls == 2);
    CHECK(conv->shape.empty());
    CHECK(conv->macs == calls[1].macs + calls[2].macs);
}
