// anchor-sd on SD 3 / 3.5 models, run as users run it: the golden T5 pipeline case reproduced to the pixel, the
// records written, the options SD 3 does not take refused by name (exit 2).
#include "cache/io/png_text.h"
#include "cache/io/weight_map.h"
#include "tests/test_cli_util.h"
#include "tests/test_util.h"
#include "unet/pipeline/img2img.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <fstream>

using namespace anchor;
namespace fs = std::filesystem;

TEST_CASE("anchor-sd reproduces diffusers' SD 3 pipeline with T5 to the pixel", "[cli][sd3]") {
    const std::string model = test::golden("sd/sd3_tiny_t5");
    const auto j = nlohmann::json::parse(test::read_bytes(model + "/golden.json"));
    const std::string dir = test::scratch_dir("cli_sd3"), png = dir + "/a.png";
    fs::remove(png), fs::remove(png + ".json");
    const auto r = test::run_program(
        test::sd_bin(), {"-m", model, "-p", j["prompts"][0].get<std::string>(), "-n", j["negative_prompt"],
                         "--steps", std::to_string(j["num_inference_steps"].get<int>()), "--cfg-scale",
                         std::to_string(j["guidance_scale"].get<double>()), "-s",
                         std::to_string(j["generator_seed"].get<int>()), "-W", std::to_string(j["width"].get<int>()),
                         "-H", std::to_string(j["height"].get<int>()), "-o", png, "--threads", "1"});
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    // Image 0 of the golden batch: its initial latents are the first rows the seeded generator draws.
    const auto g = WeightMap::load(model + "/golden_sd3_text.safetensors").get("image")[0];
    const auto want = (g * 255).round().to(torch::kUInt8).permute({1, 2, 0});
    CHECK(torch::equal(unet::read_image_rgb(png), want));
    const auto rec = nlohmann::json::parse(test::read_bytes(png + ".json"));
    CHECK(rec["family"] == "sd3");
    CHECK(rec["t5"] == true);
    CHECK(rec["shift"].get<double>() == 3.0);
    bool infotext = false;
    for (const auto& c : read_png_text_chunks(png))
        infotext = infotext || (c.keyword == "parameters" && c.text.find("Sampler: Euler") != std::string::npos);
    CHECK(infotext);
}

TEST_CASE("anchor-sd --slg-layers reproduces diffusers' skip-layer guidance to the pixel", "[cli][sd3]") {
    const std::string model = test::golden("sd/sd3_tiny_slg");
    const auto j = nlohmann::json::parse(test::read_bytes(model + "/golden.json"));
    const std::string dir = test::scratch_dir("cli_sd3_slg"), png = dir + "/a.png";
    auto num = [](const nlohmann::json& v) { return v.dump(); };
    std::string layers;
    for (const auto& l : j["skip_guidance_layers"]) layers += (layers.empty() ? "" : ",") + l.dump();
    const auto r = test::run_program(
        test::sd_bin(),
        {"-m", model, "-p", j["prompts"][0].get<std::string>(), "-n", j["negative_prompt"], "--steps",
         num(j["num_inference_steps"]), "--cfg-scale", num(j["guidance_scale"]), "-s", num(j["generator_seed"]), "-W",
         num(j["width"]), "-H", num(j["height"]), "--slg-layers", layers, "--slg-scale",
         num(j["skip_layer_guidance_scale"]), "--slg-start", num(j["skip_layer_guidance_start"]), "--slg-end",
         num(j["skip_layer_guidance_stop"]), "-o", png, "--threads", "1"});
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    const auto g = WeightMap::load(model + "/golden_sd3_text.safetensors").get("image")[0];
    CHECK(torch::equal(unet::read_image_rgb(png), (g * 255).round().to(torch::kUInt8).permute({1, 2, 0})));
    const auto rec = nlohmann::json::parse(test::read_bytes(png + ".json"));
    CHECK(rec["slg"]["layers"] == j["skip_guidance_layers"]);
}

TEST_CASE("anchor-sd on SD 3 refuses what it does not run, naming it", "[cli][sd3][errors]") {
    const std::string model = test::golden("sd/sd3_tiny_t5");
    const std::string dir = test::scratch_dir("cli_sd3_errors");
    auto run = [&](std::vector<std::string> extra, const std::string& width = "16") {
        std::vector<std::string> args = {"-m", model, "-p", "a cat", "--steps", "1", "-W", width, "-H", "16",
                                         "-o", dir + "/x.png", "--overwrite"};
        args.insert(args.end(), extra.begin(), extra.end());
        return test::run_program(test::sd_bin(), args);
    };
    auto r = run({"--compare", "off,deepcache:3"});
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.output, Catch::Contains("error: --compare: cache mode 'deepcache:3' does not apply to SD 3 / 3.5"));
    r = run({"--cache", "freq:attn=run"});
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.output, Catch::Contains("freq on SD 3 / 3.5 (MMDiT) takes the keys"));
    r = run({"--cache", "fbcache", "--compare", "off"});
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.output, Catch::Contains("--cache and --compare are exclusive"));
    r = run({"--sampler", "ddim"});
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.output, Catch::Contains("--sampler is not available for SD 3"));
    r = run({}, "18");
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.output, Catch::Contains("width: must be a multiple of"));
    r = run({"--no-t5", "--compare", "off"});
    INFO(r.output);
    CHECK(r.exit_code == 0);
    CHECK(fs::exists(dir + "/x_report.json"));
}

