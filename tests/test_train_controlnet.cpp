// The demo model's ControlNet trainer (unet/train/controlnet_train.h): from_unet's initialisation (the UNet's encoder,
// zero convolutions: the UNet's output is unchanged), the config.json diffusers reads, a few training steps that reach
// the zero convolutions and write a folder load_controlnet reads, the edge maps, and the CLI's bad input.
#include "cache/io/json_config.h"
#include "tests/test_cli_util.h"
#include "tests/test_util.h"
#include "unet/model/checkpoint.h"
#include "unet/model/controlnet.h"
#include "unet/train/controlnet_train.h"
#include "unet/train/fashion_mnist.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>

using namespace anchor;
using namespace anchor::unet;

namespace {

const std::string kFashion = "assets/models/fashion-sd";

bool have_fashion_data() {
    return std::filesystem::exists(std::string(train::kFashionMnistDir) + "/train-images-idx3-ubyte.gz");
}

} // namespace

TEST_CASE("ControlNet from the fashion UNet: its encoder copied, zero residuals, the UNet's output unchanged",
          "[controlnet][train]") {
    auto unet = load_unet_folder(kFashion + "/unet");
    unet->eval();
    auto cn = train::controlnet_from_unet(*unet, {16, 32, 64});
    cn->eval();
    CHECK(torch::equal(cn->conv_in->weight, unet->conv_in->weight));
    CHECK(torch::equal(cn->time_embedding->linear_2->weight, unet->time_embedding->linear_2->weight));
    torch::manual_seed(3);
    const auto x = torch::randn({2, 4, 8, 8});
    const auto ctx = torch::randn({2, 77, 64});
    const auto t = torch::tensor({900, 50});
    const auto hint = torch::rand({2, 3, 32, 32});
    const auto r = cn->residuals(x, t, UNetCond(ctx), hint, 1.0, false);
    REQUIRE(int(r.down.size()) == unet->num_skips());
    for (const auto& d : r.down) CHECK(d.abs().max().item<float>() == 0.0f);
    CHECK(r.mid.abs().max().item<float>() == 0.0f);
    UNetCond with(ctx);
    with.residuals = r;
    CHECK(torch::equal(unet->forward(x, t, with), unet->forward(x, t, UNetCond(ctx))));
    CHECK(controlnet_mismatch(*cn, unet->config()).empty());
}

TEST_CASE("ControlNet config.json: diffusers' ControlNetModel keys only, read back to the same config",
          "[controlnet][train][config]") {
    const auto u = UNetConfig::from_json_file(kFashion + "/unet/config.json");
    const auto c = train::controlnet_config_from_unet(u, {16, 32, 64});
    const auto j = train::controlnet_config_json(c);
    CHECK(j["_class_name"] == "ControlNetModel");
    for (const char* k : {"up_block_types", "out_channels", "sample_size"}) CHECK_FALSE(j.contains(k));
    CHECK(j["conditioning_embedding_out_channels"] == nlohmann::json({16, 32, 64}));
    const auto back = ControlNetConfig::from_json(j);
    CHECK(back.embedding_channels == c.embedding_channels);
    CHECK(back.unet.block_out_channels == u.block_out_channels);
    CHECK(back.unet.cross_attention_dim == u.cross_attention_dim);
    CHECK(train::controlnet_config_json(back) == j);
    const std::string committed = kFashion + "/controlnet-canny/config.json";
    if (std::filesystem::exists(committed))
        CHECK(train::controlnet_config_json(ControlNetConfig::from_json_file(committed)) ==
              JsonConfig::load(committed, "committed").json());
    CHECK_THROWS_WITH(train::controlnet_config_from_unet(u, {}), Catch::Contains("hint_channels"));
}

TEST_CASE("ControlNet training: steps reach the zero convolutions, the folder loads, the edge maps",
          "[controlnet][train]") {
    if (!have_fashion_data()) {
        WARN("Fashion-MNIST not installed (Debian dataset-fashion-mnist): skipped");
        return;
    }
    SECTION("edge maps: 32x32 RGB, 0 or 255, the class's test image") {
        const auto e = train::fashion_test_edges(train::kFashionMnistDir, 7, 0, train::fashion_canny_spec());
        CHECK(e.sizes().vec() == std::vector<int64_t>{32, 32, 3});
        CHECK(((e == 0) | (e == 255)).all().item<bool>());
        CHECK(e.gt(0).sum().item<int64_t>() > 20);
        CHECK(e.select(2, 0).narrow(0, 0, 1).sum().item<int64_t>() == 0); // the black frame has no edges
        CHECK_THROWS_WITH(train::fashion_test_edges(train::kFashionMnistDir, 11, 0, train::fashion_canny_spec()),
                          Catch::Contains("class"));
    }
    SECTION("three steps, then a folder load_controlnet reads with non-zero residuals") {
        const auto dir = test::scratch_dir("controlnet_train");
        train::ControlNetTrainOptions o;
        o.model = kFashion;
        o.train.out = dir + "/cn";
        o.train.steps = 3;
        o.train.batch = 4;
        o.train.lr = 1e-3;
        o.train.warmup = 0;
        o.train.ema = 0;
        o.train.quiet = true;
        const auto r = train::train_controlnet(o);
        CHECK(r.steps_done == 3);
        CHECK(std::isfinite(r.final_loss));
        auto cn = load_controlnet(o.train.out);
        auto unet = load_unet_folder(kFashion + "/unet");
        CHECK(controlnet_mismatch(*cn, unet->config()).empty());
        torch::manual_seed(4);
        const auto res = cn->residuals(torch::randn({1, 4, 8, 8}), torch::tensor({500}),
                                       UNetCond(torch::randn({1, 77, 64})), torch::rand({1, 3, 32, 32}), 1.0, false);
        CHECK(res.mid.abs().max().item<float>() > 0.0f); // the gradient reached the zero convolutions
        CHECK(std::filesystem::exists(o.train.out + "/train_controlnet_log.txt"));
    }
}

TEST_CASE("anchor-sd fashion-edges and train-controlnet: bad input exits 2 naming the option, nothing written",
          "[controlnet][train][cli]") {
    const auto dir = test::scratch_dir("cli_fashion_edges");
    const std::string out = dir + "/edges.png";
    auto r = test::run_program(test::sd_bin(), {"fashion-edges", "-p", "a photo of a cat", "-o", out});
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.output, Catch::Contains("error: --prompt 'a photo of a cat'"));
    CHECK_FALSE(std::filesystem::exists(out));
    r = test::run_program(test::sd_bin(), {"train-controlnet", "-o", dir + "/cn", "--preprocess", "sobel"});
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.output, Catch::Contains("--preprocess"));
    CHECK_FALSE(std::filesystem::exists(dir + "/cn"));
    if (have_fashion_data()) {
        r = test::run_program(test::sd_bin(), {"fashion-edges", "-p", "a picture of a sneaker", "-o", out});
        CHECK(r.exit_code == 0);
        CHECK(std::filesystem::exists(out));
    }
}
