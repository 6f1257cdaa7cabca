// Analytic UNet MAC counts (unet/model/unet_macs.h) against SD 1.5's published figure and two independent formulas.
#include "unet/model/unet_macs.h"

#include "cache/io/weight_map.h"
#include "unet/model/unet_perf.h"
#include "unet/model/vae.h"

#include "tests/test_util.h"

#include <catch2/catch.hpp>

#include <cmath>
#include <random>
#include <sstream>

using namespace anchor;
using namespace anchor::unet;

namespace {

// Independent count from the real module tree: every 4-d (conv) weight's numel times the output positions of the
// level its module runs at, every 2-d (linear) weight's numel times its token count. Levels are read from the
// diffusers names only (down_blocks.i -> level i, its downsampler -> i+1, up_blocks.i -> n-1-i, its upsampler ->
// n-2-i, mid_block -> n-1), so this shares nothing with the walker in unet_macs.cpp but the config.
int64_t macs_from_parameters(UNet2DConditionModelImpl& model, int64_t h0, int64_t w0, int64_t tokens,
                             const std::function<bool(const std::string&)>& keep = nullptr) {
    const int n = model.config().num_levels();
    std::vector<int64_t> hw{h0 * w0};
    for (int64_t h = h0, w = w0, i = 1; i < n; ++i) h = (h + 1) / 2, w = (w + 1) / 2, hw.push_back(h * w);
    auto level_index = [](const std::string& name, const std::string& prefix) {
        return std::stoi(name.substr(prefix.size(), name.find('.', prefix.size()) - prefix.size()));
    };
    int64_t total = 0;
    for (const auto& p : model.named_parameters()) {
        const std::string& name = p.key();
        if (keep && !keep(name)) continue;
        const auto& t = p.value();
        if (t.dim() != 4 && t.dim() != 2) continue; // biases and norm affine parameters are not MACs
        int level = 0;
        if (name.rfind("down_blocks.", 0) == 0) {
            level = level_index(name, "down_blocks.");
            if (name.find(".downsamplers.") != std::string::npos) ++level;
        } else if (name.rfind("up_blocks.", 0) == 0) {
            level = n - 1 - level_index(name, "up_blocks.");
            if (name.find(".upsamplers.") != std::string::npos) --level;
        } else if (name.rfind("mid_block.", 0) == 0) {
            level = n - 1;
        }
        int64_t positions = hw[size_t(level)];
        if (t.dim() == 2) {
            if (name.rfind("time_embedding.", 0) == 0 || name.find(".time_emb_proj.") != std::string::npos)
                positions = 1;
            else if (name.find(".attn2.to_k.") != std::string::npos || name.find(".attn2.to_v.") != std::string::npos)
                positions = tokens;
        }
        total += t.numel() * positions;
    }
    return total;
}

} // namespace

