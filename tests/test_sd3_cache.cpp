// The cache modes on SD 3's transformer (unet/cache/dit_cache.h): their decision rules on hand-computed numbers, the
// modes' keys, and on the tiny SD 3 pipeline (tests/golden/sd/sd3_tiny_text): each mode with its threshold at 0 (or
// interval 1) is the uncached run bit for bit, and the defaults run with reuse steps.
#include "cache/dit_cache_rules.h"
#include "cache/io/error.h"
#include "tests/test_util.h"
#include "unet/cache/dit_cache.h"
#include "unet/cache/dit_cache_config.h"
#include "unet/pipeline/sd3_compare.h"
#include "unet/pipeline/sd3_pipeline.h"
#include "unet/train/fashion_eval.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cmath>

using namespace anchor;
using namespace anchor::unet;
using cache::Action;

TEST_CASE("fbcache rule: reuse below thr, the count bound, warm-up, thr 0 never reuses", "[sd3][dit_cache]") {
    cache::FirstBlockRule r(0.1, -1, 0);
    CHECK(r.decide(0, std::nan("")).why == std::string("first"));
    CHECK(r.decide(1, 0.05).action == Action::Reuse);
    CHECK(r.decide(2, 0.0999).action == Action::Reuse);
    auto d = r.decide(3, 0.1); // not below thr
    CHECK(d.action == Action::Full);
    CHECK(d.why == std::string("change"));
    CHECK(r.decide(4, std::nan("")).action == Action::Full); // no reference: full

    cache::FirstBlockRule bounded(0.1, 1, 2);
    CHECK(bounded.decide(0, 0).why == std::string("first"));
    CHECK(bounded.decide(1, 0).why == std::string("warmup"));
    CHECK(bounded.decide(2, 0.01).action == Action::Reuse);
    CHECK(bounded.decide(3, 0.01).why == std::string("count"));
    CHECK(bounded.decide(4, 0.01).action == Action::Reuse);

    cache::FirstBlockRule never(0.0, -1, 0);
    for (int k = 0; k < 5; ++k) CHECK(never.decide(k, 0.0).action == Action::Full);
    CHECK_THROWS_AS(cache::FirstBlockRule(-0.1, -1, 0), UsageError);
}

TEST_CASE("teacache rule: the rescaled change accumulates to thr, first and last full, the clamp at 0",
          "[sd3][dit_cache]") {
    // p(x) = 10 x: 0.03 -> 0.3, 0.05 -> 0.5 (sum 0.8 < 1), 0.03 -> 0.3 (sum 1.1 >= 1: full, restart).
    cache::TeaCacheRule r(1.0, {10.0, 0.0});
    CHECK(r.decide(0, 6, 0.0).why == std::string("first"));
    CHECK(r.decide(1, 6, 0.03).action == Action::Reuse);
    CHECK(r.accumulated() == Approx(0.3));
    CHECK(r.decide(2, 6, 0.05).action == Action::Reuse);
    CHECK(r.accumulated() == Approx(0.8));
    auto d = r.decide(3, 6, 0.03);
    CHECK(d.action == Action::Full);
    CHECK(d.why == std::string("change"));
    CHECK(r.accumulated() == 0.0);
    CHECK(r.decide(4, 6, 0.01).action == Action::Reuse);
    CHECK(r.decide(5, 6, 0.0).why == std::string("last"));
    // TeaCache's FLUX polynomial at x = 0.1: 498.651651e-4 - 283.781631e-3 + 55.8554382e-2 - 3.82021401e-1
    // + 0.264230861 = 0.2068473761.
    cache::TeaCacheRule flux(0.4, TeaCacheParams{}.coefficients);
    CHECK(flux.rescaled(0.1) == Approx(0.2068473761).epsilon(1e-9));
    // p(x) = x - 1 is negative below 1: clamped to 0, so the sum never falls.
    CHECK(cache::TeaCacheRule(1.0, {1.0, -1.0}).rescaled(0.5) == 0.0);
    cache::TeaCacheRule never(0.0, {1.0, -1.0});
    for (int k = 0; k < 4; ++k) CHECK(never.decide(k, 4, 0.5).action == Action::Full);
}

