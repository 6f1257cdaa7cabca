// oneDNN's inference kernels (kernels/onednn.h) against float64 on random shapes, beside LibTorch's own float32
// error; the UNet and the VAE on both backends; and (hidden) their speed on SD's shapes.
#include "cache/util/heap.h"
#include "kernels/onednn.h"
#include "unet/unet_model.h"
#include "unet/vae.h"

#include <catch2/catch.hpp>

#include <chrono>
#include <functional>
#include <random>

using namespace anchor;

namespace {

double rel_err(const torch::Tensor& y, const torch::Tensor& ref64) {
    return (y.to(torch::kDouble) - ref64).abs().max().item<double>() / ref64.abs().max().item<double>();
}

// Both float32 results differ from float64 by rounding only: oneDNN's within max(2e-6, 4x LibTorch's).
void check_close(double onednn, double torch32) {
    INFO("oneDNN " << onednn << ", LibTorch " << torch32);
    CHECK(onednn <= std::max(2e-6, 4 * torch32));
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
        const auto x = torch::randn({N, C, H, W}) * double(pick({1, 10}));
        const auto w = torch::randn({K, C, kh, kh}) / std::sqrt(double(C * kh * kh));
        const auto b = i % 3 == 0 ? torch::Tensor() : torch::randn({K});
        const std::vector<int64_t> st{stride, stride}, pd{pad, pad}, dl{dil, dil};
        INFO("x " << x.sizes() << ", w " << w.sizes() << ", stride " << stride << ", padding " << pad << ", dilation "
                  << dil << (b.defined() ? ", bias" : ""));
        if (H + 2 * pad < dil * (kh - 1) + 1 || W + 2 * pad < dil * (kh - 1) + 1) continue;
        REQUIRE(kernels::onednn_conv2d_applies(x, w, 1));
        const auto y = kernels::onednn_conv2d(x, w, b, st, pd, dl);
        const auto ref =
            at::conv2d(x.to(torch::kDouble), w.to(torch::kDouble), b.defined() ? b.to(torch::kDouble) : b, st, pd, dl);
        REQUIRE(y.sizes() == ref.sizes());
        check_close(rel_err(y, ref), rel_err(at::conv2d(x, w, b, st, pd, dl), ref));
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
    unet::UNetConfig c;
    c.block_out_channels = {32, 64};
    c.down_block_types = {"CrossAttnDownBlock2D", "DownBlock2D"};
    c.up_block_types = {"UpBlock2D", "CrossAttnUpBlock2D"};
    c.layers_per_block = {1, 1};
    c.heads = {2, 2};
    c.transformer_layers_per_block = {1, 1};
    c.norm_num_groups = 4;
    c.cross_attention_dim = 32;
    torch::manual_seed(5);
    unet::UNet2DConditionModel model(c);
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

    unet::VaeConfig vc;
    vc.block_out_channels = {32, 32, 64};
    vc.norm_num_groups = 8;
    unet::AutoencoderKL vae(vc);
    vae->eval();
    const auto z = torch::randn({1, 4, 16, 16});
    unet::perf::set_gemm_backend(*vae, kernels::GemmBackend::Torch);
    const auto d_torch = vae->decode(z);
    unet::perf::set_gemm_backend(*vae, kernels::GemmBackend::OneDnn);
    const auto d_onednn = vae->decode(z);
    const double vrel = (d_onednn - d_torch).abs().max().item<double>() / d_torch.abs().max().item<double>();
    INFO("VAE relative difference " << vrel);
    CHECK(vrel > 0);
    CHECK(vrel < 1e-5);
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
    }
}
