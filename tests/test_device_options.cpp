// --device and --dtype at the programs' edge, on whatever this build is: a build without CUDA (Debian's LibTorch 1.13)
// or a CUDA build on a machine without a GPU refuses --device cuda with a usage error (exit 2) that says which; the
// default compute dtype is f32 on the CPU and recorded as such.
#include "tests/test_cli_util.h"
#include "tests/test_util.h"

#include <catch2/catch.hpp>

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <string>

using namespace anchor::test;

namespace {

// What a refused --device cuda says in this build: no CUDA at all, or no device.
std::string expected_cuda_refusal() {
#if defined(ANCHOR_WITH_CUDA)
    return "sees no CUDA device";
#else
    return "this build has no CUDA";
#endif
}

} // namespace

TEST_CASE("anchor-sd --device cuda without a usable GPU is a usage error naming the build", "[cli][errors][device]") {
    if (torch::cuda::is_available()) {
        WARN("a GPU is present: the refusal is not exercised here");
        return;
    }
    const auto out = scratch_dir("device_options");
    const std::string png = out + "/x.png", m = "assets/models/sd15-tiny-random";
    for (const auto& args : std::vector<std::vector<std::string>>{
             {"-m", m, "-p", "a", "--steps", "2", "--device", "cuda", "-o", png},
             {"-m", m, "-p", "a", "--steps", "2", "--device", "cuda:1", "-o", png},
             {"bench-cache", "--device", "cuda", "--steps", "2"}}) {
        const auto r = run_program(sd_bin(), args);
        INFO(r.output);
        CHECK(r.exit_code == 2);
        CHECK(r.output.find("error: --device") != std::string::npos);
        CHECK(r.output.find(expected_cuda_refusal()) != std::string::npos);
        CHECK(!std::filesystem::exists(png));
    }
}

TEST_CASE("anchor-sd --dtype auto is f32 on the CPU, f16 is refused there, the sidecar records the dtype in effect",
          "[cli][device]") {
    const auto out = scratch_dir("dtype_options");
    const std::string png = out + "/x.png", m = "assets/models/sd15-tiny-random";
    auto r = run_program(sd_bin(), {"-m", m, "-p", "a", "--steps", "2", "-W", "16", "-H", "16", "-s", "1", "-o", png});
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    CHECK(nlohmann::json::parse(read_bytes(png + ".json")).at("dtype") == "f32");
    r = run_program(sd_bin(),
                    {"-m", m, "-p", "a", "--steps", "2", "-W", "16", "-H", "16", "--dtype", "f16", "-o", out + "/y.png"});
    CHECK(r.exit_code == 2);
    CHECK(r.output.find("--dtype f16 is not available on the CPU") != std::string::npos);
    r = run_program(sd_bin(), {"-m", m, "-p", "a", "--dtype", "f64", "-o", out + "/y.png"});
    CHECK(r.exit_code == 2);
    CHECK(r.output.find("auto, f32, f16 or bf16") != std::string::npos);
}

TEST_CASE("anchor-sd's CUDA-only switches on the CPU are usage errors naming the option", "[cli][errors][device]") {
    const auto out = scratch_dir("device_switches");
    const std::string png = out + "/x.png", m = "assets/models/sd15-tiny-random";
    for (const std::string opt : {"--channels-last", "--cudnn-benchmark", "--cuda-graphs"}) {
        const auto r = run_program(sd_bin(), {"-m", m, "-p", "a", "--steps", "2", opt, "-o", png});
        INFO(r.output);
        CHECK(r.exit_code == 2);
        CHECK(r.output.find("error: " + opt) != std::string::npos);
        CHECK(r.output.find("CUDA") != std::string::npos);
        CHECK(!std::filesystem::exists(png));
    }
}
