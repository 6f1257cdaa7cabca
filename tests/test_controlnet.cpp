// ControlNet beside its golden (golden_runner's check_controlnet.cpp): the UNet's residual hooks, the lazy per-call
// residuals the caches rely on (a shallow step's ControlNet part equals the leading residuals of the full one), guess
// mode's rows, the cache modes with a ControlNet on the tiny pipeline, and the bad-input errors.
#include "cache/io/error.h"
#include "cache/io/safetensors.h"
#include "tests/controlnet_test_util.h"
#include "tests/test_cli_util.h"
#include "tests/test_util.h"
#include "tests/tiny_sd_run.h"
#include "unet/cache/cache_config.h"
#include "unet/model/controlnet.h"
#include "unet/pipeline/control.h"

#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>

using namespace anchor;
using namespace anchor::unet;

namespace {

// A ControlNet shaped for `u` with LibTorch's default (random) initialisation: its zero convolutions are not zero, so
// the residuals move the image.
ControlNetModel random_controlnet(const UNetConfig& u, uint64_t seed = 7) {
    torch::manual_seed(seed);
    ControlNetConfig c;
    c.unet = u;
    c.embedding_channels = {8, 16};
    ControlNetModel m(c);
    m->eval();
    return m;
}

torch::Tensor random_pixels(int w, int h, uint64_t seed) {
    auto gen = at::detail::createCPUGenerator(seed);
    return (torch::rand({h, w, 3}, gen) * 255).round().to(torch::kUInt8);
}

double psnr(const torch::Tensor& a, const torch::Tensor& b) {
    const double mse = (a.to(torch::kDouble) - b.to(torch::kDouble)).pow(2).mean().item<double>();
    return mse == 0 ? INFINITY : 10 * std::log10(255.0 * 255.0 / mse);
}

} // namespace

TEST_CASE("ControlNet residuals enter the UNet's skips; a shallow step's part equals the full residuals' head",
          "[controlnet][sd]") {
    auto models = test::deepcache_models();
    auto& unet = *models.unet;
    auto net = random_controlnet(unet.config());
    c10::InferenceMode guard;
    torch::manual_seed(3);
    const auto x = torch::randn({2, 4, 8, 8}), ctx = torch::randn({2, 77, unet.config().cross_attention_dim});
    const auto t = torch::tensor(501.0f).reshape({});
    const auto image = torch::rand({2, 3, 16, 16});
    const auto full = net->residuals(x, t, ctx, image, 0.8, false);
    REQUIRE(int(full.down.size()) == unet.num_skips());
    REQUIRE(int(net->zero_convs.size()) == unet.num_skips());
    UNetFeatures skips;
    skips.record_inner = false;
    const auto plain = unet.forward(x, t, ctx, &skips);
    // Each residual has its skip's shape; the mid one the mid block's.
    CHECK(full.mid.sizes() == skips.named.at("mid_block").sizes());
    CHECK(full.down[0].sizes() == skips.named.at("conv_in").sizes());
    // The shallow part: the first k residuals and no mid block, bit for bit the full call's.
    for (int k : {1, 3}) {
        const auto part = net->residuals(x, t, ctx, image, 0.8, false, k, false);
        REQUIRE(int(part.down.size()) == k);
        CHECK_FALSE(part.mid.defined());
        for (int j = 0; j < k; ++j) CHECK(torch::equal(part.down[size_t(j)], full.down[size_t(j)]));
    }
    // Residuals given as tensors = the same residuals computed lazily through UNetCond::control.
    UNetCond given(ctx);
    given.residuals = full;
    const auto with = unet.forward(x, t, given);
    CHECK_FALSE(torch::allclose(with, plain));
    ControlParams cp;
    cp.net = net, cp.source = "random", cp.scale = 0.8, cp.pixels = random_pixels(16, 16, 1);
    // Zero scale (outside control_guidance_start/end) adds nothing: the plain UNet's output.
    cp.start = 0.5;
    const ControlRun off({cp}, 16, 16, 2, 1, false, 4);
    CHECK(torch::equal(unet.forward(x, t, off.at(UNetCond(ctx), 0)), plain));
    CHECK(control_keep(1, 4, 0.5, 1.0) == 0.0);
    CHECK(control_keep(2, 4, 0.5, 1.0) == 1.0);
    CHECK(control_keep(3, 4, 0.0, 0.75) == 0.0);
    // A DeepCache shallow step with the control attached adds the shallow residuals to the shallow skips.
    SkipFeatureCapture f(0);
    (void)unet.forward(x, t, given, &f);
    UNetCond head(ctx);
    head.residuals.down = {full.down[0]};
    CHECK(
        torch::equal(unet.forward_shallow(x, t, given, 0, f.feature), unet.forward_shallow(x, t, head, 0, f.feature)));
}