TEST_CASE("SD 1.5 UNet at 512x512 is 338.6 GMACs (conv + linear)", "[unet_macs]") {
    UNetConfig sd15; // the defaults are SD 1.5
    const auto b = unet_mac_breakdown(sd15, 64, 64, 77);
    const auto m = b.full();
    CHECK(std::abs(double(m.total()) / 1e9 - 338.6) <= 0.05);
    CHECK(format_gmacs(double(m.total())) == "338.6");

    // Independent closed form for SD 1.5 (per sample, n_l = positions at level l: 4096, 1024, 256, 64).
    // resnet(ci, co, n) = 9 n co (ci + co) + [ci != co] n ci co + 1280 co; transformer(c, n) = 20 c^2 n + 2*768*77 c.
    auto res = [](int64_t ci, int64_t co, int64_t n) {
        return 9 * n * co * (ci + co) + (ci != co ? n * ci * co : 0) + 1280 * co;
    };
    auto tr = [](int64_t c, int64_t n) { return 20 * c * c * n + 2 * 768 * 77 * c; };
    const int64_t n0 = 4096, n1 = 1024, n2 = 256, n3 = 64;
    int64_t ref = 4 * 320 * 9 * n0 + 320 * 1280 + 1280 * 1280;                                 // conv_in, time MLP
    ref += 2 * (res(320, 320, n0) + tr(320, n0)) + 320 * 320 * 9 * n1;                         // down 0 + downsampler
    ref += res(320, 640, n1) + res(640, 640, n1) + 2 * tr(640, n1) + 640 * 640 * 9 * n2;       // down 1
    ref += res(640, 1280, n2) + res(1280, 1280, n2) + 2 * tr(1280, n2) + 1280 * 1280 * 9 * n3; // down 2
    ref += 2 * res(1280, 1280, n3);                                                            // down 3
    ref += 2 * res(1280, 1280, n3) + tr(1280, n3);                                             // mid
    ref += 3 * res(2560, 1280, n3) + 1280 * 1280 * 9 * n2;                                     // up 0 + upsampler
    ref += 2 * res(2560, 1280, n2) + res(1920, 1280, n2) + 3 * tr(1280, n2) + 1280 * 1280 * 9 * n1;            // up 1
    ref += res(1920, 640, n1) + res(1280, 640, n1) + res(960, 640, n1) + 3 * tr(640, n1) + 640 * 640 * 9 * n0; // up 2
    ref += res(960, 320, n0) + 2 * res(640, 320, n0) + 3 * tr(320, n0);                                        // up 3
    ref += 320 * 4 * 9 * n0; // conv_out
    CHECK(m.total() == ref);
    CHECK(m.total() == int64_t(338610585600));
    CHECK(m.conv == int64_t(221973053440));
    // Attention matmuls (not part of the total): 2 c n (n + 77) summed over the 16 transformers.
    CHECK(m.attention == int64_t(63026135040));

    // DeepCache branch 0 cached step: conv_in, time MLP, up_blocks.3.resnets.2 (640 -> 320) + attentions.2, conv_out.
    const int64_t shallow =
        4 * 320 * 9 * n0 + 320 * 1280 + 1280 * 1280 + res(640, 320, n0) + tr(320, n0) + 320 * 4 * 9 * n0;
    CHECK(b.shallow(0).total() == shallow);
    CHECK(deepcache_macs_per_step(b, 5) == Approx((double(ref) + 4.0 * double(shallow)) / 5.0));
    CHECK(deepcache_macs_per_step(b, 1) == Approx(double(ref)));
    // 50 steps, interval 3: 17 full steps, 33 cached.
    CHECK(deepcache_macs_per_step(b, 3, 0, 50) == Approx((17.0 * double(ref) + 33.0 * double(shallow)) / 50.0));
    CHECK(b.shallow(b.num_skips() - 1).total() < m.total());
    CHECK_THROWS(b.shallow(b.num_skips()));

    // 256x256: every term scales with positions except the time MLP / time_emb_proj and the context k/v.
    CHECK(unet_macs(sd15, 32, 32).total() < m.total() / 3);
}

TEST_CASE("tiny golden UNet MACs equal the count from its parameters", "[unet_macs]") {
    const auto cfg = UNetConfig::from_json_file(test::golden("sd/unet_sd15_tiny/config.json"));
    UNet2DConditionModel model(cfg);
    for (int64_t s : {8, 16, 6}) {
        const auto b = unet_mac_breakdown(cfg, s, s, 77);
        CHECK(b.full().total() == macs_from_parameters(*model, s, s, 77));
    }
    const auto b = unet_mac_breakdown(cfg, 8, 8, 77);
    const auto shallow = macs_from_parameters(*model, 8, 8, 77, [](const std::string& name) {
        return name.rfind("conv_in.", 0) == 0 || name.rfind("time_embedding.", 0) == 0 ||
               name.rfind("conv_out.", 0) == 0 || name.rfind("up_blocks.3.resnets.2.", 0) == 0 ||
               name.rfind("up_blocks.3.attentions.2.", 0) == 0;
    });
    CHECK(b.shallow(0).total() == shallow);
    // Branch 1 adds down_blocks.0's first pair and up_blocks.3's second pair.
    const auto branch1 = macs_from_parameters(*model, 8, 8, 77, [](const std::string& name) {
        for (const char* p : {"conv_in.", "time_embedding.", "conv_out.", "up_blocks.3.resnets.2.",
                              "up_blocks.3.attentions.2.", "up_blocks.3.resnets.1.", "up_blocks.3.attentions.1.",
                              "down_blocks.0.resnets.0.", "down_blocks.0.attentions.0."})
            if (name.rfind(p, 0) == 0) return true;
        return false;
    });
    CHECK(b.shallow(1).total() == branch1);
}

namespace {

// The plain module forwards of `m` (a UNet or a VAE) for the scope's length: the reference path.
template <typename Model> struct FastPathsOff {
    explicit FastPathsOff(Model& m) : m_(m) { m_->set_fast_paths(false); }
    ~FastPathsOff() { m_->set_fast_paths(true); }
    Model& m_;
};
template <typename Model> FastPathsOff(Model&) -> FastPathsOff<Model>;

double max_rel_diff(const torch::Tensor& a, const torch::Tensor& b) {
    return test::max_abs_diff(a, b) / std::max(1e-30, b.abs().max().item<double>());
}

} // namespace