TEST_CASE("taylorseer rule: warm-up then every interval; Taylor weights and finite differences by hand",
          "[sd3][dit_cache]") {
    cache::TaylorSeerRule r(3, 2);
    const char* want[] = {"first", "warmup", "interval", "", "", "interval", ""};
    for (int k = 0; k < 7; ++k) {
        INFO(k);
        CHECK(r.decide(k).why == std::string(want[k]));
        CHECK((r.decide(k).action == Action::Full) == (want[k][0] != 0));
    }
    for (int k = 0; k < 5; ++k) CHECK(cache::TaylorSeerRule(1, 0).decide(k).action == Action::Full);
    CHECK(cache::TaylorSeerRule::weights(2, 3) == std::vector<double>{1, 2, 2});
    CHECK(cache::TaylorSeerRule::weights(-0.5, 3) == std::vector<double>{1, -0.5, 0.125});
    // f(s) = s^2 computed at steps 0, 2, 4: d0 = 16, d1 = (16 - 4) / 2 = 6, d2 = (6 - 2) / 2 = 2; at step 5 the
    // series gives 16 + 6 + 2 / 2 = 23 (backward differences; the true value is 25).
    auto f = [](double s) { return torch::full({1}, s * s, torch::kDouble); };
    auto d = DitCacheController::taylor_update(f(0), {}, 1, 2);
    CHECK(d.size() == 1);
    d = DitCacheController::taylor_update(f(2), d, 2, 2);
    REQUIRE(d.size() == 2);
    CHECK(d[1].item<double>() == 2.0);
    d = DitCacheController::taylor_update(f(4), d, 2, 2);
    REQUIRE(d.size() == 3);
    CHECK(d[1].item<double>() == 6.0);
    CHECK(d[2].item<double>() == 2.0);
    CHECK(DitCacheController::taylor_forecast(d, 1).item<double>() == 23.0);
    CHECK(DitCacheController::taylor_update(f(4), d, 2, 1).size() == 2); // order 1 keeps one derivative
    CHECK(DitCacheController::relative_l1(torch::tensor({1.0, 2.0}), torch::tensor({1.0, 1.0})) == 0.5);
}

TEST_CASE("DiT cache modes: keys, canonical strings, errors, which modes apply to which model", "[sd3][dit_cache]") {
    CHECK(parse_cache_config("fbcache").canonical() == "fbcache:thr=0.08,max=none,warmup=0");
    CHECK(parse_cache_config("teacache:thr=0.25").canonical() == "teacache:thr=0.25");
    CHECK(parse_cache_config("teacache:coef=2/1").params_json()["coef"] == nlohmann::json({2.0, 1.0}));
    CHECK(parse_cache_config("taylorseer:interval=1").canonical() == "taylorseer:interval=1,order=2,warmup=2");
    CHECK(parse_cache_config("taylorseer").kind() == CacheKind::TaylorSeer);
    for (const char* bad : {"fbcache:thr=-1", "teacache:coef=1/x", "taylorseer:interval=0", "taylorseer:order=3",
                            "fbcache:band=2"}) {
        INFO(bad);
        CHECK_THROWS_AS(parse_cache_config(bad), ParamError);
    }
    CHECK_NOTHROW(check_dit_cache_config(parse_cache_config("freq:fast,thr=0.5,order=2")));
    CHECK_NOTHROW(check_dit_cache_config(parse_cache_config("off")));
    try {
        check_dit_cache_config(parse_cache_config("freq:noise=0.5,attn=run"), "compare");
        FAIL("accepted");
    } catch (const ParamError& e) {
        CHECK(e.field() == "compare");
        CHECK_THAT(e.what(), Catch::Contains("noise=0.5, attn=run"));
    }
    CHECK_NOTHROW(check_dit_cache_config(parse_cache_config("freq:skip=2,skipdrift=0")));
    CHECK_THROWS_WITH(check_dit_cache_config(parse_cache_config("deepcache:3")),
                      Catch::Contains("does not apply to SD 3 / 3.5"));
    CHECK_THROWS_WITH(make_cache_controller(parse_cache_config("teacache")),
                      Catch::Contains("applies to SD 3 / 3.5 (MMDiT) models only"));
    CHECK_THAT(cache_help(), Catch::Contains("taylorseer keys"));
}