TEST_CASE("ControlNet guess mode leaves the unconditional rows of a CFG batch without residuals", "[controlnet][sd]") {
    auto models = test::deepcache_models();
    auto& unet = *models.unet;
    ControlParams cp;
    cp.net = random_controlnet(unet.config());
    cp.source = "random", cp.scale = 1.0, cp.guess_mode = true, cp.pixels = random_pixels(16, 16, 2);
    c10::InferenceMode guard;
    torch::manual_seed(4);
    const auto x = torch::randn({2, 4, 8, 8}), ctx = torch::randn({2, 77, unet.config().cross_attention_dim});
    const auto t = torch::tensor(301.0f).reshape({});
    const ControlRun run({cp}, 16, 16, 1, 1, /*cfg=*/true, 6);
    const auto out = unet.forward(x, t, run.at(UNetCond(ctx), 0));
    const auto plain = unet.forward(x, t, ctx);
    CHECK(torch::allclose(out[0], plain[0], 1e-5, 1e-5));
    CHECK_FALSE(torch::allclose(out[1], plain[1], 1e-3, 1e-3));
}

TEST_CASE("ControlNet on the tiny pipeline with the caches off, deepcache:3 and freq: finite and close to off",
          "[controlnet][sd][pipeline][freq]") {
    auto models = test::deepcache_models();
    Txt2ImgPipeline pipe(models);
    auto p = test::tiny_params(10, SamplerKind::DDIM);
    ControlParams cp;
    cp.net = random_controlnet(models.unet->config());
    cp.source = "random", cp.scale = 0.5, cp.pixels = random_pixels(p.width, p.height, 3);
    c10::InferenceMode guard;
    const auto without = pipe.run(p).image_uint8;
    p.control = {cp};
    torch::Tensor reference;
    for (const char* mode : {"off", "deepcache:3", "freq"}) {
        INFO(mode);
        auto ctl = parse_cache_mode(mode);
        const auto r = pipe.run(p, ctl.get());
        CHECK(torch::isfinite(r.image).all().item<bool>());
        if (!reference.defined()) {
            reference = r.image_uint8;
            CHECK(r.full_steps == r.total_steps);
            CHECK(psnr(reference, without) < 40.0); // the ControlNet moves the image
            continue;
        }
        CHECK(r.full_steps < r.total_steps);
        const double db = psnr(r.image_uint8, reference);
        WARN(mode << " vs off with a ControlNet: " << db << " dB");
        CHECK(db > 20.0);
        // The same mode without the ControlNet, for the record (the cache's own distance on this model).
        p.control.clear();
        auto plain_ctl = parse_cache_mode(mode);
        WARN(mode << " vs off without a ControlNet: " << psnr(pipe.run(p, plain_ctl.get()).image_uint8, without)
                  << " dB");
        p.control = {cp};
    }
}

TEST_CASE("anchor-sd --control-net: a folder and a single file run, --compare with the caches, bad input exits 2 "
          "naming the file with nothing written",
          "[controlnet][cli][sd]") {
    namespace fs = std::filesystem;
    const auto dir = test::scratch_dir("cli_sd_controlnet");
    const std::string model = "assets/models/sd15-tiny-random";
    const auto ucfg = nlohmann::json::parse(std::ifstream(model + "/unet/config.json"));
    const auto net = random_controlnet(UNetConfig::from_json(ucfg));
    const std::string folder = test::save_controlnet_folder(net, ucfg, dir + "/cn");
    const std::string image = dir + "/edges.png";
    write_png(image, random_pixels(16, 16, 9), true);
    auto args = [&](const std::string& cn, const std::string& img, const std::string& out) {
        return std::vector<std::string>{"-m",
                                        model,
                                        "-p",
                                        "a cat",
                                        "--steps",
                                        "4",
                                        "--control-net",
                                        cn,
                                        "--control-image",
                                        img,
                                        "--control-scale",
                                        "0.7",
                                        "-o",
                                        out,
                                        "--threads",
                                        "1"};
    };
    SECTION("folder and single file give the same image, at the control image's size") {
        auto r = test::run_program(test::sd_bin(), args(folder, image, dir + "/a.png"));
        INFO(r.output);
        REQUIRE(r.exit_code == 0);
        auto r2 = test::run_program(test::sd_bin(),
                                    args(folder + "/diffusion_pytorch_model.safetensors", image, dir + "/b.png"));
        INFO(r2.output);
        REQUIRE(r2.exit_code == 0);
        const auto a = read_image_rgb(dir + "/a.png"), b = read_image_rgb(dir + "/b.png");
        CHECK(a.size(0) == 16);
        CHECK(torch::equal(a, b));
        // The sidecar says what steered the image.
        const auto rec = nlohmann::json::parse(std::ifstream(dir + "/a.png.json"));
        REQUIRE(rec.contains("controlnets"));
        CHECK(rec["controlnets"][0]["model"] == folder);
        CHECK(rec["controlnets"][0]["scale"].get<double>() == Approx(0.7));
        CHECK(rec["controlnets"][0]["image_sha256"].get<std::string>().size() == 64);
    }
    SECTION("--compare off,deepcache:3,freq") {
        auto a = args(folder, image, dir + "/cmp.png");
        a.insert(a.end(), {"--compare", "off,deepcache:3,freq"});
        auto r = test::run_program(test::sd_bin(), a);
        INFO(r.output);
        REQUIRE(r.exit_code == 0);
        const auto rep = nlohmann::json::parse(std::ifstream(dir + "/cmp_report.json"));
        REQUIRE(rep["modes"].size() == 3);
    }
    SECTION("a ControlNet of other widths, an unreadable control image") {
        UNetConfig other = UNetConfig::from_json(ucfg);
        for (auto& c : other.block_out_channels) c *= 2;
        auto wide = ucfg;
        wide["block_out_channels"] = other.block_out_channels;
        const std::string bad = test::save_controlnet_folder(random_controlnet(other), wide, dir + "/wide");
        auto r = test::run_program(test::sd_bin(), args(bad, image, dir + "/bad.png"));
        INFO(r.output);
        CHECK(r.exit_code == 2);
        CHECK_THAT(r.output, Catch::Contains("error: --control-net") && Catch::Contains(bad) &&
                                 Catch::Contains("block_out_channels"));
        CHECK_FALSE(fs::exists(dir + "/bad.png"));
        auto r2 = test::run_program(test::sd_bin(), args(folder, dir + "/missing.png", dir + "/bad2.png"));
        INFO(r2.output);
        CHECK(r2.exit_code == 2);
        CHECK_THAT(r2.output, Catch::Contains("missing.png"));
        CHECK_FALSE(fs::exists(dir + "/bad2.png"));
    }
}

