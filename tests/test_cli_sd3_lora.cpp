// anchor-sd --lora on SD 3 / 3.5 models, run as users run it: the golden pipeline with a PEFT LoRA
// (tests/golden/sd/sd3_lora_tiny) reproduced from the command line and from an A1111 prompt tag, --compare with the
// LoRA, and the errors for a LoRA that does not fit (exit 1, naming the file and the tensors) or is missing (exit 2).
#include "cache/io/png_text.h"
#include "cache/io/safetensors.h"
#include "cache/io/weight_map.h"
#include "tests/test_cli_util.h"
#include "tests/test_util.h"
#include "unet/pipeline/img2img.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

using namespace anchor;
namespace fs = std::filesystem;

namespace {

struct Sd3LoraCli {
    std::string model = test::golden("sd/sd3_tiny_text"), lora_dir = test::golden("sd/sd3_lora_tiny");
    nlohmann::json p = nlohmann::json::parse(test::read_bytes(lora_dir + "/golden.json"))["pipeline"];
    std::string mult = p["multiplier"].dump();

    std::vector<std::string> args(const std::string& prompt, const std::string& png) const {
        return {"-m", model, "-p", prompt, "-n", p["negative_prompt"].get<std::string>(), "--steps",
                p["num_inference_steps"].dump(), "--cfg-scale", p["guidance_scale"].dump(), "-s",
                p["generator_seed"].dump(), "-W", p["width"].dump(), "-H", p["height"].dump(), "-o", png,
                "--threads", "1", "--overwrite"};
    }
    // Image 0 of the golden batch (its initial latents are the first rows the seeded generator draws), within the
    // free-running tolerance the generator measured, plus the 8-bit rounding.
    void check_image(const std::string& png) const {
        const auto g = WeightMap::load(lora_dir + "/golden_sd3_lora.safetensors").get("pipeline.image")[0];
        const auto want = (g * 255).round().permute({1, 2, 0});
        const auto got = unet::read_image_rgb(png).to(torch::kFloat);
        CHECK(test::max_abs_diff(got, want) <= 1.0 + 255 * p["free_running_image_atol"].get<double>());
    }
};

} // namespace

TEST_CASE("anchor-sd --lora on SD 3 reproduces diffusers' pipeline with the LoRA", "[cli][sd3][lora]") {
    const Sd3LoraCli c;
    const std::string dir = test::scratch_dir("cli_sd3_lora"), png = dir + "/a.png";
    auto a = c.args(c.p["prompts"][0].get<std::string>(), png);
    a.insert(a.end(), {"--lora", c.lora_dir + "/lora_peft.safetensors:" + c.mult});
    auto r = test::run_program(test::sd_bin(), a);
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    CHECK_THAT(r.output, Catch::Contains("modules merged"));
    c.check_image(png);
    const auto rec = nlohmann::json::parse(test::read_bytes(png + ".json"));
    REQUIRE(rec["loras"].size() == 1);
    CHECK(rec["loras"][0]["multiplier"].get<double>() == c.p["multiplier"].get<double>());
    CHECK(rec["loras"][0]["format"] == "peft");
    bool hashes = false;
    for (const auto& ch : read_png_text_chunks(png))
        hashes = hashes || (ch.keyword == "parameters" && ch.text.find("Lora hashes: \"lora_peft: ") != std::string::npos);
    CHECK(hashes);

    // The same LoRA as an A1111 tag in the prompt.
    const std::string png2 = dir + "/b.png";
    auto b = c.args(c.p["prompts"][0].get<std::string>() + " <lora:lora_peft:" + c.mult + ">", png2);
    b.insert(b.end(), {"--lora-model-dir", c.lora_dir});
    r = test::run_program(test::sd_bin(), b);
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    c.check_image(png2);
    CHECK(nlohmann::json::parse(test::read_bytes(png2 + ".json"))["prompt"] == c.p["prompts"][0]);

    // --compare with the LoRA merged: every mode runs on the merged weights, the report records the LoRA.
    auto d = c.args(c.p["prompts"][0].get<std::string>(), dir + "/cmp.png");
    d.insert(d.end(), {"--lora", c.lora_dir + "/lora_kohya.safetensors:" + c.mult, "--compare", "off,fbcache"});
    r = test::run_program(test::sd_bin(), d);
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    CHECK(fs::exists(dir + "/cmp_report.json"));
    CHECK_THAT(test::read_bytes(dir + "/cmp_report.json"), Catch::Contains("lora_kohya"));
}

TEST_CASE("anchor-sd --lora on SD 3: a LoRA that does not fit is an error naming the file and tensors", "[cli][sd3][lora][errors]") {
    const Sd3LoraCli c;
    const std::string dir = test::scratch_dir("cli_sd3_lora_errors");
    NamedTensors bad = {{"lora_unet_joint_blocks_0_x_block_attn_qkv.lora_down.weight", torch::zeros({4, 16})},
                        {"lora_unet_joint_blocks_0_x_block_attn_qkv.lora_up.weight", torch::zeros({47, 4})},
                        {"transformer.not_a_module.lora_A.weight", torch::zeros({4, 16})}};
    save_safetensors(dir + "/bad.safetensors", bad);
    auto a = c.args("a cat", dir + "/x.png");
    a.insert(a.end(), {"--lora", dir + "/bad.safetensors"});
    auto r = test::run_program(test::sd_bin(), a);
    INFO(r.output);
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.output, Catch::Contains("error: LoRA file '" + dir + "/bad.safetensors' does not fit the model"));
    CHECK_THAT(r.output, Catch::Contains("transformer.not_a_module.lora_A.weight"));
    CHECK_THAT(r.output, Catch::Contains("lora_unet_joint_blocks_0_x_block_attn_qkv: down [4, 16] / up [47, 4]"));
    CHECK(!fs::exists(dir + "/x.png"));

    a = c.args("a cat", dir + "/x.png");
    a.insert(a.end(), {"--lora", dir + "/missing.safetensors:0.5"});
    r = test::run_program(test::sd_bin(), a);
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.output, Catch::Contains("missing.safetensors' does not exist"));
}