TEST_CASE("freq's skip steps on the transformer: how many steps after a probe run no block, by hand",
          "[sd3][dit_cache]") {
    cache::DitSkipSignals s;
    s.step = 5, s.num_steps = 28, s.accumulated = 0.02, s.rate = 0.03, s.drift = 0.1, s.reuse_run = 1;
    // 0.02 + 0.03 = 0.05 and 0.02 + 2 x 0.03 = 0.08 stay below 0.1: both; skip=1 bounds it at one.
    CHECK(cache::dit_skip_steps(2, 0.1, 0.35, -1, s) == 2);
    CHECK(cache::dit_skip_steps(1, 0.1, 0.35, -1, s) == 1);
    CHECK(cache::dit_skip_steps(0, 0.1, 0.35, -1, s) == 0);
    CHECK(cache::dit_skip_steps(2, 0.0, 0.35, -1, s) == 0); // thr 0: every step full, none skipped
    CHECK(cache::dit_skip_steps(2, 0.1, 0.35, 2, s) == 1);  // run 1 + 1 = 2 <= max 2; 1 + 2 = 3 is not
    s.rate = 0.04;                                          // 0.06 < 0.1, 0.10 is not below it
    CHECK(cache::dit_skip_steps(2, 0.1, 0.35, -1, s) == 1);
    s.accumulated = 0.07; // 0.11: none
    CHECK(cache::dit_skip_steps(2, 0.1, 0.35, -1, s) == 0);
    s.accumulated = 0.02, s.rate = 0.03;
    s.drift = 0.35; // not below skipdrift
    CHECK(cache::dit_skip_steps(2, 0.1, 0.35, -1, s) == 0);
    s.drift = std::nan(""); // not measured: none, unless skipdrift=0
    CHECK(cache::dit_skip_steps(2, 0.1, 0.35, -1, s) == 0);
    CHECK(cache::dit_skip_steps(2, 0.1, 0.0, -1, s) == 2);
    s.drift = 0.1;
    s.step = 25; // 26 may be skipped, 27 is the last step
    CHECK(cache::dit_skip_steps(2, 0.1, 0.35, -1, s) == 1);
    s.step = 26;
    CHECK(cache::dit_skip_steps(2, 0.1, 0.35, -1, s) == 0);
    // The skip step's output: the line through (u0, o0) = (900, 1) and (u1, o1) = (800, 3) at u = 750 is 4.
    CHECK(DitCacheController::linear_output_forecast(torch::tensor({3.0}), torch::tensor({1.0}), 800, 900, 750)
              .item<double>() == 4.0);
}

TEST_CASE("freq takes the transformer's defaults for the keys it does not name; the UNet's stay",
          "[sd3][dit_cache]") {
    const FreqParams unet, dit = dit_freq_defaults();
    CHECK(unet.thr == 0.7); // the UNet default is not changed by the transformer's
    CHECK(dit.thr != unet.thr);
    auto freq_of = [](const CacheConfig& c) { return std::get<FreqParams>(c.params); };
    CHECK(freq_of(parse_cache_config("freq")).thr == 0.7); // the parser is the UNet's
    const auto d = freq_of(resolve_dit_cache_config(parse_cache_config("freq")));
    CHECK(d.thr == dit.thr);
    CHECK(d.skip == dit.skip);
    CHECK(resolve_dit_cache_config(parse_cache_config("freq")).label == "freq");
    const auto named = freq_of(resolve_dit_cache_config(parse_cache_config("freq:thr=0.3,skip=0")));
    CHECK(named.thr == 0.3);
    CHECK(named.skip == 0);
    CHECK(named.skip_drift == dit.skip_drift);
    const auto preset = freq_of(resolve_dit_cache_config(parse_cache_config("freq:fast,order=2")));
    CHECK(preset.drift == 0.4); // the preset's key, then the list's, over the transformer's defaults
    CHECK(preset.order == 2);
    CHECK(preset.thr == dit.thr);
    // Built in code (its label does not parse back to it): runs as given.
    CacheConfig coded = parse_cache_config("freq");
    std::get<FreqParams>(coded.params).thr = 0.5;
    CHECK(freq_of(resolve_dit_cache_config(coded)).thr == 0.5);
    CHECK(resolve_dit_cache_config(parse_cache_config("fbcache")).canonical() == parse_cache_config("fbcache").canonical());
    CHECK_THAT(dit_freq_default_keys(), Catch::Contains("thr="));
    CHECK_THAT(cache_help(), Catch::Contains("freq on SD 3 / 3.5 (MMDiT)"));
}

