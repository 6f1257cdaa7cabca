// `anchor-sd bench-cache -m <SD 3 model>` on the tiny SD 3 pipeline (tests/golden/sd/sd3_tiny_text): it runs, reports
// every transformer mode with its full steps and the whole image's timings (no timing is asserted: this machine's
// times are noise), and refuses the UNet-only options by name.
#include "tests/test_cli_util.h"
#include "tests/test_util.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <filesystem>

using namespace anchor;

TEST_CASE("anchor-sd bench-cache on an SD 3 model reports every DiT mode", "[cli][sd3][bench]") {
    const std::string model = test::golden("sd/sd3_tiny_text");
    const std::string dir = test::scratch_dir("cli_sd3_bench"), out = dir + "/bench.txt";
    const auto r = test::run_program(test::sd_bin(), {"bench-cache", "-m", model, "--steps", "4", "--max-prompts",
                                                      "1", "-W", "16", "-H", "16", "-o", out, "--overwrite"});
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    CHECK_THAT(r.output, Catch::Contains("SD 3 / 3.5") && Catch::Contains("image s min/median/max"));
    const auto rep = nlohmann::json::parse(test::read_bytes(out + ".json"));
    const std::vector<std::string> want = {"off", "freq", "fbcache", "teacache", "taylorseer"};
    REQUIRE(rep["modes"].size() == want.size());
    for (size_t i = 0; i < want.size(); ++i) {
        const auto& m = rep["modes"][i];
        INFO(m.dump());
        CHECK(m["mode"] == want[i]);
        CHECK(m["total_steps"] == 4);
        CHECK(m["full_steps"].get<int>() >= 1);
        CHECK(m["full_steps"].get<int>() <= 4);
        CHECK(m["image_s"].size() == 1);
        CHECK(m["image_s_median"].get<double>() >= m["wall_s_median"].get<double>());
        CHECK(m["speedup_vs_first_median"].is_number());
        CHECK_THAT(r.output, Catch::Contains(want[i] + " "));
    }
    CHECK(rep["modes"][0]["full_steps"] == 4);
    CHECK(rep["modes"][0]["psnr_db"] == "inf");
    // A chosen list, a mode that does not apply, and a UNet-only option.
    const auto two = test::run_program(test::sd_bin(), {"bench-cache", "-m", model, "--steps", "2", "--max-prompts",
                                                        "1", "--modes", "off,fbcache:thr=0.2"});
    INFO(two.output);
    CHECK(two.exit_code == 0);
    CHECK_THAT(two.output, Catch::Contains("fbcache:thr=0.2"));
    const auto dc = test::run_program(test::sd_bin(), {"bench-cache", "-m", model, "--modes", "off,deepcache:3"});
    CHECK(dc.exit_code == 2);
    CHECK_THAT(dc.output, Catch::Contains("deepcache:3"));
    const auto sampler = test::run_program(test::sd_bin(), {"bench-cache", "-m", model, "--sampler", "ddim"});
    CHECK(sampler.exit_code == 2);
    CHECK_THAT(sampler.output, Catch::Contains("--sampler does not apply to SD 3"));
}