TEST_CASE("UNet fast paths agree with the plain forward and the golden outputs", "[unet_perf]") {
    const auto cfg = UNetConfig::from_json_file(test::golden("sd/unet_sd15_tiny/config.json"));
    const auto in = WeightMap::load(test::golden("sd/unet_sd15_tiny/golden_inputs.safetensors"));
    const auto gold = WeightMap::load(test::golden("sd/unet_sd15_tiny/golden_outputs.safetensors"));
    const auto sample = in.get("sample"), ctx = in.get("encoder_hidden_states"), t = in.get("timesteps_a");
    UNet2DConditionModel model(cfg);
    REQUIRE(model->fast);
    // A first fast forward with the random init weights packs them; loading the golden weights afterwards must
    // invalidate the packed copies (the weights are updated in place).
    auto before = model->forward(sample, t, ctx);
    model->load(WeightMap::load(test::golden("sd/unet_sd15_tiny/diffusion_pytorch_model.safetensors")));
    auto fast = model->forward(sample, t, ctx);
    torch::Tensor plain;
    {
        FastPathsOff off(model);
        plain = model->forward(sample, t, ctx);
    }
    const double rel_plain = max_rel_diff(fast, plain), rel_gold = max_rel_diff(fast, gold.get("a.out"));
    INFO("fast vs plain " << rel_plain << ", fast vs golden " << rel_gold);
    CHECK(rel_plain <= 1e-5);
    CHECK(rel_gold <= 1e-4);
    CHECK(max_rel_diff(before, plain) > 1e-3); // the random-init output really differed

    // DeepCache shallow path and larger (chunked-attention) inputs agree too.
    UNetFeatures f;
    f.cache_branch = 0;
    model->forward(sample, t, ctx, &f);
    auto big = torch::randn({2, 4, 48, 40}, torch::TensorOptions().dtype(torch::kFloat));
    auto fast_sh = model->forward_shallow(sample, t, ctx, 0, f.cache_feature);
    auto fast_big = model->forward(big, t, ctx);
    FastPathsOff off(model);
    CHECK(max_rel_diff(fast_sh, model->forward_shallow(sample, t, ctx, 0, f.cache_feature)) <= 1e-5);
    CHECK(max_rel_diff(fast_big, model->forward(big, t, ctx)) <= 1e-5);
}

namespace {

// Random weights as the golden generators draw them: N(0, 0.05), +1 on norm weights, float16-representable.
void randomise(torch::nn::Module& m, uint64_t seed) {
    torch::NoGradGuard ng;
    auto gen = at::detail::createCPUGenerator(seed);
    for (auto& p : m.named_parameters()) {
        auto v = torch::randn(p.value().sizes(), gen) * 0.05;
        const auto& n = p.key();
        if (n.find("norm") != std::string::npos && n.size() > 7 && n.compare(n.size() - 7, 7, ".weight") == 0) v += 1.0;
        p.value().copy_(v.to(torch::kHalf).to(torch::kFloat));
    }
}

// The fast paths (packed convolutions where LibTorch picks oneDNN, blas_attention, residual adds in place where the
// layout allows) must give the reference forward's bits: the tiny reference models amplify a last-bit difference
// ~1000x at their 1x1 levels, so "close" is not inside their tolerance on every input.
template <typename Model, typename F>
void check_fast_equals_reference(Model& model, const F& forward, const std::string& what) {
    const auto fast = forward();
    torch::Tensor plain;
    {
        FastPathsOff off(model);
        plain = forward();
    }
    INFO(what << ": max |fast - reference| = " << test::max_abs_diff(fast, plain));
    CHECK(torch::equal(fast, plain));
}

} // namespace

