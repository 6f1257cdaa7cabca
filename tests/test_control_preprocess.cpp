// --control-preprocess canny (unet/pipeline/control_preprocess.h) against Debian's python3-opencv cv2.Canny on an
// RGB image (tests/data/canny/make_canny_reference.py), the option's forms, and anchor-sd with it.
#include "cache/io/error.h"
#include "tests/test_cli_util.h"
#include "tests/test_util.h"
#include "unet/pipeline/control_preprocess.h"
#include "unet/pipeline/img2img.h"

#include <catch2/catch.hpp>

#include <filesystem>

using namespace anchor;
using namespace anchor::unet;

TEST_CASE("control preprocess canny: cv2.Canny's edges on an RGB image, A1111's default and other thresholds",
          "[controlnet]") {
    const std::string dir = "tests/data/canny";
    const auto rgb = read_image_rgb(dir + "/input.png");
    // The library decides (ANCHOR_HAVE_OPENCV is its own definition): a build without OpenCV says so.
    try {
        (void)preprocess_control_image(rgb, ControlPreprocessSpec::parse("canny", "x"));
    } catch (const ParamError& e) {
        CHECK(std::string(e.what()).find("needs OpenCV") != std::string::npos);
        WARN("built without OpenCV: the canny comparison is skipped");
        return;
    }
    for (const auto& [spec, file] : {std::pair<std::string, std::string>{"canny", "edges_100_200.png"},
                                     {"canny:50:120", "edges_50_120.png"}}) {
        INFO(spec);
        const auto out = preprocess_control_image(rgb, ControlPreprocessSpec::parse(spec, "control_preprocess"));
        REQUIRE(out.sizes() == rgb.sizes());
        const auto want = read_image_grey(dir + "/" + file);
        CHECK(torch::equal(out.select(2, 0), want));
        CHECK(torch::equal(out.select(2, 1), out.select(2, 2)));
        CHECK(want.gt(0).sum().item<int64_t>() > 20); // the pattern has edges at these thresholds
    }
    const auto batch = preprocess_control_image(torch::stack({rgb, rgb}), ControlPreprocessSpec::parse("canny", "x"));
    CHECK(batch.size(0) == 2);
    CHECK(torch::equal(preprocess_control_image(rgb, ControlPreprocessSpec::parse("none", "x")), rgb));
    for (const char* bad : {"sobel", "canny:1", "canny:200:100", "canny:a:b", "none:1:2", "canny:-1:5"})
        CHECK_THROWS_WITH(ControlPreprocessSpec::parse(bad, "control_preprocess"),
                          Catch::Contains("control_preprocess: expected none, canny or canny:LOW:HIGH"));
}

TEST_CASE("anchor-sd --control-preprocess: a bad form exits 2 before anything runs", "[controlnet][cli]") {
    const auto dir = test::scratch_dir("cli_canny");
    const std::string out = dir + "/x.png";
    auto r = test::run_program(test::sd_bin(),
                               {"-m", "assets/models/sd15-tiny-random", "-p", "a", "--steps", "1", "-W", "16", "-H",
                                "16", "--control-net", "../shared/golden/sd/controlnet_tiny/controlnet",
                                "--control-image", "tests/data/canny/input.png", "--control-preprocess", "sobel", "-o",
                                out, "--threads", "1"});
    INFO(r.output);
    if (!std::filesystem::exists("../shared/golden/sd/controlnet_tiny/controlnet")) return;
    CHECK(r.exit_code == 2);
    CHECK(r.output.find("error: --control-preprocess: expected none, canny") != std::string::npos);
    CHECK(!std::filesystem::exists(out));
    r = test::run_program(test::sd_bin(),
                          {"-m", "assets/models/sd15-tiny-random", "-p", "a", "--steps", "1", "-W", "16", "-H", "16",
                           "--control-net", "../shared/golden/sd/controlnet_tiny/controlnet", "--control-image",
                           "tests/data/canny/input.png", "--control-preprocess", "canny", "-o", out, "--threads", "1"});
    CHECK(r.exit_code == 0);
    CHECK(std::filesystem::exists(out));
}