namespace {

SD3Models& sd3_cache_tiny_models() {
    static SD3Models m = load_sd3_models(test::golden("sd/sd3_tiny_text"));
    return m;
}

SD3Txt2ImgResult sd3_cache_tiny_run(const std::string& mode, int steps = 10) {
    const auto j = nlohmann::json::parse(test::read_bytes(test::golden("sd/sd3_tiny_text/golden.json")));
    SD3Txt2ImgParams p;
    p.prompts = {j["prompts"][0].get<std::string>()};
    p.negative_prompts = {j["negative_prompt"].get<std::string>()};
    p.steps = steps;
    p.guidance_scale = j["guidance_scale"].get<double>();
    p.seed = j["generator_seed"].get<int64_t>();
    p.width = j["width"].get<int>();
    p.height = j["height"].get<int>();
    p.cache = parse_cache_config(mode);
    return sd3_txt2img(sd3_cache_tiny_models(), p);
}

} // namespace

TEST_CASE("DiT caches at threshold 0 (interval 1) are the uncached SD 3 run bit for bit", "[sd3][dit_cache]") {
    const auto off = sd3_cache_tiny_run("off");
    CHECK(off.cache_log["full_steps"] == 10);
    for (const char* mode : {"freq:max=0,lastsigma=0", "fbcache:thr=0", "teacache:thr=0", "taylorseer:interval=1"}) {
        INFO(mode);
        const auto r = sd3_cache_tiny_run(mode);
        CHECK(r.cache_log["full_steps"] == 10);
        CHECK(torch::equal(r.image, off.image));
    }
}

TEST_CASE("DiT caches with reuse steps: a logged decision per step, a finite image near the uncached one",
          "[sd3][dit_cache]") {
    const auto off = sd3_cache_tiny_run("off", 12);
    for (const char* mode : {"freq:thr=5,drift=0,span=0,lastsigma=0", "fbcache:thr=10,max=2", "teacache:thr=10", "taylorseer:interval=3",
                             "taylorseer:interval=2,order=1"}) {
        INFO(mode);
        const auto r = sd3_cache_tiny_run(mode, 12);
        REQUIRE(r.cache_steps.size() == 12);
        CHECK(r.cache_steps[0].full);
        const int full = r.cache_log["full_steps"].get<int>();
        CHECK(full < 12);
        CHECK(full >= 2);
        CHECK(torch::isfinite(r.image).all().item<bool>());
        CHECK((r.image - off.image).abs().mean().item<double>() < 0.3);
    }
    // taylorseer:interval=3 after two warm-up steps: full at 0, 1, 2, 5, 8, 11.
    const auto t = sd3_cache_tiny_run("taylorseer:interval=3", 12);
    std::vector<int> full;
    for (const auto& s : t.cache_steps)
        if (s.full) full.push_back(s.step);
    CHECK(full == std::vector<int>{0, 1, 2, 5, 8, 11});
    // freq's skip steps: logged as forecasts that are not full; the resolved record shows the transformer's keys.
    const auto f = sd3_cache_tiny_run("freq:thr=5,drift=0,span=0,lastsigma=0,skip=2,skipdrift=0", 12);
    int skipped = 0;
    for (const auto& st : f.cache_steps) skipped += st.forecast && !st.full ? 1 : 0;
    CHECK(skipped > 0);
    CHECK(!f.cache_steps.back().forecast); // the last step runs its probe
    CHECK((f.image - off.image).abs().mean().item<double>() < 0.3);
    const auto dflt = sd3_cache_tiny_run("freq", 12);
    CHECK(dflt.cache_log["params"]["thr"] == dit_freq_defaults().thr);
}

TEST_CASE("SD 3 img2img strength: diffusers' float rule, not SD 1.x's truncation", "[sd3][img2img]") {
    CHECK(sd3_img2img_start(10, 0.55) == 4); // int(10 - 5.5) = 4: 6 steps (SD 1.x: int(5.5) = 5 steps)
    CHECK(sd3_img2img_start(10, 1.0) == 0);
    CHECK(sd3_img2img_start(10, 0.05) == 9);
    CHECK(sd3_img2img_start(1, 0.3) == 0);
    CHECK(sd3_img2img_start(28, 0.6) == 11); // int(28 - 16.8) = int(11.2)
    CHECK_THROWS_AS(sd3_img2img_start(10, 0.0), ParamError);
    CHECK_THROWS_AS(sd3_img2img_start(10, 1.5), ParamError);
}

