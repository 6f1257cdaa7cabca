// txt2img loop and DeepCache against tests/golden/sd/pipeline_tiny and tests/golden/sd/deepcache: teacher-forced
// steps (model input, guided eps, latents 1e-4; noise_pred 5e-3), seed parity of the initial latents, and the
// free-running loop (final latents within 5e-2 * max, image atol 5e-2).
#include "tests/sd_pipeline_golden.h"
#include "tests/test_util.h"

#include <catch2/catch.hpp>

using namespace anchor;

namespace {

void run_case(const std::string& folder, const std::string& run) {
    const std::filesystem::path dir = test::golden("sd/" + folder);
    auto cfg = sdgolden::read_json_file(dir / "config.json");
    auto models = sdgolden::load_run_models(dir, cfg);
    auto scratch = test::scratch_dir("sd_pipeline_" + run);
    double worst_tf = 0;
    for (const auto& c : sdgolden::compare_run(models, dir, cfg, run, scratch)) {
        INFO(run << " " << c.what << " actual " << c.actual.sizes() << " golden " << c.golden.sizes());
        REQUIRE(c.actual.sizes() == c.golden.sizes());
        auto a = c.actual.to(torch::kFloat64), g = c.golden.to(torch::kFloat64);
        const double err = (a - g).abs().max().item<double>();
        INFO("max abs error " << err);
        switch (c.kind) {
        case sdgolden::Comparison::Exact:
            CHECK(torch::equal(a, g));
            break;
        case sdgolden::Comparison::RelMax:
            CHECK(err <= c.atol * g.abs().max().item<double>());
            break;
        case sdgolden::Comparison::Close:
            CHECK(((a - g).abs() <= c.atol + c.rtol * g.abs()).all().item<bool>());
            if (c.what.rfind("step.", 0) == 0 && c.what.find("noise_pred") == std::string::npos)
                worst_tf = std::max(worst_tf, err);
            break;
        }
        if (c.what.rfind("free-running", 0) == 0) WARN(run << " " << c.what << ": max abs error " << err);
    }
    WARN(run << ": worst teacher-forced model_input/guided/latents error " << worst_tf);
}

} // namespace

TEST_CASE("txt2img DDIM 10 steps matches the golden run", "[sd][pipeline]") { run_case("pipeline_tiny", "ddim10"); }
TEST_CASE("txt2img Euler 10 steps matches the golden run", "[sd][pipeline]") { run_case("pipeline_tiny", "euler10"); }
TEST_CASE("DeepCache interval 3 matches the golden run", "[sd][deepcache]") { run_case("deepcache", "ddim10_interval3"); }
TEST_CASE("DeepCache interval 2 matches the golden run", "[sd][deepcache]") { run_case("deepcache", "ddim10_interval2"); }