TEST_CASE("anchor-sd --compare runs the transformer caches on SD 3: grid, timeline, report", "[cli][sd3][dit_cache]") {
    const std::string model = test::golden("sd/sd3_tiny_text");
    const std::string dir = test::scratch_dir("cli_sd3_compare");
    auto run = [&](std::vector<std::string> extra, const std::string& out) {
        std::vector<std::string> args = {"-m", model, "-p", "a cat", "--steps", "8", "-W", "16", "-H", "16", "-s", "3",
                                         "-o", out, "--overwrite", "--threads", "1"};
        args.insert(args.end(), extra.begin(), extra.end());
        return test::run_program(test::sd_bin(), args);
    };
    auto r = run({"--compare", "off,freq,fbcache,teacache,taylorseer"}, dir + "/cmp.png");
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    CHECK(fs::exists(dir + "/cmp.png"));
    CHECK(fs::exists(dir + "/cmp_timeline.png"));
    const auto rep = nlohmann::json::parse(test::read_bytes(dir + "/cmp_report.json"));
    REQUIRE(rep["modes"].size() == 5);
    CHECK(rep["family"] == "sd3");
    CHECK(rep["modes"][0]["identical_to_first"] == true);
    for (size_t i = 0; i < 5; ++i) {
        CHECK(rep["modes"][i]["total_steps"] == 8);
        CHECK(rep["modes"][i]["steps"].size() == 8);
    }
    CHECK(rep["modes"][4]["kind"] == "taylorseer");
    // --cache: a mode at threshold 0 writes the uncached image.
    r = run({}, dir + "/off.png");
    REQUIRE(r.exit_code == 0);
    r = run({"--cache", "fbcache:thr=0"}, dir + "/fb.png");
    REQUIRE(r.exit_code == 0);
    CHECK(torch::equal(unet::read_image_rgb(dir + "/fb.png"), unet::read_image_rgb(dir + "/off.png")));
    const auto rec = nlohmann::json::parse(test::read_bytes(dir + "/fb.png.json"));
    CHECK(rec["cache_mode"] == "fbcache:thr=0");
    CHECK(rec["cache"]["full_steps"] == 8);
}

TEST_CASE("anchor-sd -i on SD 3 reproduces diffusers' img2img pipeline", "[cli][sd3][img2img]") {
    const std::string model = test::golden("sd/sd3_tiny_img2img");
    const auto j = nlohmann::json::parse(test::read_bytes(model + "/golden.json"));
    const std::string dir = test::scratch_dir("cli_sd3_img2img"), png = dir + "/a.png";
    auto num = [](const nlohmann::json& v) { return v.dump(); };
    const auto r = test::run_program(
        test::sd_bin(), {"-m", model, "-p", j["prompts"][0].get<std::string>(), "-n", j["negative_prompt"], "-i",
                         model + "/" + j["init_image"].get<std::string>(), "--strength", num(j["strength"]), "--steps",
                         num(j["num_inference_steps"]), "--cfg-scale", num(j["guidance_scale"]), "-s",
                         num(j["generator_seed"]), "-o", png, "--overwrite", "--threads", "1"});
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    // Image 0 of the golden batch: one init image encoded once (the same first draw), then the noise's first rows.
    const auto g = WeightMap::load(model + "/golden_sd3_img2img.safetensors").get("image")[0];
    const auto want = (g * 255).round().to(torch::kInt).permute({1, 2, 0});
    CHECK((unet::read_image_rgb(png).to(torch::kInt) - want).abs().max().item<int>() <= 1);
    const auto rec = nlohmann::json::parse(test::read_bytes(png + ".json"));
    CHECK(rec["strength"].get<double>() == j["strength"].get<double>());
    const auto bad = test::run_program(test::sd_bin(), {"-m", model, "-p", "x", "-i", model + "/init.png", "-W", "32",
                                                        "-o", dir + "/b.png", "--overwrite"});
    CHECK(bad.exit_code == 2);
    CHECK_THAT(bad.output, Catch::Contains("img2img runs at the init image's size (16x16), got 32"));
}
