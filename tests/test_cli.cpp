// The programs as users run them: anchor-sd reproduces the golden txt2img runs from both checkpoint layouts (seed
// parity exact, free-running within the golden README's tolerance), and every output is written as promised.
#include "cache/io/safetensors.h"
#include "tests/test_cli_util.h"
#include "tests/test_util.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <fstream>
#include <sstream>

using namespace anchor;
namespace fs = std::filesystem;

namespace {

const char* kGoldenPrompt = "a photo of an astronaut riding a horse on mars";

// anchor-sd arguments of a golden txt2img run, one thread, latents saved next to the PNG.
std::vector<std::string> txt2img_args(const std::string& model, const std::string& sampler, int steps, int64_t seed,
                                      double cfg, int w, int h, const std::string& png, const std::string& latents) {
    std::ostringstream cfg_s;
    cfg_s << cfg;
    return {"-m",
            model,
            "--sampler",
            sampler,
            "--steps",
            std::to_string(steps),
            "-s",
            std::to_string(seed),
            "--cfg-scale",
            cfg_s.str(),
            "-W",
            std::to_string(w),
            "-H",
            std::to_string(h),
            "-o",
            png,
            "--save-latents",
            latents,
            "--threads",
            "1"};
}

// Runs anchor-sd like the golden pipeline_tiny case (16x16, CFG 7.5, seed 42, 10 steps) and compares.
void check_golden_run(const std::string& model, const std::string& sampler, const std::string& run) {
    const auto dir = test::scratch_dir("cli_sd_" + run + "_" + fs::path(model).stem().string());
    const std::string png = dir + "/out.png", lat = dir + "/latents.safetensors";
    auto args = txt2img_args(model, sampler, 10, 42, 7.5, 16, 16, png, lat);
    args.insert(args.end(), {"-p", kGoldenPrompt});
    auto r = test::run_program(test::sd_bin(), args);
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    REQUIRE(fs::exists(png));
    REQUIRE(fs::exists(png + ".json"));
    auto ours_f = SafeTensorsFile::open(lat),
         golden_f = SafeTensorsFile::open(test::golden("sd/pipeline_tiny/" + run + ".safetensors"));
    auto& ours = *ours_f;
    auto& golden = *golden_f;
    // Seed parity: torch.Generator('cpu').manual_seed(42) noise, bit for bit.
    CHECK(torch::equal(ours.tensor("initial_noise"), golden.tensor("initial_noise")));
    const auto fl = ours.tensor("final_latents").to(torch::kFloat64),
               gl = golden.tensor("final_latents").to(torch::kFloat64);
    const double lat_err = (fl - gl).abs().max().item<double>(), lat_max = gl.abs().max().item<double>();
    INFO(run << " final latents max|a-b| " << lat_err << " (golden max " << lat_max << ")");
    CHECK(lat_err <= 5e-2 * lat_max);
    const double img_err = test::max_abs_diff(ours.tensor("image"), golden.tensor("image"));
    INFO(run << " image max|a-b| " << img_err);
    CHECK(img_err <= 5e-2);
}

} // namespace

TEST_CASE("anchor-sd reproduces the golden DDIM and Euler runs from the diffusers folder", "[cli][sd]") {
    check_golden_run("assets/models/sd15-tiny-random", "ddim", "ddim10");
    check_golden_run("assets/models/sd15-tiny-random", "euler", "euler10");
}

TEST_CASE("anchor-sd reproduces the golden DDIM and Euler runs from the single-file checkpoint", "[cli][sd]") {
    const auto ckpt = test::golden("sd/sd15_tiny_single_file/sd15_tiny_single_file.safetensors");
    check_golden_run(ckpt, "ddim", "ddim10");
    check_golden_run(ckpt, "euler", "euler10");
}

