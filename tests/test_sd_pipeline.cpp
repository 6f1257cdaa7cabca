// txt2img loop and DeepCache against tests/golden/sd/pipeline_tiny and tests/golden/sd/deepcache: teacher-forced
// steps (model input, guided eps, latents 1e-4; noise_pred 5e-3), seed parity of the initial latents, and the
// free-running loop (final latents within 5e-2 * max, image atol 5e-2).
#include "tests/sd_golden_checks.h"
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
        const double err = sdgolden::check_comparison(run, c);
        if (c.kind == sdgolden::Comparison::Close && c.what.rfind("step.", 0) == 0 &&
            c.what.find("noise_pred") == std::string::npos)
            worst_tf = std::max(worst_tf, err);
        if (c.what.rfind("free-running", 0) == 0) WARN(run << " " << c.what << ": max abs error " << err);
    }
    WARN(run << ": worst teacher-forced model_input/guided/latents error " << worst_tf);
}

} // namespace

TEST_CASE("txt2img DDIM 10 steps matches the golden run", "[sd][pipeline]") {
    run_case("pipeline_tiny", "ddim10");
}
TEST_CASE("txt2img Euler 10 steps matches the golden run", "[sd][pipeline]") {
    run_case("pipeline_tiny", "euler10");
}
TEST_CASE("DeepCache interval 3 matches the golden run", "[sd][deepcache]") {
    run_case("deepcache", "ddim10_interval3");
}
TEST_CASE("DeepCache interval 2 matches the golden run", "[sd][deepcache]") {
    run_case("deepcache", "ddim10_interval2");
}

// A batch of prompts in one run, as diffusers' prompt=[p1, p2]: one generator draws latents [B, 4, h, w], the CFG
// batch has 2B rows, the negative prompt is every prompt's (tests/golden/sd/anchorcache_cases/README.md).
TEST_CASE("txt2img with a batch of 2 prompts matches diffusers (DDIM, Euler ancestral)", "[sd][pipeline][batch]") {
    run_case("anchorcache_cases/pipeline_batch", "ddim8");
    run_case("anchorcache_cases/pipeline_batch", "euler_a6");
}
TEST_CASE("txt2img with 3 prompts and a negative prompt matches diffusers (DPM++ 2M, Euler)", "[sd][pipeline][batch]") {
    run_case("anchorcache_cases/pipeline_batch3", "dpm7");
    run_case("anchorcache_cases/pipeline_batch3", "euler9");
}
TEST_CASE("DeepCache on a batch of 2 prompts matches diffusers", "[sd][deepcache][batch]") {
    run_case("anchorcache_cases/deepcache_batch", "ddim8_interval3");
}

TEST_CASE("a case parameter the checker does not understand fails the case, naming it", "[sd][pipeline]") {
    const std::filesystem::path dir = test::golden("sd/anchorcache_cases/pipeline_batch");
    auto cfg = sdgolden::read_json_file(dir / "config.json");
    CHECK_NOTHROW(sdgolden::read_run_spec(dir, cfg, "ddim8", 2));
    auto bad = cfg;
    bad["runs"]["ddim8"]["guidance_rescale"] = 0.7;
    CHECK_THROWS_WITH(sdgolden::read_run_spec(dir, bad, "ddim8", 2), Catch::Contains("guidance_rescale"));
    bad = cfg;
    bad["strength"] = 0.5;
    CHECK_THROWS_WITH(sdgolden::read_run_spec(dir, bad, "ddim8", 2), Catch::Contains("'strength'"));
    bad = cfg;
    bad.erase("seed");
    CHECK_THROWS_WITH(sdgolden::read_run_spec(dir, bad, "ddim8", 2), Catch::Contains("'seed'"));
    bad = cfg;
    bad["generator"] = "torch.Generator('cpu').manual_seed(99)";
    CHECK_THROWS_WITH(sdgolden::read_run_spec(dir, bad, "ddim8", 2), Catch::Contains("seeds 99"));
    // per-run keys override the top level
    bad = cfg;
    bad["runs"]["ddim8"]["seed"] = 5;
    bad["runs"]["ddim8"]["generator"] = "torch.Generator('cpu').manual_seed(5)";
    CHECK(sdgolden::read_run_spec(dir, bad, "ddim8", 2).params.seed == 5);
}

TEST_CASE("batches of a job: batch size, batch count and prompts files", "[sd][pipeline][batch]") {
    using unet::plan_batches;
    // one prompt: batch_size images of it per batch, batch k with seed + k
    auto j = plan_batches({"a"}, 3, 2, 10);
    REQUIRE(j.size() == 2);
    CHECK(j[0].images_per_prompt == 3);
    CHECK(j[0].seed == 10);
    CHECK(j[1].seed == 11);
    CHECK(j[1].first_image == 3);
    // a prompts file: groups of batch_size prompts, one image each, the last group shorter
    j = plan_batches({"a", "b", "c", "d", "e"}, 2, 1, 7);
    REQUIRE(j.size() == 3);
    CHECK(j[0].prompts == std::vector<std::string>{"a", "b"});
    CHECK(j[2].prompts == std::vector<std::string>{"e"});
    CHECK(j[2].first_image == 4);
    CHECK(j[0].seed == 7); // batch j with seed + j: the prompts of a file do not share their noise
    CHECK(j[1].seed == 8);
    CHECK(j[2].seed == 9);
    CHECK_THROWS_WITH(plan_batches({"a"}, 0, 1, 0), Catch::Contains("batch_size"));
    CHECK_THROWS_WITH(plan_batches({"a"}, 1, 0, 0), Catch::Contains("batch_count"));
}