TEST_CASE("teacache calibration: the least-squares polynomial, by hand and on the tiny SD 3 model",
          "[sd3][dit_cache]") {
    // Points on y = 2 x^2 + 1: the fit is exact.
    const auto c = cache::fit_polynomial({0, 1, 2, 3}, {1, 3, 9, 19}, 2);
    REQUIRE(c.size() == 3);
    CHECK(c[0] == Approx(2).margin(1e-12));
    CHECK(c[1] == Approx(0).margin(1e-12));
    CHECK(c[2] == Approx(1).margin(1e-12));
    // A line through (0, 0), (1, 1), (2, 3): least squares y = 1.5 x - 1/6.
    const auto l = cache::fit_polynomial({0, 1, 2}, {0, 1, 3}, 1);
    CHECK(l[0] == Approx(1.5));
    CHECK(l[1] == Approx(-1.0 / 6));
    CHECK_THROWS_AS(cache::fit_polynomial({1, 2}, {1, 2}, 2), UsageError);
    CHECK_THROWS_AS(cache::fit_polynomial({1, 1, 1}, {1, 2, 3}, 2), UsageError);

    SD3Txt2ImgParams p;
    p.prompts = {"a cat"};
    p.steps = 8;
    p.guidance_scale = 4.5;
    p.width = p.height = 16;
    std::vector<std::pair<double, double>> samples;
    const auto coef = sd3_teacache_calibrate(sd3_cache_tiny_models(), {p}, 2, &samples);
    CHECK(samples.size() == 7); // steps after the first
    REQUIRE(coef.size() == 3);
    for (double v : coef) CHECK(std::isfinite(v));
    // The calibrated run is the uncached one.
    p.record_teacache = true;
    CHECK(torch::equal(sd3_txt2img(sd3_cache_tiny_models(), p).image, [&] {
        auto q = p;
        q.record_teacache = false;
        return sd3_txt2img(sd3_cache_tiny_models(), q).image;
    }()));
}

TEST_CASE("eval-cache on an SD 3 model: the DiT modes per image, threshold 0 identical, flow-matching Euler only",
          "[sd3][dit_cache][eval]") {
    // The trained demo MMDiT (32x32 images, which the Fashion-MNIST classifier reads) with fashion-sd's classifier.
    const std::string root = std::string(ANCHOR_SOURCE_DIR) + "/assets/models/";
    train::FashionEvalParams p;
    p.model = root + "fashion-mmdit";
    p.classifier = root + "fashion-sd/eval/classifier.safetensors";
    p.prompts = {"a photo of a sneaker", "a photo of a pair of trousers"};
    p.seed_list = {3};
    p.samplers = {"flow_match_euler"};
    p.steps = {6};
    p.batch = 1;
    p.out = test::scratch_dir("sd3_eval_cache");
    for (const char* m : {"off", "fbcache:thr=0", "taylorseer:interval=1", "taylorseer:interval=3"})
        p.modes.push_back(parse_cache_config(m));
    const auto r = train::run_fashion_eval(p);
    const auto& modes = r.report["cells"][0]["modes"];
    REQUIRE(modes.size() == 4);
    for (int k = 0; k < 3; ++k) {
        INFO(modes[k]["mode"]);
        CHECK(modes[k]["full_steps"].get<double>() == 12.0); // 6 steps x 2 images
        CHECK(modes[k]["total_steps"] == 12);
        CHECK(modes[k]["psnr_db"] == "inf");
    }
    // taylorseer:interval=3 after two warm-up steps: full at 0, 1, 2, 5 of 6, per image.
    CHECK(modes[3]["full_steps"].get<double>() == 8.0);
    CHECK(modes[3]["psnr_db"].is_number());
    CHECK(modes[0]["classifier_adherence"].is_number());

    p.samplers = {"ddim"};
    p.overwrite = true;
    CHECK(test::error_of([&] { train::run_fashion_eval(p); }).find("flow_match_euler only") != std::string::npos);
}