TEST_CASE("anchor-sd defaults to the model's own image size", "[cli][sd]") {
    const auto dir = test::scratch_dir("cli_sd_default_size");
    auto r = test::run_program(test::sd_bin(), {"-m", "assets/models/sd15-tiny-random", "-p", "a cat", "--steps", "2",
                                                "-o", dir + "/a.png", "--threads", "1"});
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    std::ifstream f(dir + "/a.png.json");
    const std::string json((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    // UNet sample_size 8 x VAE factor 2, the golden runs' size.
    CHECK(json.find("\"width\": 16") != std::string::npos);
    CHECK(json.find("\"height\": 16") != std::string::npos);
}

TEST_CASE("anchor-sd --vae, --weights-dtype and --prediction are recorded in the sidecar (with --free-params)",
          "[cli][sd][sd_load]") {
    const auto dir = test::scratch_dir("cli_sd_load_options");
    const std::string vae = "assets/models/sd15-tiny-random/vae/diffusion_pytorch_model.safetensors";
    auto r = test::run_program(test::sd_bin(), {"-m", "assets/models/sd15-tiny-random", "-p", "a cat", "--steps", "2",
                                                "--vae", vae, "--weights-dtype", "f16", "--prediction", "eps",
                                                "--free-params", "-o", dir + "/a.png", "--threads", "1"});
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    std::ifstream f(dir + "/a.png.json");
    const auto j = nlohmann::json::parse(f);
    CHECK(j["vae"] == vae);
    CHECK(j["weights_dtype"] == "f16");
    CHECK(j["prediction"]["type"] == "epsilon");
    CHECK(j["prediction"]["source"] == "option");
    CHECK(j["prediction"]["v_test_mean"].is_null()); // a diffusers folder: no test
}

TEST_CASE("anchor-sd --compare on an image smaller than SSIM's window prints no SSIM and records null", "[cli][sd]") {
    const auto dir = test::scratch_dir("cli_sd_compare_tiny_image");
    const std::string png = dir + "/tiny.png";
    auto r = test::run_program(test::sd_bin(),
                               {"-m", "assets/models/sd15-tiny-random", "-p", "a cat", "--steps", "4", "-W", "8", "-H",
                                "8", "--compare", "off,deepcache:2,freq", "-o", png, "--threads", "1"});
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    CHECK(fs::exists(png));
    std::ifstream f(dir + "/tiny_report.json");
    const auto rep = nlohmann::json::parse(f);
    REQUIRE(rep["modes"].size() == 3);
    for (const auto& m : rep["modes"]) CHECK(m["ssim_vs_first"].is_null());
}

TEST_CASE("anchor-sd eval-plot redraws the speed-quality plots of a saved report, and keeps them without --overwrite",
          "[cli][sd][eval]") {
    const auto dir = test::scratch_dir("cli_sd_eval_plot");
    auto mode = [](const std::string& name, double speed, nlohmann::json mean, nlohmann::json min) {
        return nlohmann::json{{"mode", name}, {"speedup_vs_first", speed}, {"psnr_db", mean}, {"psnr_min_db", min}};
    };
    nlohmann::json rep{{"samplers", {"ddim"}}, {"cells", nlohmann::json::array()}};
    for (int steps : {10, 20})
        rep["cells"].push_back({{"sampler", "ddim"},
                                {"steps", steps},
                                {"modes",
                                 {mode("off", 1.0, "inf", "inf"), mode("deepcache:2", 1.7, 38.0, 25.0),
                                  mode("deepcache:3", 2.1, 33.0, 24.0), mode("deepcache:2,branch=1", 1.4, 35.0, 22.0),
                                  mode("freq", 2.6, 36.0, 26.0), mode("freq:thr=2", 3.1, 33.0, 23.0)}}});
    const std::string report = dir + "/cache_eval.json";
    std::ofstream(report) << rep.dump();
    auto r = test::run_program(test::sd_bin(), {"eval-plot", report});
    INFO(r.output);
    if (r.output.find("needs OpenCV") != std::string::npos) return; // a build without OpenCV draws no plot
    REQUIRE(r.exit_code == 0);
    for (const char* png : {"/speed_quality_ddim.png", "/speed_quality_ddim_min.png"}) {
        REQUIRE(fs::exists(dir + png));
        std::ifstream f(dir + png, std::ios::binary);
        std::string head(8, '\0');
        f.read(head.data(), 8);
        CHECK(head == "\x89PNG\r\n\x1a\n");
    }
    const auto size = fs::file_size(dir + "/speed_quality_ddim.png");
    std::ofstream(dir + "/speed_quality_ddim.png", std::ios::trunc) << "user data";
    r = test::run_program(test::sd_bin(), {"eval-plot", report});
    CHECK(r.exit_code == 2);
    CHECK(r.output.find("--overwrite") != std::string::npos);
    CHECK(fs::file_size(dir + "/speed_quality_ddim.png") == 9);
    r = test::run_program(test::sd_bin(), {"eval-plot", report, "--overwrite"});
    CHECK(r.exit_code == 0);
    CHECK(fs::file_size(dir + "/speed_quality_ddim.png") == size);
}

TEST_CASE("anchor-sd refuses to overwrite an existing output and leaves it intact", "[cli][sd]") {
    const auto dir = test::scratch_dir("cli_sd_no_overwrite");
    const std::string png = dir + "/keep.png";
    std::ofstream(png) << "user data";
    auto r = test::run_program(test::sd_bin(), {"-m", "assets/models/sd15-tiny-random", "-p", "a cat", "--steps", "1",
                                                "-W", "16", "-H", "16", "-o", png, "--threads", "1"});
    INFO(r.output);
    CHECK(r.exit_code == 2);
    CHECK(r.output.find("--overwrite") != std::string::npos);
    std::ifstream f(png);
    std::string content;
    std::getline(f, content);
    CHECK(content == "user data");
}

TEST_CASE("anchor-sd --batch-size runs a batch of prompts as diffusers does, one PNG and sidecar per image",
          "[cli][sd]") {
    // tests/golden/sd/anchorcache_cases/pipeline_batch: two prompts in one batch, DDIM 8 steps, seed 1234, 24x16.
    const auto dir = test::scratch_dir("cli_sd_batch");
    const std::string prompts = dir + "/prompts.txt";
    std::ofstream(prompts) << "a red fox in the snow\nan old lighthouse at dusk, oil painting\n";
    const std::string png = dir + "/out.png", lat = dir + "/lat.safetensors";
    auto args = txt2img_args(test::golden("sd/sd15_tiny_single_file/sd15_tiny_single_file.safetensors"), "ddim", 8,
                             1234, 6, 24, 16, png, lat);
    args.insert(args.end(), {"--prompts-file", prompts, "--batch-size", "2"});
    auto r = test::run_program(test::sd_bin(), args);
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    auto golden = SafeTensorsFile::open(test::golden("sd/anchorcache_cases/pipeline_batch/ddim8.safetensors"));
    for (int i = 0; i < 2; ++i) {
        const std::string p = i ? dir + "/out_1.png" : png, l = i ? dir + "/lat_1.safetensors" : lat;
        REQUIRE(fs::exists(p));
        REQUIRE(fs::exists(p + ".json"));
        auto ours = SafeTensorsFile::open(l);
        CHECK(torch::equal(ours->tensor("initial_noise"), golden->tensor("initial_noise").narrow(0, i, 1)));
        const auto gl = golden->tensor("final_latents").narrow(0, i, 1);
        CHECK(test::max_abs_diff(ours->tensor("final_latents"), gl) <= 5e-2 * gl.abs().max().item<double>());
        std::ifstream js(p + ".json");
        const auto j = nlohmann::json::parse(js);
        CHECK(j["batch_size"] == 2);
        CHECK(j["index_in_batch"] == i);
        CHECK(j["seed"] == 1234);
        CHECK(j["prompt"] == (i ? "an old lighthouse at dusk, oil painting" : "a red fox in the snow"));
    }
}

TEST_CASE("anchor-sd --schedule and --eta run on the tiny model and are recorded in the sidecar",
          "[cli][sd][schedulers]") {
    const auto dir = test::scratch_dir("cli_sd_schedule");
    struct Run {
        std::vector<std::string> args;
        std::string schedule;
        nlohmann::json eta;
    };
    const std::vector<Run> runs = {
        {{"--sampler", "euler_a", "--schedule", "karras"}, "karras", 1.0},
        {{"--sampler", "euler_a", "--schedule", "sgm_uniform", "--eta", "0.5"}, "sgm_uniform", 0.5},
        {{"--sampler", "ddim", "--schedule", "exponential"}, "exponential", 0.0},
        {{"--sampler", "dpmpp_2m_karras"}, "karras", nullptr},
        {{"--sampler", "euler"}, "default", nullptr},
        {{"--sampler", "dpmpp_2m_sde", "--schedule", "karras"}, "karras", nullptr},
        {{"--sampler", "dpmpp_2s"}, "default", nullptr},
        {{"--sampler", "unipc", "--schedule", "exponential"}, "exponential", nullptr},
        {{"--sampler", "deis"}, "default", nullptr},
    };
    int k = 0;
    for (const auto& run : runs) {
        const std::string png = dir + "/s" + std::to_string(k++) + ".png";
        std::vector<std::string> args = {
            "-m", "assets/models/sd15-tiny-random", "-p", "a cat", "--steps", "3", "-o", png, "--threads", "1"};
        args.insert(args.end(), run.args.begin(), run.args.end());
        auto r = test::run_program(test::sd_bin(), args);
        INFO(r.output);
        REQUIRE(r.exit_code == 0);
        std::ifstream f(png + ".json");
        const auto rec = nlohmann::json::parse(f);
        CHECK(rec["schedule"] == run.schedule);
        CHECK(rec["eta"] == run.eta);
    }
    // The schedule changes the image: karras and default Euler a from the same seed differ.
    auto a =
        test::run_program(test::sd_bin(), {"-m", "assets/models/sd15-tiny-random", "-p", "a cat", "--steps", "3", "-o",
                                           dir + "/d.png", "--threads", "1", "--save-latents", dir + "/d.safetensors"});
    auto b = test::run_program(test::sd_bin(), {"-m", "assets/models/sd15-tiny-random", "-p", "a cat", "--steps", "3",
                                                "-o", dir + "/k.png", "--threads", "1", "--schedule", "karras",
                                                "--save-latents", dir + "/k.safetensors"});
    REQUIRE(a.exit_code == 0);
    REQUIRE(b.exit_code == 0);
    auto fa = SafeTensorsFile::open(dir + "/d.safetensors"), fb = SafeTensorsFile::open(dir + "/k.safetensors");
    CHECK(torch::equal(fa->tensor("initial_noise"), fb->tensor("initial_noise")));
    CHECK_FALSE(torch::equal(fa->tensor("final_latents"), fb->tensor("final_latents")));
    // --help lists the schedules from the table.
    auto h = test::run_program(test::sd_bin(), {"--help"});
    CHECK(h.output.find("--schedule") != std::string::npos);
    CHECK(h.output.find("default|karras|exponential|sgm_uniform|simple") != std::string::npos);
}

TEST_CASE("anchor-text gpt2 generate defaults to the embedded kjv-gpt2 and takes -s as --seed", "[cli][text]") {
    // The text before the statistics line (timings vary between runs).
    auto text_of = [](const test::ProgramResult& r) { return r.output.substr(0, r.output.find("\nprompt: ")); };
    const std::vector<std::string> common = {"gpt2", "generate",      "-p", "And God said", "--max-new",
                                             "8",    "--temperature", "0.8"};
    auto with = [&](std::vector<std::string> more) {
        auto a = common;
        a.insert(a.end(), more.begin(), more.end());
        return test::run_program(test::text_bin(), a);
    };
    const auto by_default = with({"-s", "3"});
    const auto named = with({"-m", "assets/models/kjv-gpt2", "--seed", "3"});
    INFO(by_default.output);
    INFO(named.output);
    REQUIRE(by_default.exit_code == 0);
    REQUIRE(named.exit_code == 0);
    CHECK(text_of(by_default).rfind("And God said", 0) == 0);
    CHECK(text_of(by_default) == text_of(named));
}