TEST_CASE("UNet, VAE fast paths give the reference forward's bits on random inputs of many sizes", "[unet_perf]") {
    // The SD 1.x golden UNet, and an SD 2.x-style one (linear projections, per-block head counts, wider context).
    const auto sd1 = UNetConfig::from_json_file(test::golden("sd/unet_sd15_tiny/config.json"));
    UNetConfig sd2 = sd1;
    sd2.use_linear_projection = true;
    sd2.heads = {2, 4, 4, 4};
    sd2.cross_attention_dim = 48;
    UNet2DConditionModel u1(sd1), u2(sd2);
    u1->load(WeightMap::load(test::golden("sd/unet_sd15_tiny/diffusion_pytorch_model.safetensors")));
    randomise(*u2, 2001);
    u1->eval();
    u2->eval();
    c10::InferenceMode guard;
    std::mt19937 rng(3);
    auto pick = [&](std::vector<int64_t> v) { return v[std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng)]; };
    for (int i = 0; i < 24; ++i) {
        auto& u = i % 2 ? u2 : u1;
        const int64_t B = pick({1, 2, 3, 4}), H = pick({8, 8, 16, 12, 24}), W = pick({8, 8, 16, 10}),
                      T = pick({77, 77, 20});
        const int64_t D = u->config().cross_attention_dim;
        auto x = torch::randn({B, 4, H, W}) * double(pick({1, 3})), ctx = torch::randn({B, T, D});
        auto t = i % 3 ? torch::tensor(double(pick({999, 500, 1, 261})), torch::kFloat).reshape({})
                       : torch::randint(0, 1000, {B}, torch::kLong);
        const int threads = int(pick({1, 1, 2}));
        torch::set_num_threads(threads);
        std::ostringstream what;
        what << (i % 2 ? "sd2-style" : "sd1") << " UNet x " << x.sizes() << " ctx " << ctx.sizes() << " threads "
             << threads;
        check_fast_equals_reference(
            u, [&] { return u->forward(x, t, ctx); }, what.str());
        if (i % 4 == 0) {
            UNetFeatures f;
            f.cache_branch = 0;
            u->forward(x, t, ctx, &f);
            check_fast_equals_reference(
                u, [&] { return u->forward_shallow(x, t, ctx, 0, f.cache_feature); }, "shallow " + what.str());
        }
    }
    const auto vcfg = VaeConfig::from_json_file(test::golden("sd/vae_tiny/config.json"));
    AutoencoderKL vae(vcfg);
    vae->load(WeightMap::load(test::golden("sd/vae_tiny/diffusion_pytorch_model.safetensors")));
    vae->eval();
    for (int i = 0; i < 20; ++i) {
        const int64_t B = pick({1, 2, 3}), H = pick({4, 8, 8, 12}), W = pick({8, 6, 16});
        torch::set_num_threads(int(pick({1, 2})));
        auto z = torch::randn({B, 4, H, W});
        std::ostringstream what;
        what << "VAE decode " << z.sizes() << " threads " << torch::get_num_threads();
        check_fast_equals_reference(
            vae, [&] { return vae->decode(z); }, what.str());
        auto img = torch::rand({B, 3, 2 * H, 2 * W}) * 2 - 1;
        check_fast_equals_reference(
            vae, [&] { return vae->encode(img).moments; }, "VAE encode " + what.str());
    }
    torch::set_num_threads(1);
}

TEST_CASE("SD 2.x-style UNet at timestep 0: 0-dim and per element agree, fast paths give the reference's bits",
          "[unet_perf]") {
    // The configuration of tests/golden/sd/anchorcache_cases/unet_sd2_t0 (linear projections, heads [2, 4, 4, 4],
    // context 48) with random weights: a 0-dim timestep 0 broadcast to the batch must give exactly the output of the
    // same timestep given per element, and the fast paths the plain forward's bits, on many random inputs (the tiny
    // model's 1x1 and 2x1 levels amplify any last-bit difference about 1000x).
    auto sd2 = UNetConfig::from_json_file(test::golden("sd/anchorcache_cases/unet_sd2_t0/config.json"));
    UNet2DConditionModel u(sd2);
    randomise(*u, 4242);
    u->eval();
    c10::InferenceMode guard;
    std::mt19937 rng(11);
    auto pick = [&](std::vector<int64_t> v) { return v[std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng)]; };
    for (int i = 0; i < 12; ++i) {
        const int64_t B = pick({1, 2, 3}), H = pick({8, 16, 24}), W = pick({8, 16}), T = pick({77, 12});
        auto x = torch::randn({B, 4, H, W}), ctx = torch::randn({B, T, 48});
        const auto t0 = i % 2 ? torch::tensor(int64_t(0)) : torch::tensor(0.0f);
        std::ostringstream what;
        what << "x " << x.sizes() << " ctx " << ctx.sizes() << " t " << t0.scalar_type();
        INFO(what.str());
        UNetFeatures fa, fb;
        const auto broadcast = u->forward(x, t0, ctx, &fa);
        const auto per_element = u->forward(x, torch::zeros({B}, t0.options()), ctx, &fb);
        CHECK(torch::equal(broadcast, per_element));
        for (const auto& [name, v] : fa.named) {
            INFO(name);
            CHECK(torch::equal(v, fb.named.at(name)));
        }
        check_fast_equals_reference(
            u, [&] { return u->forward(x, t0, ctx); }, "t = 0 " + what.str());
        auto mixed = torch::randint(0, 1000, {B}, torch::kLong);
        mixed[0] = 0;
        check_fast_equals_reference(
            u, [&] { return u->forward(x, mixed, ctx); }, "t with 0 " + what.str());
    }
}