TEST_CASE("ControlNet bad input: another family's ControlNet, an unreadable control image, counts", "[controlnet]") {
    auto models = test::deepcache_models();
    const auto& u = models.unet->config();
    ControlParams cp;
    UNetConfig other = u;
    other.block_out_channels = {32, 64};
    other.down_block_types = {"CrossAttnDownBlock2D", "DownBlock2D"};
    other.up_block_types = {"UpBlock2D", "CrossAttnUpBlock2D"};
    other.layers_per_block = {2, 2}, other.heads = {8, 8}, other.transformer_layers_per_block = {1, 1};
    cp.net = random_controlnet(other);
    cp.source = "other.safetensors", cp.pixels = random_pixels(16, 16, 5);
    try {
        validate_control({cp}, u, 1);
        FAIL("a ControlNet of other widths was accepted");
    } catch (const ParamError& e) {
        CHECK(e.field() == "control_net");
        CHECK_THAT(e.what(), Catch::Contains("other.safetensors") && Catch::Contains("block_out_channels"));
    }
    cp.net = random_controlnet(u);
    cp.pixels = torch::Tensor();
    cp.image = "/nonexistent/edges.png";
    try {
        validate_control({cp}, u, 1);
        FAIL("an unreadable control image was accepted");
    } catch (const ParamError& e) {
        CHECK(e.field() == "control_image");
        CHECK_THAT(e.what(), Catch::Contains("/nonexistent/edges.png"));
    }
    CHECK_THROWS_AS(make_control_params({"a", "b"}, {"x.png"}, {}, {}, {}, false), ParamError);
    cp.pixels = random_pixels(16, 16, 5), cp.start = 0.6, cp.end = 0.4;
    CHECK_THROWS_AS(validate_control({cp}, u, 1), ParamError);
}

TEST_CASE("ControlNet for an SDXL UNet: the added conditioning reaches the ControlNet's time embedding",
          "[controlnet][sdxl]") {
    auto unet = load_unet_folder(test::golden("sd/sdxl_tiny/unet"));
    const auto& u = unet->config();
    REQUIRE(u.text_time());
    auto net = random_controlnet(u);
    REQUIRE(net->add_embedding);
    c10::InferenceMode guard;
    torch::manual_seed(5);
    const int64_t pooled = u.projection_class_embeddings_input_dim - 6 * u.addition_time_embed_dim;
    const auto x = torch::randn({1, u.in_channels, 8, 8}), ctx = torch::randn({1, 77, u.cross_attention_dim});
    UNetCond cond(ctx, torch::randn({1, pooled}), torch::tensor({{16.0f, 16.0f, 0.0f, 0.0f, 16.0f, 16.0f}}));
    const auto t = torch::tensor(500.0f).reshape({});
    const auto image = torch::rand({1, 3, 16, 16});
    const auto r = net->residuals(x, t, cond, image, 1.0, false);
    UNetCond with = cond;
    with.residuals = r;
    const auto out = unet->forward(x, t, with);
    CHECK(torch::isfinite(out).all().item<bool>());
    CHECK_FALSE(torch::allclose(out, unet->forward(x, t, cond)));
    // Other time ids change the residuals: the ControlNet reads them.
    UNetCond other = cond;
    other.time_ids = torch::tensor({{32.0f, 32.0f, 0.0f, 0.0f, 32.0f, 32.0f}});
    CHECK_FALSE(torch::equal(net->residuals(x, t, other, image, 1.0, false).mid, r.mid));
}
