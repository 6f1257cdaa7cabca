// Frequency-anchored deep-feature cache (unet/cache/freq_cache.h) and the cache mode parser.
#include "cache/dct.h"
#include "cache/io/error.h"
#include "cache/modes/mode_list.h"
#include "tests/sd_pipeline_golden.h"
#include "tests/test_cli_util.h"
#include "tests/test_util.h"
#include "tests/tiny_sd_run.h"
#include "text/diffusion/mdlm_cache.h"
#include "unet/cache/freq_cache.h"
#include "unet/cache/freq_calibration.h"
#include "unet/model/unet_macs.h"
#include "unet/train/fashion_eval.h"

#include <catch2/catch.hpp>

#include <algorithm>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <tuple>

using namespace anchor;
using namespace anchor::unet;

TEST_CASE("cache mode parsing: valid forms", "[freq]") {
    CHECK(parse_cache_mode("off")->spec() == "off");
    CHECK(parse_cache_mode("deepcache:3")->spec() == "deepcache:3");
    CHECK(parse_cache_mode("deepcache:2,branch=1")->spec() == "deepcache:2,branch=1");
    auto f = parse_cache_mode("freq");
    CHECK(f->name() == "freq");
    CHECK(f->spec() ==
          "freq:tau=0.01,thr=0.7,max=none,span=0.35,band=4,extrapolate=1,order=1,drift=0.35,branch=0,probe=raw,"
          "correct=1,skip=1,skipdrift=0.35,noise=0.7,noiseskip=0.5,lastsigma=0.1,attn=reuse,attnmax=1");
    CHECK(parse_cache_mode("freq:tau=0.05,max=2,band=3,extrapolate=0,thr=0.5,branch=1")->spec() ==
          "freq:tau=0.05,thr=0.5,max=2,span=0.35,band=3,extrapolate=0,order=1,drift=0.35,branch=1,probe=raw,correct=1,"
          "skip=1,skipdrift=0.35,noise=0.7,noiseskip=0.5,lastsigma=0.1,attn=reuse,attnmax=1");
    CHECK(parse_cache_mode("freq:order=2,span=0,drift=0.3,max=none")->spec() ==
          "freq:tau=0.01,thr=0.7,max=none,span=0,band=4,extrapolate=1,order=2,drift=0.3,branch=0,probe=raw,correct=1,"
          "skip=1,skipdrift=0.35,noise=0.7,noiseskip=0.5,lastsigma=0.1,attn=reuse,attnmax=1");
    CHECK(
        parse_cache_mode("freq:probe=det,correct=0,skip=0,skipdrift=0,noise=0,noiseskip=0")->spec() ==
        "freq:tau=0.01,thr=0.7,max=none,span=0.35,band=4,extrapolate=1,order=1,drift=0.35,branch=0,probe=det,correct=0,"
        "skip=0,skipdrift=0,noise=0,noiseskip=0,lastsigma=0.1,attn=reuse,attnmax=1");
    CHECK(parse_cache_mode("freq:attn=run")->spec().find(",attn=run") != std::string::npos);
    CHECK(parse_cache_mode("freq:attn=reuse,attnmax=1")->spec() == f->spec()); // the default
    CHECK(parse_cache_mode("freq:attnmax=none")->spec().find(",attn=reuse,attnmax=none") != std::string::npos);
    CHECK(cache::modes::split_mode_list("off,deepcache:3,branch=1,freq,freq:tau=0.1,max=2") ==
          std::vector<std::string>{"off", "deepcache:3,branch=1", "freq", "freq:tau=0.1,max=2"});
    CHECK(cache::modes::split_mode_list("freq,max=2") == std::vector<std::string>{"freq:max=2"});
}

TEST_CASE("cache mode parsing: freq:target=DB scales thr, drift and skipdrift, the string keeps what was given",
          "[freq]") {
    auto plain = parse_cache_mode("freq");
    const auto* fp = dynamic_cast<const FreqAnchorDenoiser*>(plain.get());
    REQUIRE(fp);
    CHECK(fp->target_scale() == 1.0);
    CHECK(plain->spec().find("target") == std::string::npos);
    const auto cal = freq_target_calibration();
    for (double t : {30.0, 35.0, 40.0}) {
        const std::string text = "freq:target=" + cache::modes::format_number(t);
        auto m = parse_cache_mode(text);
        const auto* f = dynamic_cast<const FreqAnchorDenoiser*>(m.get());
        REQUIRE(f);
        CHECK(f->target_scale() == Approx(cache::target_threshold_scale(t, cal)));
        CHECK(m->spec() == plain->spec() + ",target=" + cache::modes::format_number(t));
        CHECK(parse_cache_mode(m->spec())->spec() == m->spec()); // the canonical string parses to itself
    }
    // A higher target never allows more reuse.
    CHECK(cache::target_threshold_scale(40.0, cal) < cache::target_threshold_scale(35.0, cal));
    CHECK(parse_cache_mode("freq:fast,target=35")->spec().find(",drift=0.4,") != std::string::npos);
    CHECK(parse_cache_mode("freq:forecast=denoised")->spec().find(",forecast=denoised") != std::string::npos);
    for (const char* bad : {"freq:target=-1", "freq:target=x", "freq:target=nan", "freq:forecast=x"})
        CHECK_THROWS_AS(parse_cache_config(bad), ParamError);
}

TEST_CASE("cache mode parsing: freq:guard=B, off by default, in the canonical string only when set", "[freq][guard]") {
    auto plain = parse_cache_mode("freq");
    CHECK(plain->spec().find("guard") == std::string::npos);
    auto m = parse_cache_mode("freq:guard=1.5");
    CHECK(m->spec() == plain->spec() + ",guard=1.5");
    CHECK(parse_cache_mode(m->spec())->spec() == m->spec());
    CHECK(parse_cache_mode("freq:guard=0")->spec() == plain->spec());
    for (const char* bad : {"freq:guard=-1", "freq:guard=x", "freq:guard=nan"})
        CHECK_THROWS_AS(parse_cache_config(bad), ParamError);
}

TEST_CASE("cache mode parsing: malformed forms are errors of the cache field listing the valid forms", "[freq]") {
    for (const char* bad : {"",
                            "on",
                            "deepcache",
                            "deepcache:",
                            "deepcache:0",
                            "deepcache:x",
                            "deepcache:3,foo=1",
                            "deepcache:3,branch=-1",
                            "off:1",
                            "freq:",
                            "freq:tau",
                            "freq:tau=abc",
                            "freq:max=-1",
                            "freq:skip=-1",
                            "freq:skip=x",
                            "freq:band=0",
                            "freq:thr=0",
                            "freq:extrapolate=2",
                            "freq:speed=3",
                            "freq:tau=nan",
                            "freq:max=never",
                            "freq:span=-0.1",
                            "freq:order=3",
                            "freq:order=0",
                            "freq:drift=-1",
                            "freq:probe=noisy",
                            "freq:correct=2",
                            "freq:last=2",
                            "freq:decide=each"}) {
        INFO(bad);
        try {
            parse_cache_mode(bad);
            FAIL("accepted");
        } catch (const ParamError& e) {
            CHECK(e.field() == "cache");
            const std::string m = e.what();
            CHECK(m.find("deepcache:N[,branch=B]") != std::string::npos);
            CHECK(m.find("freq[:tau=") != std::string::npos);
        }
    }
    CHECK(cache_mode_table().size() == 6); // off, deepcache, freq and the transformer caches
}

TEST_CASE("anchored fraction on a scripted pair of spectra", "[freq]") {
    // 4 coefficients per map: energies E0 = X0^2, E1 = X1^2 with rates 0, 0.0044 (1.001^2 - 1 ~ 0.002), 0.21, 3.
    auto X0 = torch::tensor({1.0f, 2.0f, 1.0f, 1.0f}).reshape({1, 1, 2, 2});
    auto X1 = torch::tensor({1.0f, 2.002f, 1.1f, -2.0f}).reshape({1, 1, 2, 2});
    auto m = FreqAnchorDenoiser::anchored_mask(X1, X0, 0.01);
    CHECK(m.flatten()[0].item<bool>());
    CHECK(m.flatten()[1].item<bool>());
    CHECK_FALSE(m.flatten()[2].item<bool>());
    CHECK_FALSE(m.flatten()[3].item<bool>()); // a sign flip with doubled magnitude: rate 3
    double frac = 0;
    auto F1 = cache::idct2(X1);
    FreqAnchorDenoiser::reuse_feature(F1, X1, X0, 4, 2, 5, 0.01, true, &frac);
    CHECK(frac == Approx(0.5));
    FreqAnchorDenoiser::reuse_feature(F1, X1, X0, 4, 2, 5, 0.5, true, &frac);
    CHECK(frac == Approx(0.75));
}

TEST_CASE("reuse feature: anchored coefficients are reused, the others extrapolated linearly", "[freq]") {
    torch::manual_seed(3);
    auto F0 = torch::randn({2, 3, 8, 8}), F1 = torch::randn({2, 3, 8, 8});
    auto X0 = cache::dct2(F0), X1 = cache::dct2(F1);
    double frac = -1;
    // extrapolate=0: the cached feature itself (same storage).
    auto r0 = FreqAnchorDenoiser::reuse_feature(F1, X1, X0, 6, 3, 8, 0.01, false, &frac);
    CHECK(r0.data_ptr() == F1.data_ptr());
    // tau huge: everything anchored -> the cached feature itself.
    auto r1 = FreqAnchorDenoiser::reuse_feature(F1, X1, X0, 6, 3, 8, 1e30, true, &frac);
    CHECK(frac == 1.0);
    CHECK(r1.data_ptr() == F1.data_ptr());
    // tau 0: nothing anchored -> by linearity of the DCT, F1 + (F1 - F0) (k - s1) / (s1 - s0).
    auto r2 = FreqAnchorDenoiser::reuse_feature(F1, X1, X0, 6, 3, 8, 0.0, true, &frac);
    CHECK(frac == 0.0);
    CHECK(torch::allclose(r2, F1 + (F1 - F0) * (2.0 / 3.0), 1e-4, 1e-4));
    // Only one full step so far: F1.
    auto r3 = FreqAnchorDenoiser::reuse_feature(F1, X1, torch::Tensor(), 0, -1, 1, 0.0, true, &frac);
    CHECK(r3.data_ptr() == F1.data_ptr());
    // The one-pass float32 slope equals the tensor formula bit for bit (mask, fraction and values), here with a
    // tau that anchors about half of the coefficients; float64 spectra take the tensor formula.
    auto Xa = X0 * (1 + 0.01 * torch::randn_like(X0));
    for (double tau : {0.0, 0.01, 0.02, 1e30}) {
        double f32 = -1, f64 = -1;
        auto s32 = FreqAnchorDenoiser::extrapolation_slope(Xa, X0, 6, 3, tau, &f32);
        auto mask = FreqAnchorDenoiser::anchored_mask(Xa, X0, tau);
        CHECK(f32 == mask.to(torch::kDouble).mean().item<double>());
        if (f32 >= 1.0) {
            CHECK_FALSE(s32.defined());
            continue;
        }
        CHECK(torch::equal(s32, cache::idct2(torch::where(mask, torch::zeros_like(Xa), Xa - X0)) / 3.0));
        auto s64 =
            FreqAnchorDenoiser::extrapolation_slope(Xa.to(torch::kDouble), X0.to(torch::kDouble), 6, 3, tau, &f64);
        CHECK(torch::allclose(s64.to(torch::kFloat), s32, 1e-4, 1e-5));
    }
}

TEST_CASE("order 2: TaylorSeer's second-order term with unequal spacing, by hand", "[freq]") {
    // A feature that is u^2 everywhere, full steps at timesteps u00 = 10, u0 = 8, u1 = 7, a reuse at k = 5:
    //   f[u1, u0] = (49 - 64) / (7 - 8) = 15, f[u0, u00] = (64 - 100) / (8 - 10) = 18,
    //   f[u1, u0, u00] = (15 - 18) / (7 - 10) = 1, so the curvature term is 2;
    //   order 1: 49 + 15 (5 - 7) = 19; order 2: 19 + 2 (5 - 7)^2 / 2 = 23 (the true value is 25).
    // tau 0 anchors nothing (a rate is never < 0), so every coefficient is forecast.
    auto cst = [](double v) { return torch::full({1, 2, 4, 4}, v); };
    const auto F1 = cst(49), X1 = cache::dct2(F1), X0 = cache::dct2(cst(64)), X00 = cache::dct2(cst(100));
    double frac = -1;
    auto slope = FreqAnchorDenoiser::extrapolation_slope(X1, X0, 7, 8, 0.0, &frac);
    CHECK(frac == 0.0);
    REQUIRE(slope.defined());
    CHECK(torch::allclose(slope, cst(15), 1e-5, 1e-4));
    auto curv = FreqAnchorDenoiser::extrapolation_curvature(X1, X0, X00, 7, 8, 10, 0.0);
    REQUIRE(curv.defined());
    CHECK(torch::allclose(curv, cst(2), 1e-5, 1e-4));
    CHECK(torch::allclose(FreqAnchorDenoiser::extrapolate_feature(F1, slope, 5 - 7), cst(19), 1e-5, 1e-4));
    CHECK(torch::allclose(FreqAnchorDenoiser::extrapolate_feature(F1, slope, 5 - 7, curv), cst(23), 1e-5, 1e-4));
    // Anchored coefficients get neither term: with tau huge everything is anchored.
    CHECK_FALSE(FreqAnchorDenoiser::extrapolation_curvature(X1, X0, X00, 7, 8, 10, 1e30).defined());
    // Fewer than three full steps, or two at the same timestep: no curvature.
    CHECK_FALSE(FreqAnchorDenoiser::extrapolation_curvature(X1, X0, torch::Tensor(), 7, 8, 10, 0.0).defined());
    CHECK_FALSE(FreqAnchorDenoiser::extrapolation_curvature(X1, X0, X00, 7, 8, 8, 0.0).defined());
    // Equal spacing (DDIM): the order-1 forecast along the timestep is the step-index one of before.
    auto a = FreqAnchorDenoiser::reuse_feature(F1, X1, X0, 700, 800, 500, 0.0, true, &frac);
    CHECK(torch::allclose(a, cst(49 + (49 - 64) * 2.0), 1e-5, 1e-3));
}

namespace {

struct TinyRun {
    std::vector<bool> full;
    torch::Tensor latents;
};

using test::deepcache_models;
using test::tiny_params;

TinyRun run_tiny(unet::SDModels& models, DenoiseController& ctl, int steps) {
    Txt2ImgPipeline pipe(models);
    const auto p = tiny_params(steps, SamplerKind::DDIM);
    c10::InferenceMode guard;
    TinyRun out;
    auto r = pipe.run(p, &ctl, {}, [&](const StepRecord&) { out.full.push_back(ctl.last_step_was_full()); });
    out.latents = r.final_latents;
    return out;
}

// Whether cache modes `a` and `b` give the same final latents, bit for bit, on run `p`.
bool same_latents(Txt2ImgPipeline& pipe, const Txt2ImgParams& p, const std::string& a, const std::string& b) {
    auto ca = parse_cache_mode(a), cb = parse_cache_mode(b);
    return torch::equal(pipe.run(p, ca.get()).final_latents, pipe.run(p, cb.get()).final_latents);
}

} // namespace

TEST_CASE("freq on the tiny SD model: schedule rules and DeepCache equivalence", "[freq][sd]") {
    namespace fs = std::filesystem;
    const fs::path dir = test::golden("sd/deepcache");
    auto cfg = sdgolden::read_json_file(dir / "config.json");
    auto models = sdgolden::load_run_models(dir, cfg);

    SECTION("extrapolate=0 (or tau huge) with a max=2 schedule and attn=run equals deepcache:3 bit for bit") {
        DeepCacheDenoiser dc(3, 0);
        auto ref = run_tiny(models, dc, 10);
        CHECK(ref.full == std::vector<bool>{1, 0, 0, 1, 0, 0, 1, 0, 0, 1});
        for (const char* spec : {"freq:thr=1e30,max=2,span=0,drift=0,extrapolate=0,skip=0,attn=run",
                                 "freq:thr=1e30,max=2,span=0,drift=0,tau=1e30,skip=0,attn=run"}) {
            INFO(spec);
            auto fq = parse_cache_mode(spec);
            auto r = run_tiny(models, *fq, 10);
            CHECK(r.full == ref.full);
            CHECK(torch::equal(r.latents, ref.latents));
            // With tau huge every coefficient is anchored; with extrapolate=0 the fraction is still measured (logged)
            // but not used.
            if (std::string(spec).find("tau=1e30") != std::string::npos)
                for (const auto& s : fq->log())
                    if (!s.full) CHECK(s.anchored_fraction == 1.0);
        }
    }
    SECTION("first and last steps are full, the max cap holds, extrapolation changes the result") {
        for (int max : {0, 1, 3}) {
            auto fq = parse_cache_mode("freq:thr=1e30,span=0,drift=0,lastsigma=0,max=" + std::to_string(max));
            auto r = run_tiny(models, *fq, 12);
            REQUIRE(r.full.size() == 12);
            CHECK(r.full.front());
            CHECK(r.full.back());
            int run = 0, worst = 0;
            for (bool f : r.full) worst = std::max(worst, run = f ? 0 : run + 1);
            CHECK(worst == max); // thr never reached: exactly `max` reuses between full steps
        }
        // last=0: the last step follows the rules like any other (full at 0, 4, 8; 9-11 are the three reuses).
        auto free_last = parse_cache_mode("freq:thr=1e30,span=0,drift=0,max=3,last=0");
        CHECK(free_last->spec().find(",last=0") != std::string::npos);
        CHECK(run_tiny(models, *free_last, 12).full == std::vector<bool>{1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0});
        auto fq = parse_cache_mode("freq:thr=1e30,max=2,span=0,drift=0,tau=0.01");
        auto r = run_tiny(models, *fq, 10);
        DeepCacheDenoiser dc(3, 0);
        auto ref = run_tiny(models, dc, 10);
        CHECK(r.full == ref.full);
        // Steps 7, 8 have two earlier full steps (3, 6): some coefficients move, so the latents differ from plain
        // reuse but stay close (the extrapolation is a correction, not a different model).
        CHECK(fq->log()[7].anchored_fraction < 1.0);
        CHECK_FALSE(torch::equal(r.latents, ref.latents));
        const double rel =
            (r.latents - ref.latents).abs().max().item<double>() / ref.latents.abs().max().item<double>();
        CHECK(rel < 0.5);
    }
    SECTION("default freq: the energy rule fires and logs the probe") {
        auto fq = parse_cache_mode("freq");
        auto r = run_tiny(models, *fq, 20);
        CHECK(r.full.front());
        CHECK_FALSE(r.full.back()); // the loop ends at sigma 0.04, under lastsigma: the last step is a reuse
        int full = 0;
        for (bool f : r.full) full += f;
        CHECK(full < 20);
        CHECK(fq->log()[0].energy_change == 0.0);
        CHECK(fq->log()[1].energy_change > 0.0);
        WARN("default freq on tiny DDIM 20: " << full << " full steps");
    }
    SECTION("the span bound in the loop's noise levels, the reason of every full step, the drift bound") {
        auto fq = parse_cache_mode("freq:thr=1e30,span=0.25,drift=0,skip=0,lastsigma=0");
        auto r = run_tiny(models, *fq, 12);
        const auto& log = fq->log();
        REQUIRE(log.size() == 12);
        // The pipeline handed the controller the DDIM steps' sigmas: positive, decreasing.
        for (size_t k = 1; k < log.size(); ++k) CHECK(log[k].noise_level < log[k - 1].noise_level);
        CHECK(log.back().noise_level > 0);
        // The rule by hand from the logged levels: full once ln sigma fell by more than a quarter of the loop's
        // range since the last full step.
        const double bound = 0.25 * (std::log(log.front().noise_level) - std::log(log.back().noise_level));
        double last = std::log(log.front().noise_level);
        for (size_t k = 0; k < log.size(); ++k) {
            INFO("step " << k);
            const double ls = std::log(log[k].noise_level);
            const bool expect = k == 0 || k + 1 == log.size() || last - ls > bound;
            CHECK(r.full[k] == expect);
            CHECK(log[k].why == (!expect ? "" : k == 0 ? "first" : k + 1 == log.size() ? "last" : "span"));
            if (expect) last = ls;
        }
        CHECK(cache_log_json(*fq)["steps"][0]["why"] == "first");
        // drift: a bound no forecast meets makes every step full for that reason; a huge one changes nothing.
        auto strict = parse_cache_mode("freq:thr=1e30,span=0.25,drift=1e-12,skip=0,lastsigma=0");
        auto rs = run_tiny(models, *strict, 12);
        CHECK(std::all_of(rs.full.begin(), rs.full.end(), [](bool f) { return f; }));
        CHECK(strict->log()[1].why == "drift");
        CHECK(strict->log()[1].drift > 1e-12);
        auto loose = parse_cache_mode("freq:thr=1e30,span=0.25,drift=1e30,skip=0,lastsigma=0");
        CHECK(torch::equal(run_tiny(models, *loose, 12).latents, r.latents));
        // order 2 changes the result only once three full steps exist, and stays close to order 1.
        auto o2 = parse_cache_mode("freq:thr=1e30,span=0.25,drift=0,order=2,skip=0,lastsigma=0");
        auto r2 = run_tiny(models, *o2, 12);
        CHECK(r2.full == r.full);
        CHECK_FALSE(torch::equal(r2.latents, r.latents));
        const double rel = (r2.latents - r.latents).abs().max().item<double>() / r.latents.abs().max().item<double>();
        CHECK(rel < 0.5);
    }
}

TEST_CASE("freq guard=B on the tiny SD model: the image's drift residuals spent, then every step full, by hand",
          "[freq][sd][guard]") {
    namespace fs = std::filesystem;
    const fs::path dir = test::golden("sd/deepcache");
    auto cfg = sdgolden::read_json_file(dir / "config.json");
    auto models = sdgolden::load_run_models(dir, cfg);
    // drift=1e30: the residual is measured at every reuse step but never makes one full by itself.
    const std::string base = "freq:thr=1e30,span=0.25,drift=1e30,skip=0,lastsigma=0";
    auto plain = parse_cache_mode(base);
    auto r = run_tiny(models, *plain, 12);
    const auto& log = plain->log();
    REQUIRE(log.size() == 12);
    std::vector<int> reuses;
    for (int k = 0; k < 12; ++k)
        if (!r.full[size_t(k)]) reuses.push_back(k);
    REQUIRE(reuses.size() >= 2);
    for (int k : reuses) CHECK(log[size_t(k)].drift > 0);
    // A budget no image spends changes nothing.
    auto loose = parse_cache_mode(base + ",guard=1e30");
    CHECK(torch::equal(run_tiny(models, *loose, 12).latents, r.latents));
    // The budget between the first reuse's residual and the first two's: the second reuse step would pass it, so it
    // is full ("guard") and so is every later step; the steps before it are as without the guard.
    const int a = reuses[0], b = reuses[1];
    const double budget = log[size_t(a)].drift + 0.5 * log[size_t(b)].drift;
    auto guarded = parse_cache_mode(base + ",guard=" + cache::modes::format_number(budget));
    auto rg = run_tiny(models, *guarded, 12);
    for (int k = 0; k < 12; ++k) {
        INFO("step " << k);
        CHECK(rg.full[size_t(k)] == (k < b ? bool(r.full[size_t(k)]) : true));
    }
    CHECK(guarded->log()[size_t(b)].why == "guard");
    CHECK(guarded->log()[size_t(a)].drift == log[size_t(a)].drift);
    // Every step computed after the trip: closer to the uncached run than the guard-less cache.
    DeepCacheDenoiser every(1, 0);
    auto exact = run_tiny(models, every, 12);
    CHECK((rg.latents - exact.latents).abs().max().item<double>() <
          (r.latents - exact.latents).abs().max().item<double>());
}

TEST_CASE("the feature caches keep their state in the shared LatentCache, with the mode's staleness", "[freq][sd]") {
    namespace fs = std::filesystem;
    const fs::path dir = test::golden("sd/deepcache");
    auto cfg = sdgolden::read_json_file(dir / "config.json");
    auto models = sdgolden::load_run_models(dir, cfg);
    // deepcache:3 over 10 steps: 6 reuses, each one hit of the stored feature; the JSON record carries the store's
    // statistics.
    auto dc = parse_cache_mode("deepcache:3");
    auto ref = run_tiny(models, *dc, 10);
    const auto st = dc->features().store().stats();
    CHECK(st.hits == 6);
    CHECK(st.puts == 4);
    CHECK(cache_log_json(*dc)["store"]["hits"] == 6);
    // One store shared by two modes (a server's), each run in its namespace: the same results as stores of their own.
    auto shared = std::make_shared<cache::LatentCache>();
    auto a = parse_cache_mode("deepcache:3"),
         b = parse_cache_mode("freq:thr=1e30,max=2,span=0,drift=0,extrapolate=0,skip=0,attn=run");
    a->set_store(shared, "request-a");
    b->set_store(shared, "request-b");
    CHECK(torch::equal(run_tiny(models, *a, 10).latents, ref.latents));
    CHECK(torch::equal(run_tiny(models, *b, 10).latents, ref.latents));
    // 6 feature reuses each, and freq's 3 reads of the previous full step's spectrum
    CHECK(shared->stats().hits == 6 + 6 + 3);
    // attn=reuse keeps the attention residuals there too: one more hit per shallow attention layer and reuse.
    auto lite = parse_cache_mode("freq:thr=1e30,max=2,span=0,drift=0,extrapolate=0,skip=0,attn=reuse,attnmax=none");
    lite->set_store(shared, "request-d");
    const auto before = shared->stats().hits;
    run_tiny(models, *lite, 10);
    CHECK(shared->stats().hits - before == 6 + 3 + 6 * int64_t(models.unet->shallow_attention_layers(0).size()));
    // A store that cannot hold the feature (byte budget below it): every step is full, nothing stale is ever used.
    auto tiny = std::make_shared<cache::LatentCache>(cache::LatentCacheOptions{16, 2, false});
    auto c = parse_cache_mode("deepcache:3");
    c->set_store(tiny, "request-c");
    auto r = run_tiny(models, *c, 10);
    CHECK(std::all_of(r.full.begin(), r.full.end(), [](bool f) { return f; }));
    CHECK(tiny->stats().oversize_rejections == 10);
}

TEST_CASE("freq probe: one decision for a batch, from the image that changes most", "[freq]") {
    // Two images (rows 0, 1 uncond; 2, 3 cond): image 1's rows stay the same, image 0's change. The batch's change is
    // image 0's alone, not the pooled change of both (which the unchanged image would dilute).
    auto models = deepcache_models();
    torch::manual_seed(3);
    auto x0 = torch::randn({4, 4, 8, 8}), x1 = x0.clone();
    x1.index_put_({torch::tensor({0, 2})}, x0.index({torch::tensor({0, 2})}) * 1.7 + 0.3);
    ShallowProbe batch(4), alone(4), pooled(4);
    batch.reset(2);
    alone.reset(1);
    pooled.reset(1);
    batch.update(*models.unet, x0);
    const double r = batch.update(*models.unet, x1);
    const auto rows0 = torch::tensor({0, 2});
    alone.update(*models.unet, x0.index_select(0, rows0));
    const double r0 = alone.update(*models.unet, x1.index_select(0, rows0));
    pooled.update(*models.unet, x0);
    const double rp = pooled.update(*models.unet, x1);
    // The same image's change, up to float32 rounding: a batch of 4 and one of 2 may take convolution paths that round
    // differently on some CPUs (1.2e-8 relative on an AMD EPYC).
    CHECK(r == Approx(r0).epsilon(1e-6));
    CHECK(r > rp * 1.2);
}

TEST_CASE("freq decide=image: each image of a batch decides alone and comes out as it would alone", "[freq][sd]") {
    // A deterministic trajectory driven by the controller's own output, on the tiny UNet: two images (rows 0, 2 and
    // 1, 3, as a guidance batch lays them out), the second moving faster, so that they want different full steps.
    auto models = deepcache_models();
    auto& unet = *models.unet;
    c10::InferenceMode guard;
    torch::manual_seed(11);
    const int steps = 14;
    auto x0 = torch::randn({4, unet.config().in_channels, 8, 8});
    auto ctx = torch::randn({4, 6, unet.config().cross_attention_dim});
    std::vector<double> sigmas;
    for (int k = 0; k < steps; ++k) sigmas.push_back(10.0 * std::pow(0.65, k));
    // rate: per row, how fast the trajectory follows the output.
    auto run = [&](const std::string& spec, const torch::Tensor& x_init, const torch::Tensor& c, int images,
                   const torch::Tensor& rate) {
        auto ctl = parse_cache_mode(spec);
        ctl->set_noise_levels(sigmas);
        ctl->begin(steps, images);
        auto x = x_init.clone();
        std::vector<torch::Tensor> outs;
        for (int k = 0; k < steps; ++k) {
            auto out = ctl->predict(unet, x, torch::scalar_tensor(950.0 - 70.0 * k), UNetCond(c), k);
            outs.push_back(out);
            x = x - rate.view({-1, 1, 1, 1}) * out;
        }
        return std::make_pair(std::move(ctl), outs);
    };
    const std::string spec = "freq:thr=0.3,drift=0.3,decide=image";
    const auto rate = torch::tensor({0.1f, 0.25f, 0.1f, 0.25f}); // image 1 follows its output faster
    auto [batch, outs] = run(spec, x0, ctx, 2, rate);
    int mixed = 0;
    for (int b = 0; b < 2; ++b) {
        INFO("image " << b);
        const auto rows = torch::tensor({b, 2 + b});
        auto [alone, alone_outs] =
            run(spec, x0.index_select(0, rows), ctx.index_select(0, rows), 1, rate.index_select(0, rows));
        for (int k = 0; k < steps; ++k) {
            INFO("step " << k);
            const auto mine = outs[size_t(k)].index_select(0, rows);
            // Sub-batches of the UNet round differently from a batch of one image: float32 rounding only.
            CHECK((mine - alone_outs[size_t(k)]).abs().max().item<double>() <
                  1e-4 * (1.0 + alone_outs[size_t(k)].abs().max().item<double>()));
        }
        for (int k = 0; k < steps; ++k) {
            const auto& s = batch->log()[size_t(k)];
            if (alone->log()[size_t(k)].full) CHECK(s.full);
            if (s.full_share == 0.5) ++mixed;
        }
    }
    // The images did not always agree: some step ran the full UNet for one of them only.
    CHECK(mixed > 0);
    CHECK(batch->log().front().full_share == 1.0);
    CHECK(cache_log_json(*batch)["steps"][0]["full_share"] == 1.0);
    // decide=batch (the default): one decision for both, every step full or reused for the whole batch.
    auto [together, t_outs] = run("freq:thr=0.3,drift=0.3", x0, ctx, 2, rate);
    for (const auto& s : together->log()) CHECK((s.full_share == 0.0 || s.full_share == 1.0));
    CHECK(parse_cache_mode("freq:decide=image")->spec().find(",decide=image") != std::string::npos);
    CHECK(parse_cache_mode("freq:decide=batch")->spec() == parse_cache_mode("freq")->spec());
}

TEST_CASE("freq anchor profile: ranges map to per-step thresholds and bad files are named", "[freq]") {
    cache::AnchorProfile p;
    p.step_ranges = {{0.0, 0.5, 2.0, 0}, {0.5, 1.0, 0.5, 0}};
    const auto t = p.step_thresholds(4, 1.0);
    REQUIRE(t.size() == 4);
    CHECK(t[0] == 2.0);
    CHECK(t[1] == 2.0);
    CHECK(t[2] == 0.5);
    CHECK(t[3] == 0.5);
    cache::AnchorProfile early;
    early.step_ranges = {{0.0, 0.25, 3.0, 0}};
    CHECK(early.step_thresholds(4, 1.0)[3] == 1.0); // no range: the fixed threshold
    const auto dir = test::scratch_dir("freq_profile");
    // the format written by anchor-sd calibrate before profiles were shared, the shared one, and broken ones
    std::ofstream(dir + "/old.json")
        << R"({"kind":"anchor-sd freq profile","ranges":[{"begin":0,"end":0.5,"threshold":2},{"begin":0.5,"end":1,"threshold":0.5}]})";
    p.save(dir + "/new.json", false);
    std::ofstream(dir + "/bad.json") << "{ nope";
    std::ofstream(dir + "/empty.json") << R"({"kind":"anchor-sd freq profile","ranges":[]})";
    for (const char* f : {"/old.json", "/new.json"}) {
        const auto q = cache::AnchorProfile::load(dir + f);
        REQUIRE(q.step_ranges.size() == 2);
        CHECK(q.step_thresholds(4, 1.0) == t);
    }
    CHECK_THROWS_WITH(cache::AnchorProfile::load(dir + "/bad.json"), Catch::Contains("bad.json"));
    CHECK_THROWS_WITH(cache::AnchorProfile::load(dir + "/empty.json"), Catch::Contains("step ranges"));
    CHECK_THROWS_WITH(cache::AnchorProfile::load(dir + "/missing.json"), Catch::Contains("missing.json"));
    CHECK_THROWS_WITH(unet::parse_cache_mode("freq:profile=" + dir + "/bad.json"), Catch::Contains("bad.json"));
    // The mode string accepts it and the policy uses it: a huge early threshold, a tiny late one.
    std::ofstream(dir + "/steep.json")
        << R"({"ranges":[{"begin":0,"end":0.5,"threshold":1e9},{"begin":0.5,"end":1,"threshold":1e-9}]})";
    auto c = unet::parse_cache_mode("freq:max=100,profile=" + dir + "/steep.json");
    CHECK(c->spec().find("profile=") != std::string::npos);
}

TEST_CASE("forecast then calibrate: the share of the probe's forecast step it moved, by hand", "[freq]") {
    // Three rows of 2x3 stems. S1 = 0, S0 = -1, h = 0.5: the forecast step S^ - S1 is 0.5 everywhere.
    const auto S1 = torch::zeros({3, 2, 3}), S0 = torch::full({3, 2, 3}, -1.0);
    auto S = torch::zeros({3, 2, 3});
    S[0].fill_(0.25); // half of the forecast step: alpha 0.5
    S[1].fill_(3.0);  // six forecast steps: clamped to 2
    S[2].fill_(-1.0); // against the trend: clamped to 0
    auto a = FreqAnchorDenoiser::forecast_calibration(S, S1, S0, 0.5);
    REQUIRE(a.sizes() == torch::IntArrayRef{3});
    CHECK(a[0].item<double>() == Approx(0.5));
    CHECK(a[1].item<double>() == 2.0);
    CHECK(a[2].item<double>() == 0.0);
    // One element moved: <S - S1, step> = 0.5 * 0.5 over |step|^2 = 6 * 0.25 -> 1/6.
    auto one = torch::zeros({1, 2, 3});
    one[0][1][2] = 0.5;
    CHECK(FreqAnchorDenoiser::forecast_calibration(one, S1[0].unsqueeze(0), S0[0].unsqueeze(0), 0.5).item<double>() ==
          Approx(1.0 / 6.0));
    // The forecast does not move (S1 == S0): alpha 1, the forecast as it is.
    CHECK(FreqAnchorDenoiser::forecast_calibration(S, S1, S1, 0.5)[1].item<double>() == 1.0);
    // F1 + alpha (slope h) per row, in F1's dtype (slope 2, h 1).
    const auto F1 = torch::ones({3, 1, 2, 2}, torch::kHalf), F = torch::full({3, 1, 2, 2}, 3.0);
    auto Fc = FreqAnchorDenoiser::extrapolate_feature(F1, F - 1.0, 1.0, {}, a);
    CHECK(Fc.scalar_type() == torch::kHalf);
    CHECK(Fc[0].eq(2.0).all().item<bool>());
    CHECK(Fc[1].eq(5.0).all().item<bool>());
    CHECK(Fc[2].eq(1.0).all().item<bool>());
    // Float32 CPU tensors take one-pass loops; other dtypes the tensor formulas: both agree on random inputs.
    torch::manual_seed(3);
    for (auto shape : {std::vector<int64_t>{1, 4, 3, 3}, std::vector<int64_t>{4, 8, 5, 7}}) {
        const auto s = torch::randn(shape), s1 = torch::randn(shape), s0 = torch::randn(shape);
        const auto fast = FreqAnchorDenoiser::forecast_calibration(s, s1, s0, 0.7);
        const auto ref = FreqAnchorDenoiser::forecast_calibration(s.to(torch::kDouble), s1.to(torch::kDouble),
                                                                  s0.to(torch::kDouble), 0.7);
        CHECK(torch::allclose(fast, ref, 1e-5, 1e-6));
        const auto f1 = torch::randn(shape), slope = torch::randn(shape), curv = torch::randn(shape);
        const auto alpha = torch::rand({shape[0]}) * 2;
        for (bool with_curv : {false, true}) {
            const auto c = with_curv ? curv : torch::Tensor();
            const auto got = FreqAnchorDenoiser::extrapolate_feature(f1, slope, -1.5, c, alpha);
            const auto want = FreqAnchorDenoiser::extrapolate_feature(
                f1.to(torch::kDouble), slope.to(torch::kDouble), -1.5, with_curv ? curv.to(torch::kDouble) : c, alpha);
            CHECK(got.scalar_type() == torch::kFloat);
            CHECK(torch::allclose(got.to(torch::kDouble), want, 1e-5, 1e-5));
        }
    }
}

TEST_CASE("Euler a: the injected noise carried forward leaves the deterministic trajectory", "[freq][schedulers]") {
    // With a model whose denoised estimate is a fixed X0 (eps = (x - X0) / sigma), each Euler a step is
    // x' = X0 + (x - X0) sigma_down / sigma + sigma_up z. Less the injected noise N it must follow the noise-free
    // recursion y' = X0 + (y - X0) sigma_down / sigma from the same start, with sigma_up / sigma_down by hand.
    auto sched = make_scheduler(SamplerKind::EulerAncestral);
    sched->set_timesteps(6);
    const auto sig = sched->sigmas();
    torch::manual_seed(11);
    const auto X0 = torch::randn({1, 4, 3, 3});
    auto x = torch::randn({1, 4, 3, 3}) * sig[0];
    auto y = x.clone();
    auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
    CHECK_FALSE(sched->injected_noise().defined());
    for (int i = 0; i < 6; ++i) {
        const double s = sig[size_t(i)], t = sig[size_t(i) + 1];
        const double up = std::min(t, std::sqrt(t * t * (s * s - t * t) / (s * s))), down = std::sqrt(t * t - up * up);
        x = sched->step((x - X0) / s, i, x, &gen);
        y = X0 + (y - X0) * (down / s);
        if (up > 0) {
            REQUIRE(sched->injected_noise().defined());
            INFO("step " << i);
            CHECK(torch::allclose(x - sched->injected_noise(), y, 1e-4, 1e-4));
        }
    }
    sched->set_timesteps(6);
    CHECK_FALSE(sched->injected_noise().defined());
    CHECK(sched->injected_carry() == 1.0);
    // The output's response to fresh input noise with the denoised estimate fixed: eps = (c_in^-1 input - x0) / sigma
    // with c_in = 1 / sqrt(sigma^2 + 1) at sigma = 2 moves by sqrt(5) / 2 per unit; v by 1 / sigma; a sample not.
    CHECK(InjectedNoise::gain(PredictionType::Epsilon, 2.0) == Approx(std::sqrt(5.0) / 2.0));
    CHECK(InjectedNoise::gain(PredictionType::VPrediction, 2.0) == Approx(0.5));
    CHECK(InjectedNoise::gain(PredictionType::Sample, 2.0) == 0.0);
    CHECK(InjectedNoise::gain(PredictionType::Epsilon, 0.0) == 0.0);
    // Deterministic samplers inject nothing; DDIM with eta > 0 does.
    for (auto [kind, eta] : {std::pair{SamplerKind::DDIM, 0.0}, std::pair{SamplerKind::DDIM, 0.5},
                             std::pair{SamplerKind::DPMPP2M, -1.0}}) {
        auto sc = make_scheduler(kind, {}, eta < 0 ? std::nullopt : std::optional<double>(eta));
        sc->set_timesteps(4);
        auto z = torch::randn({1, 4, 3, 3});
        sc->step(torch::randn({1, 4, 3, 3}), 0, z, &gen);
        CHECK(sc->injected_noise().defined() == (eta > 0));
    }
}

TEST_CASE("freq probe=det: the decision looks at the input less the injected noise", "[freq]") {
    auto models = deepcache_models();
    torch::manual_seed(4);
    const auto x0 = torch::randn({2, 4, 8, 8}), d = torch::randn({2, 4, 8, 8}) * 0.3, n = torch::randn({2, 4, 8, 8});
    ShallowProbe det(4), plain(4);
    det.reset(1);
    plain.reset(1);
    det.update(*models.unet, x0);
    plain.update(*models.unet, x0);
    // x1 = x0 + d + n with n injected: the probe sees the change d alone, as if n had not been added ...
    const double r = det.update(*models.unet, x0 + d + n, n);
    CHECK(r == Approx(plain.update(*models.unet, x0 + d)).epsilon(1e-5));
    // ... while the UNet still gets conv_in of the real input.
    CHECK(torch::allclose(det.stem(), models.unet->stem(x0 + d + n)));
    CHECK(torch::allclose(det.observed(), plain.observed(), 1e-5, 1e-5));
    CHECK_THROWS_AS(det.update(*models.unet, x0, n.narrow(0, 0, 1)), Error);
}

TEST_CASE("freq noise=V: under injected noise a full step once the noise since the last full step reaches V of the "
          "noise level; drift is not applied there",
          "[freq][sd]") {
    auto models = deepcache_models();
    Txt2ImgPipeline pipe(models);
    auto p = tiny_params(16, SamplerKind::EulerAncestral);
    c10::InferenceMode guard;
    // Only first/last and the noise rule decide (thr and span out of reach; drift=1e-12 would fire at every step if
    // it were applied).
    const double V = 0.7;
    auto fq = parse_cache_mode("freq:thr=1e30,span=0,drift=1e-12,noise=0.7,lastsigma=0");
    pipe.run(p, fq.get());
    const auto& log = fq->log();
    int reuses = 0, noisy = 0, checked = 0;
    for (size_t k = 0; k < log.size(); ++k) {
        INFO("step " << k << " why " << log[k].why << " injected " << log[k].injected);
        CHECK(log[k].why.find("drift") == std::string::npos);
        if (log[k].why == "noise") {
            ++noisy;
            CHECK(log[k].injected >= V);
        }
        if (log[k].full) continue;
        ++reuses;
        CHECK(log[k].injected < V);
        CHECK(log[k].injected > 0);
        // Right after a full step the noise since it is the fresh noise of one Euler a step, sigma_up z in the
        // latents: against sigma_k, sigma_up / sigma_k = sqrt(1 - sigma_k^2 / sigma_{k-1}^2) (k-diffusion's
        // get_ancestral_step, eta 1) times the RMS of z (~1 over these few hundred values).
        if (k >= 1 && log[k - 1].full) {
            const double s1 = log[k - 1].noise_level, s = log[k].noise_level;
            CHECK(log[k].injected == Approx(std::sqrt(1.0 - s * s / (s1 * s1))).epsilon(0.2));
            ++checked;
        }
    }
    CHECK(reuses > 0);
    CHECK(noisy > 0);
    CHECK(checked > 0);
    CHECK(cache_log_json(*fq)["steps"][1].contains("injected"));
    // noise=0: the drift rule applies under injected noise as before (and fires here).
    auto off = parse_cache_mode("freq:thr=1e30,span=0,drift=1e-12,noise=0");
    pipe.run(p, off.get());
    bool drift = false;
    for (const auto& s : off->log()) drift = drift || s.why.find("drift") != std::string::npos;
    CHECK(drift);
    // A deterministic sampler injects nothing: the rule never fires and the run is noise=0's.
    p.sampler = SamplerKind::DDIM;
    CHECK(same_latents(pipe, p, "freq:thr=1e30,span=0.5,noise=0.7", "freq:thr=1e30,span=0.5,noise=0"));
    auto det = parse_cache_mode("freq:thr=1e30,span=0.5,noise=0.7");
    pipe.run(p, det.get());
    for (const auto& s : det->log()) CHECK(s.injected == 0.0);
    CHECK_THROWS_WITH(parse_cache_mode("freq:noise=-1"), Catch::Contains("noise"));
}

TEST_CASE("freq noiseskip=W: under injected noise a reuse step holds the last computed denoised estimate, by hand",
          "[freq][sd]") {
    // The two conversions invert each other for every prediction type that has a denoised estimate to hold.
    auto x = torch::randn({2, 4, 3, 3}), out = torch::randn({2, 4, 3, 3});
    for (auto pt : {PredictionType::Epsilon, PredictionType::VPrediction, PredictionType::Sample}) {
        const auto x0 = FreqAnchorDenoiser::denoised_estimate(x, out, 1.7, pt);
        CHECK(test::max_abs_diff(FreqAnchorDenoiser::output_for(x, x0, 1.7, pt, torch::kFloat), out) < 1e-5);
    }
    // Epsilon by hand: the input is (x0 + sigma eps) / sqrt(1 + sigma^2).
    const auto x0 = torch::randn({1, 4, 2, 2}), eps = torch::randn({1, 4, 2, 2});
    const double sigma = 2.5, r = std::sqrt(1 + sigma * sigma);
    CHECK(test::max_abs_diff(
              FreqAnchorDenoiser::denoised_estimate((x0 + sigma * eps) / r, eps, sigma, PredictionType::Epsilon), x0) <
          1e-5);

    auto models = deepcache_models();
    Txt2ImgPipeline pipe(models);
    auto p = tiny_params(16, SamplerKind::EulerAncestral);
    c10::InferenceMode guard;
    // Only first/last and the noise rule decide; W = V so that every first reuse after a computed step is forecast.
    auto fq = parse_cache_mode("freq:thr=1e30,span=0,noise=0.9,noiseskip=0.9,skip=1");
    std::vector<StepRecord> recs;
    pipe.run(p, fq.get(), {}, [&](const StepRecord& r) { recs.push_back(r); });
    const auto& log = fq->log();
    REQUIRE(log.size() == recs.size());
    int forecasts = 0;
    long computed = -1; // the last step whose output a UNet computed
    for (size_t k = 0; k < log.size(); ++k) {
        INFO("step " << k << " injected " << log[k].injected);
        if (!log[k].forecast) {
            computed = long(k);
            continue;
        }
        ++forecasts;
        CHECK_FALSE(log[k].full);
        CHECK(log[k].macs == 0.0);
        CHECK(log[k].injected < 0.9);
        REQUIRE(computed >= 0);
        CHECK(long(k) - computed == 1); // skip=1: one forecast in a row
        const auto& c = recs[size_t(computed)];
        const double sc = log[size_t(computed)].noise_level, sk = log[k].noise_level;
        const auto held = c.model_input * std::sqrt(1 + sc * sc) - c.noise_pred * sc;
        const auto expect = (recs[k].model_input * std::sqrt(1 + sk * sk) - held) / sk;
        CHECK(test::max_abs_diff(recs[k].noise_pred, expect) <= 1e-5 * expect.abs().max().item<double>());
    }
    CHECK(forecasts > 0);
    // W = 0: the shallow path at every reuse; a deterministic sampler is not affected (nothing injected).
    auto none = parse_cache_mode("freq:thr=1e30,span=0,noise=0.9,noiseskip=0,skip=1");
    pipe.run(p, none.get());
    for (const auto& s : none->log()) CHECK_FALSE(s.forecast);
    p.sampler = SamplerKind::DDIM;
    CHECK(same_latents(pipe, p, "freq:thr=1e30,span=0.5", "freq:thr=1e30,span=0.5,noiseskip=0"));
    CHECK_THROWS_WITH(parse_cache_mode("freq:noiseskip=-0.5"), Catch::Contains("noiseskip"));
}

TEST_CASE("freq lastsigma=S: the last step is always full when its noise level is at least S, else always a reuse",
          "[freq][sd]") {
    auto models = deepcache_models();
    Txt2ImgPipeline pipe(models);
    auto p = tiny_params(16, SamplerKind::DDIM);
    c10::InferenceMode guard;
    // No rule but first/last can make a step full here (thr and span out of reach, no drift, no forecasts).
    const std::string rules = "freq:thr=1e30,span=0,drift=0,skip=0";
    auto always = parse_cache_mode(rules + ",lastsigma=0");
    pipe.run(p, always.get());
    const double sigma_last = always->log().back().noise_level;
    REQUIRE(sigma_last > 0);
    CHECK(always->log().back().why == "last");
    auto below = parse_cache_mode(rules + ",lastsigma=" + std::to_string(sigma_last * 0.99));
    pipe.run(p, below.get());
    CHECK(below->log().back().why == "last");
    auto above = parse_cache_mode(rules + ",lastsigma=" + std::to_string(sigma_last * 1.01));
    pipe.run(p, above.get());
    CHECK_FALSE(above->log().back().full);
    auto never = parse_cache_mode(rules + ",lastsigma=0,last=0");
    pipe.run(p, never.get());
    CHECK_FALSE(never->log().back().full);
    // Below S no rule makes it full: with a threshold every step's change reaches, every other step is full and the
    // last one is still a reuse; last=0 leaves it to that rule.
    const std::string eager = "freq:thr=1e-9,span=0,skip=0";
    auto reused = parse_cache_mode(eager + ",lastsigma=" + std::to_string(sigma_last * 1.01));
    pipe.run(p, reused.get());
    const auto& log = reused->log();
    for (size_t k = 0; k + 1 < log.size(); ++k) CHECK(log[k].full);
    CHECK_FALSE(log.back().full);
    auto ruled = parse_cache_mode(eager + ",last=0");
    pipe.run(p, ruled.get());
    CHECK(ruled->log().back().why == "change");
    CHECK_THROWS_WITH(parse_cache_mode("freq:lastsigma=-1"), Catch::Contains("lastsigma"));
}

TEST_CASE("freq skip=N: reuse steps whose model output is forecast from the last two computed ones, by hand",
          "[freq][sd]") {
    auto models = deepcache_models();
    Txt2ImgPipeline pipe(models);
    auto p = tiny_params(16, SamplerKind::DDIM);
    c10::InferenceMode guard;
    for (int skip : {1, 2}) {
        INFO("skip=" << skip);
        auto fq = parse_cache_mode("freq:thr=1e30,span=0.5,drift=0,skip=" + std::to_string(skip));
        std::vector<StepRecord> recs;
        pipe.run(p, fq.get(), {}, [&](const StepRecord& r) { recs.push_back(r); });
        const auto& log = fq->log();
        REQUIRE(log.size() == recs.size());
        int forecasts = 0, run = 0;
        std::vector<size_t> computed; // steps whose output a UNet computed (full or shallow)
        for (size_t k = 0; k < log.size(); ++k) {
            if (!log[k].forecast) {
                computed.push_back(k), run = 0;
                continue;
            }
            ++forecasts, ++run;
            CHECK_FALSE(log[k].full);
            CHECK(log[k].macs == 0.0);
            CHECK(run <= skip); // at most `skip` in a row
            REQUIRE(computed.size() >= 2);
            const auto &a = recs[computed[computed.size() - 2]], &b = recs[computed.back()];
            const double h = (recs[k].timestep - b.timestep) / (b.timestep - a.timestep);
            const auto expect = b.noise_pred + (b.noise_pred - a.noise_pred) * h;
            CHECK(test::max_abs_diff(recs[k].noise_pred, expect) <= 1e-6 * expect.abs().max().item<double>());
        }
        CHECK(forecasts > 0);
        CHECK(cache_log_json(*fq)["steps"][computed.back() + 1 < log.size() ? computed.back() + 1 : 0].contains(
            "forecast"));
    }
    // With noiseskip=0 a step into which the sampler injected noise is computed: Euler a never forecasts.
    p.sampler = SamplerKind::EulerAncestral;
    auto fq = parse_cache_mode("freq:thr=1e30,span=0.5,drift=0,skip=2,noiseskip=0");
    pipe.run(p, fq.get());
    for (const auto& s : fq->log()) CHECK_FALSE(s.forecast);
    // Nor does a sampler whose step combines more than one earlier output (LMS: order 4).
    p.sampler = SamplerKind::LMS;
    auto lms = parse_cache_mode("freq:thr=1e30,span=0.5,drift=0,skip=2");
    pipe.run(p, lms.get());
    for (const auto& s : lms->log()) CHECK_FALSE(s.forecast);
    // skip=0 is the shallow path at every reuse.
    auto none = parse_cache_mode("freq:thr=1e30,span=0.5,drift=0,skip=0");
    p.sampler = SamplerKind::DDIM;
    pipe.run(p, none.get());
    for (const auto& s : none->log()) CHECK_FALSE(s.forecast);
    // skipdrift=D: a reuse step is forecast only while the probe's drift is below D (the drift rule itself off here:
    // drift=1e30 still measures it); else the shallow path runs. 0 = no bound.
    auto tight = parse_cache_mode("freq:thr=1e30,span=0.5,drift=1e30,skip=2,skipdrift=1e-12");
    pipe.run(p, tight.get());
    int reuses = 0;
    for (const auto& s : tight->log()) {
        reuses += !s.full;
        if (!s.full) CHECK(s.drift > 0);
        CHECK_FALSE(s.forecast);
    }
    CHECK(reuses > 0);
    auto unbounded = parse_cache_mode("freq:thr=1e30,span=0.5,drift=1e30,skip=2,skipdrift=0");
    pipe.run(p, unbounded.get());
    int forecasts = 0;
    double largest = 0;
    for (const auto& s : unbounded->log()) {
        forecasts += s.forecast;
        if (s.forecast) largest = std::max(largest, s.drift);
    }
    CHECK(forecasts > 0);
    // A bound just under the largest drift of a forecast step takes that step (at least) off the forecasts.
    auto cut =
        parse_cache_mode("freq:thr=1e30,span=0.5,drift=1e30,skip=2,skipdrift=" + std::to_string(largest * 0.999));
    pipe.run(p, cut.get());
    for (const auto& s : cut->log())
        if (s.forecast) CHECK(s.drift < largest * 0.999);
    CHECK_THROWS_WITH(parse_cache_mode("freq:skipdrift=-1"), Catch::Contains("skipdrift must be >= 0"));
}

namespace {
// Records every attention layer a forward runs (its residual), and hands back `given` residuals in place of running.
struct ResidualHook : AttentionHook {
    std::map<std::string, torch::Tensor> given, computed_residuals;
    std::vector<std::string> ran;
    torch::Tensor reuse(const FeatureId& id, const torch::Tensor&) override {
        auto it = given.find(id.name());
        return it == given.end() ? torch::Tensor() : it->second;
    }
    void computed(const FeatureId& id, const torch::Tensor& in, const torch::Tensor& out) override {
        ran.push_back(id.name());
        computed_residuals[id.name()] = out - in;
    }
};
} // namespace

TEST_CASE("freq attn=reuse: the shallow path adds the attention residuals of the last full step", "[freq][sd]") {
    auto models = deepcache_models();
    auto& unet = *models.unet;
    c10::InferenceMode guard;
    torch::manual_seed(5);
    const auto x = torch::randn({2, 4, 8, 8});
    const auto t = torch::tensor(500.0);
    UNetCond cond;
    cond.context = torch::randn({2, 77, unet.config().cross_attention_dim});
    for (int branch = 0; branch < std::min(unet.num_skips(), 3); ++branch) {
        INFO("branch " << branch);
        // The full forward's feature and the residual of every attention layer.
        SkipFeatureCapture f(branch);
        ResidualHook full;
        unet.forward(x, t, cond, &f, {}, &full);
        REQUIRE(f.feature.defined());
        // The shallow path runs exactly the layers shallow_attention_layers() names, in that order.
        ResidualHook plain;
        const auto ref = unet.forward_shallow(x, t, cond, branch, f.feature, {}, &plain);
        std::vector<std::string> listed;
        for (const auto& id : unet.shallow_attention_layers(branch)) listed.push_back(id.name());
        CHECK(plain.ran == listed);
        REQUIRE_FALSE(listed.empty());
        CHECK(torch::equal(ref, unet.forward_shallow(x, t, cond, branch, f.feature)));
        // Handed the full forward's residuals at the same input, the shallow path runs none of them and gives the same
        // output up to the rounding of in + (out - in).
        ResidualHook reused;
        for (const auto& name : listed) reused.given[name] = full.computed_residuals.at(name);
        const auto got = unet.forward_shallow(x, t, cond, branch, f.feature, {}, &reused);
        CHECK(reused.ran.empty());
        CHECK(test::max_abs_diff(got, ref) < 1e-5 * (1.0 + ref.abs().max().item<double>()));
        // A residual of the wrong shape is an error naming the layer.
        ResidualHook bad;
        bad.given[listed[0]] = torch::zeros({1, 1, 1, 1});
        CHECK_THROWS_WITH(unet.forward_shallow(x, t, cond, branch, f.feature, {}, &bad), Catch::Contains(listed[0]));
        // The MAC count of such a step leaves the transformers out.
        const auto b = unet_mac_breakdown(unet.config(), 8, 8, 77);
        MacCount attn;
        for (int k = 1; k <= branch; ++k) attn += b.down_attention[size_t(k)];
        for (int k = 0; k <= branch; ++k) attn += b.up_attention[size_t(k)];
        CHECK(attn.total() > 0);
        CHECK(b.shallow(branch, false).total() == b.shallow(branch).total() - attn.total());
    }
    // In the loop: the shallow reuse steps (not full, not forecast) reuse the residuals and log it; attn=run never
    // does; under injected noise (Euler a) the layers run.
    auto fq = parse_cache_mode("freq:attn=reuse,attnmax=none");
    run_tiny(models, *fq, 20);
    int lite = 0;
    const auto b = unet_mac_breakdown(unet.config(), 8, 8, 77);
    for (const auto& s : fq->log()) {
        INFO("step " << s.step);
        if (s.full || s.forecast) {
            CHECK_FALSE(s.attention_reused);
            continue;
        }
        CHECK(s.attention_reused);
        CHECK(s.macs == double(b.shallow(0, false).total()));
        ++lite;
    }
    CHECK(lite > 0);
    CHECK(cache_log_json(*fq)["steps"][0].contains("attention_reused"));
    // attnmax=N: in each run of shallow steps (forecasts run no layer and do not count), N reuse the residuals, then
    // one runs the layers and records theirs, which the next N reuse. A schedule of long runs (thr huge, max=6, no
    // forecasts) shows the pattern.
    const std::string long_runs = "freq:thr=1e30,max=6,span=0,drift=0,skip=0,attnmax=";
    auto unbounded = parse_cache_mode(long_runs + "none");
    auto unbounded_store = std::make_shared<cache::LatentCache>();
    unbounded->set_store(unbounded_store, "none");
    run_tiny(models, *unbounded, 14);
    const auto layers = int64_t(unet.shallow_attention_layers(0).size());
    for (int n : {1, 2}) {
        INFO("attnmax=" << n);
        auto bounded = parse_cache_mode(long_runs + std::to_string(n));
        auto store = std::make_shared<cache::LatentCache>();
        bounded->set_store(store, "bounded");
        run_tiny(models, *bounded, 14);
        int since = 0, refreshed = 0;
        for (const auto& s : bounded->log()) {
            INFO("step " << s.step);
            if (s.full) {
                since = 0;
                continue;
            }
            CHECK(s.attention_reused == (since < n));
            CHECK(s.macs == double(since < n ? b.shallow(0, false).total() : b.shallow(0).total()));
            refreshed += since >= n;
            since = since < n ? since + 1 : 0;
        }
        CHECK(refreshed > 0);
        // The same full steps either way: each refresh stores one residual per layer more than unbounded reuse.
        CHECK(store->stats().puts - unbounded_store->stats().puts == refreshed * layers);
    }
    CHECK_THROWS_WITH(parse_cache_mode("freq:attnmax=-1"), Catch::Contains("attnmax"));
    auto run = parse_cache_mode("freq:attn=run");
    const auto r_run = run_tiny(models, *run, 20);
    for (const auto& s : run->log()) CHECK_FALSE(s.attention_reused);
    CHECK_FALSE(torch::equal(r_run.latents, run_tiny(models, *fq, 20).latents));
    Txt2ImgPipeline pipe(models);
    auto p = tiny_params(16, SamplerKind::EulerAncestral);
    auto noisy = parse_cache_mode("freq:noise=0,noiseskip=0,drift=0,thr=1e30,span=0.3,attn=reuse");
    pipe.run(p, noisy.get());
    int shallow = 0;
    for (const auto& s : noisy->log()) {
        CHECK_FALSE(s.attention_reused);
        shallow += !s.full && !s.forecast;
    }
    CHECK(shallow > 0);
    CHECK_THROWS_WITH(parse_cache_mode("freq:attn=maybe"), Catch::Contains("attn"));
}

TEST_CASE("eval-cache: a mode against deepcache at the same speed-up, by hand", "[freq][eval]") {
    using nlohmann::json;
    auto mode = [](const std::string& name, double speed, json mean, json min) {
        return json{{"mode", name}, {"speedup_vs_first", speed}, {"psnr_db", mean}, {"psnr_min_db", min}};
    };
    const json modes = json::array({mode("off", 1.0, "inf", "inf"), mode("deepcache:2", 1.7, 38.0, 25.0),
                                    mode("deepcache:4", 2.5, 28.0, 18.0), mode("deepcache:3", 2.1, 33.0, 24.0)});
    // Between deepcache:3 and deepcache:4, half-way: 30.5 dB mean, 21 dB worst.
    const auto mid = train::against_deepcache(modes, mode("freq", 2.3, 35.0, 22.0));
    REQUIRE(mid.is_object());
    CHECK(mid["deepcache_psnr_db"].get<double>() == Approx(30.5));
    CHECK(mid["deepcache_psnr_min_db"].get<double>() == Approx(21.0));
    CHECK(mid["mean_margin_db"].get<double>() == Approx(4.5));
    CHECK(mid["worst_margin_db"].get<double>() == Approx(1.0));
    CHECK(mid["verdict"] == "beats");
    // Worse in the worst image than deepcache at that speed: a loss.
    CHECK(train::against_deepcache(modes, mode("freq", 2.3, 35.0, 20.0))["verdict"] == "loses");
    // Faster than deepcache's fastest interval: set against it; a better mean and a worse worst image leave it open
    // (deepcache at that speed would be worse than its fastest interval by an unknown amount).
    const auto fast = train::against_deepcache(modes, mode("freq", 3.0, 35.0, 17.0));
    CHECK(fast["deepcache_psnr_db"].get<double>() == Approx(28.0));
    CHECK(fast["worst_margin_db"].get<double>() == Approx(-1.0));
    CHECK(fast["verdict"] == "open");
    CHECK(train::against_deepcache(modes, mode("freq", 3.0, 29.0, 19.0))["verdict"] == "beats");
    CHECK_THAT(fast["basis"].get<std::string>(), Catch::Contains("fastest"));
    // Slower than every configuration: set against the best of them (all faster); better than all: open; worse in
    // one measure than one of them: a loss (slowing that one down would not make it worse).
    const auto slow = train::against_deepcache(modes, mode("freq", 1.5, 40.0, 30.0));
    CHECK(slow["deepcache_psnr_db"].get<double>() == Approx(38.0));
    CHECK(slow["deepcache_psnr_min_db"].get<double>() == Approx(25.0));
    CHECK(slow["verdict"] == "open");
    CHECK_THAT(slow["basis"].get<std::string>(), Catch::Contains("slowest"));
    CHECK(train::against_deepcache(modes, mode("freq", 1.5, 40.0, 24.0))["verdict"] == "loses");
    // A configuration beaten by a faster one (a deeper branch, say) is off DeepCache's frontier and does not pull its
    // curve down: at 1.9x the line from deepcache:2 to deepcache:3 (35.5 / 24.5 dB) stands, not the one to the beaten
    // 2.0x point; nor does a line from a slow configuration to a very fast one (deepcache:12) lift it.
    json more = modes;
    more.push_back(mode("deepcache:3,branch=1", 2.0, 30.0, 20.0));
    more.push_back(mode("deepcache:2,branch=1", 1.4, 35.0, 22.0));
    more.push_back(mode("deepcache:2,branch=2", 1.2, 40.0, 27.0));
    more.push_back(mode("deepcache:12", 3.8, 27.0, 17.5));
    const auto env = train::against_deepcache(more, mode("freq", 1.9, 36.0, 24.0));
    CHECK(env["deepcache_psnr_db"].get<double>() == Approx(35.5));
    CHECK(env["deepcache_psnr_min_db"].get<double>() == Approx(24.5));
    CHECK(env["verdict"] == "loses");
    // At 1.4x the configuration measured there is beaten by deepcache:2: the line from 1.2x to 1.7x sets the bar.
    CHECK(train::against_deepcache(more, mode("freq", 1.4, 37.0, 24.0))["deepcache_psnr_db"].get<double>() ==
          Approx(39.2));
    // The frontier itself (what the speed-quality plots draw), slowest first, per measure: the branch=1
    // configurations are beaten by deepcache:2 (1.4x) and deepcache:3 (2.0x); branch=2's slow 1.2x point stays.
    using Pts = std::vector<std::pair<double, double>>;
    CHECK(train::deepcache_frontier(more, "psnr_db") ==
          Pts{{1.2, 40.0}, {1.7, 38.0}, {2.1, 33.0}, {2.5, 28.0}, {3.8, 27.0}});
    CHECK(train::deepcache_frontier(more, "psnr_min_db") ==
          Pts{{1.2, 27.0}, {1.7, 25.0}, {2.1, 24.0}, {2.5, 18.0}, {3.8, 17.5}});
    // Reports label a mode as the user typed it and keep the resolved parameters apart: DeepCache is recognised by
    // the resolved form (a label such as "deepcache" alone, or a preset name, says nothing of the parameters).
    json labelled = json::array(
        {mode("off", 1.0, "inf", "inf"), mode("deepcache", 1.7, 38.0, 25.0), mode("deepcache:4", 2.5, 28.0, 18.0)});
    labelled[1]["resolved"] = "deepcache:2,branch=0";
    labelled[2]["resolved"] = "deepcache:4,branch=0";
    auto freq = mode("freq", 2.1, 35.0, 22.0);
    freq["resolved"] = "freq:tau=0.01,thr=0.7";
    CHECK(train::deepcache_frontier(labelled, "psnr_db") == Pts{{1.7, 38.0}, {2.5, 28.0}});
    CHECK(train::against_deepcache(labelled, freq)["deepcache_psnr_db"].get<double>() == Approx(33.0));
    CHECK(train::against_deepcache(labelled, labelled[1]).is_null());
    CHECK(train::deepcache_frontier(json::array({modes[0]}), "psnr_db").empty());
    // Deepcache itself, the reference, a cell without deepcache: not placed.
    CHECK(train::against_deepcache(modes, modes[2]).is_null());
    CHECK(train::against_deepcache(modes, modes[0]).is_null());
    CHECK(train::against_deepcache(json::array({modes[0]}), mode("freq", 2.3, 35.0, 22.0)).is_null());
}

// ---- typed cache configurations (unet/cache/cache_config.h)
// ----------------------------------------------------------------

TEST_CASE("cache configs: presets, labels, resolved parameters", "[freq][cache_config]") {
    const auto freq = parse_cache_config("freq");
    CHECK(freq.kind() == CacheKind::Freq);
    CHECK(freq.label == "freq");
    CHECK(freq.canonical() == FreqParams{}.describe());
    CHECK(make_cache_controller(freq)->label() == "freq");
    CHECK(make_cache_controller(freq)->spec() == parse_cache_mode("freq")->spec());
    // The presets set their keys; keys after a preset override it.
    const auto fast = parse_cache_config("freq:fast");
    CHECK(fast.label == "freq:fast");
    CHECK(std::get<FreqParams>(fast.params).drift == 0.4);
    CHECK(std::get<FreqParams>(parse_cache_config("freq:quality").params).drift == 0.3);
    const auto tuned = parse_cache_config("freq:fast,thr=0.6");
    CHECK(std::get<FreqParams>(tuned.params).thr == 0.6);
    CHECK(std::get<FreqParams>(tuned.params).drift == 0.4);
    CHECK(make_cache_controller(tuned)->label() == "freq:fast,thr=0.6");
    CHECK_THROWS_AS(parse_cache_config("freq:rapid"), ParamError);
    // The report's resolved parameters, from the key table.
    const auto j = parse_cache_config("freq:thr=0.6").params_json();
    CHECK(j["thr"] == 0.6);
    CHECK(j["max"] == "none");
    CHECK(j["extrapolate"] == true);
    CHECK(j["probe"] == "raw");
    CHECK(!j.contains("profile"));
    const auto dc = parse_cache_config("deepcache:3,branch=1");
    CHECK(dc.kind() == CacheKind::DeepCache);
    CHECK(std::get<DeepCacheParams>(dc.params).interval == 3);
    CHECK(dc.branch() == 1);
    CHECK(dc.canonical() == "deepcache:3,branch=1");
    CHECK(parse_cache_config("deepcache:interval=4").canonical() == "deepcache:4");
    CHECK(parse_cache_config("off").kind() == CacheKind::Off);
    // A key given twice is an error, not the last one winning.
    CHECK_THROWS_WITH(parse_cache_config("freq:thr=0.5,thr=0.6"), Catch::Contains("thr is given twice"));
    CHECK_THROWS_WITH(parse_cache_config("deepcache:3,interval=4"), Catch::Contains("interval is given twice"));
    CHECK_THROWS_WITH(parse_cache_config("deepcache:3,branch=1,branch=2"), Catch::Contains("branch is given twice"));
    // `--cache help` comes from the tables: every preset and key with its range and default.
    const std::string help = cache_help();
    for (const auto& k : freq_keys())
        CHECK(help.find("    " + k.name + " (" + k.values + ", default ") != std::string::npos);
    for (const auto& k : deepcache_keys()) CHECK(help.find("    " + k.name + " (") != std::string::npos);
    for (const auto& [name, keys] : freq_presets())
        CHECK(help.find("freq:" + name + "  -  freq:" + keys) != std::string::npos);
    CHECK(help.find("advanced:") != std::string::npos);
}

TEST_CASE("cache configs: every key out of its range is one line naming the mode, the key and the range",
          "[freq][cache_config]") {
    auto sweep = [](const std::string& prefix, const std::string& key, const std::string& values, bool integer) {
        std::vector<std::string> bad = {"", "x", "-1e9", "1e999", "nan", "maybe", "1,"};
        if (integer) bad.insert(bad.end(), {"1.5", "999999999"});
        for (const auto& v : bad) {
            const std::string mode = prefix + key + "=" + v;
            INFO(mode);
            try {
                (void)parse_cache_config(mode);
                FAIL("accepted");
            } catch (const ParamError& e) {
                const std::string m = e.what();
                CHECK(e.field() == "cache");
                CHECK(m.find('\n') == std::string::npos);
                CHECK(m.size() < 600);
                CHECK(m.find(key) != std::string::npos);
                if (v != "1,") CHECK(m.find(key + " must be ") != std::string::npos);
                CHECK(m.find("freq[:tau=") != std::string::npos); // the forms, on the same line
            }
        }
    };
    for (const auto& k : freq_keys())
        if (k.name != "profile") sweep("freq:", k.name, k.values, k.values.rfind("an integer", 0) == 0);
    sweep("deepcache:", "interval", "", true);
    sweep("deepcache:3,", "branch", "", true);
    CHECK_THROWS_WITH(parse_cache_config("freq:profile="), Catch::Contains("profile must be a file"));
    CHECK_THROWS_WITH(parse_cache_config("deepcache:3,branch=99"),
                      Catch::Contains("branch must be an integer in [0, 11]"));
}

TEST_CASE("cache configs: a branch past the model's skip connections is a usage error before any work",
          "[freq][cache_config]") {
    auto m = deepcache_models();
    const int n = m.unet->num_skips();
    REQUIRE(n >= 2);
    check_cache_config(parse_cache_config("deepcache:2,branch=" + std::to_string(n - 1)), *m.unet);
    // A configuration past this model's last skip (the parser's own bound is that of the largest supported UNet).
    CacheConfig past;
    FreqParams fp;
    fp.branch = n;
    past.params = fp;
    past.label = "freq:branch=" + std::to_string(n);
    try {
        check_cache_config(past, *m.unet);
        FAIL("accepted");
    } catch (const ParamError& e) {
        CHECK(e.field() == "cache");
        CHECK_THAT(e.detail(),
                   Catch::Contains("this UNet has " + std::to_string(n) + " skip connections: branch must be"));
    }
}

TEST_CASE("cache mode lists split the same way in anchor-sd and anchor-text", "[freq][cache_config]") {
    using cache::modes::split_mode_list;
    using V = std::vector<std::string>;
    CHECK(split_mode_list("off;freq:fast;deepcache:3,branch=1") == V{"off", "freq:fast", "deepcache:3,branch=1"});
    CHECK(split_mode_list("off,dual:decoded=reuse,masked=reuse") == V{"off", "dual:decoded=reuse,masked=reuse"});
    CHECK(split_mode_list("off,anchor+unmask=confidence,threshold=0.9") ==
          V{"off", "anchor+unmask=confidence,threshold=0.9"});
    CHECK(split_mode_list("freq:fast,thr=0.6;off") == V{"freq:fast,thr=0.6", "off"});
    CHECK(cache::modes::split_mode_lists({"off", "freq,thr=0.6"}) == V{"off", "freq:thr=0.6"});
    // The field a list's error names ("accepted" when there is none).
    auto refused_as = [](const std::string& list) -> std::string {
        try {
            (void)split_mode_list(list);
        } catch (const ParamError& e) {
            return e.field();
        }
        return "accepted";
    };
    for (const std::string bad : {"", "off,,freq", "off;;freq", "off,", ";off"}) CHECK(refused_as(bad) == "compare");
    const auto list = parse_cache_list("off;freq:fast,thr=0.6,deepcache:2");
    REQUIRE(list.size() == 3);
    CHECK(list[1].label == "freq:fast,thr=0.6");
    CHECK(list[2].label == "deepcache:2");
}

TEST_CASE("docs/caching.md holds the presets and key tables of the code", "[freq][cache_config][docs]") {
    std::ifstream f(std::string(ANCHOR_SOURCE_DIR) + "/docs/caching.md");
    REQUIRE(f);
    const std::string doc((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    // The text between a pair of markers must be the code's tables; else the code's are written where FAIL says.
    auto check = [&](const std::string& begin, const std::string& end, const std::string& code, const char* file) {
        INFO(begin);
        const auto b = doc.find(begin), e = doc.find(end);
        REQUIRE(b != std::string::npos);
        REQUIRE(e != std::string::npos);
        if (doc.substr(b + begin.size(), e - b - begin.size()) != code) { // the tables to paste between the markers
            const auto path = std::filesystem::temp_directory_path() / file;
            std::ofstream(path) << code;
            FAIL("docs/caching.md's cache tables differ from the code's: the code's are in " << path.string());
        }
    };
    check("<!-- cache tables: unet::cache_docs_tables() -->\n", "<!-- end of the cache tables -->", cache_docs_tables(),
          "anchor_cache_tables.md");
    check("<!-- text cache tables: text::cache_docs_tables() -->\n", "<!-- end of the text cache tables -->",
          text::cache_docs_tables(), "anchor_text_cache_tables.md");
}

TEST_CASE("anchor-sd: every cache key out of its range, and bad mode lists, exit 2 with one line",
          "[freq][cache_config][cli]") {
    auto one_line_error = [](const test::ProgramResult& r, const std::string& option, const std::string& words) {
        INFO(r.output);
        CHECK(r.exit_code == 2);
        const auto at = r.output.find("error: " + option + ": ");
        REQUIRE(at != std::string::npos);
        const std::string line = r.output.substr(at, r.output.find('\n', at) - at);
        CHECK(line.find(words) != std::string::npos);
        CHECK(r.output.find("error:", at + 1) == std::string::npos);
        CHECK(r.output.size() - at < 600); // no help text after it
    };
    const std::string out = (std::filesystem::temp_directory_path() / "anchor_cache_sweep.png").string();
    auto sd = [&](std::vector<std::string> args) {
        args.insert(args.begin(), {"-p", "x", "--steps", "2", "-o", out});
        return test::run_program(test::sd_bin(), args);
    };
    for (const auto& k : freq_keys())
        if (k.name != "profile") one_line_error(sd({"--cache", "freq:" + k.name + "=-1e9"}), "--cache", k.name);
    one_line_error(sd({"--cache", "deepcache:-1"}), "--cache", "interval");
    one_line_error(sd({"--cache", "deepcache:3,branch=99"}), "--cache", "branch must be an integer in [0, 11]");
    one_line_error(sd({"--cache", "freq:drift=0.3,drift=0.4"}), "--cache", "drift is given twice");
    one_line_error(sd({"--compare", "off,,freq"}), "--compare", "an empty cache mode");
    one_line_error(sd({"--compare", ""}), "--compare", "at least one cache mode");
    one_line_error(sd({"--compare", "off;freq:thr=-1"}), "--compare", "thr must be > 0");
    const auto dc = sd({"--deepcache", "-1"});
    INFO(dc.output);
    CHECK(dc.exit_code == 2);
    CHECK_THAT(dc.output, Catch::Contains("error: --deepcache: expected an interval >= 1 (0 = off), got -1"));
    CHECK(!std::filesystem::exists(out));
    const auto help = test::run_program(test::sd_bin(), {"--cache", "help"});
    CHECK(help.exit_code == 0);
    CHECK_THAT(help.output, Catch::Contains("freq:fast  -  freq:drift=0.4"));
    CHECK_THAT(help.output, Catch::Contains("advanced:"));
}

// Cancellation points around the loop (issue 56): a run calls its progress callback before the prompt encoding,
// after every step and before the VAE decode, so a callback that throws stops a job in each long phase.
TEST_CASE("a run reports the encode, step and decode phases, and a throwing callback stops it there", "[sd][cancel]") {
    namespace fs = std::filesystem;
    const fs::path dir = test::golden("sd/deepcache");
    auto cfg = sdgolden::read_json_file(dir / "config.json");
    auto models = sdgolden::load_run_models(dir, cfg);
    Txt2ImgPipeline pipe(models);
    const auto p = tiny_params(3, SamplerKind::DDIM);
    c10::InferenceMode guard;
    std::vector<int> phases, steps; // ProgressPhase as int: Catch prints a vector of ints
    pipe.run(p, nullptr, [&](const ProgressInfo& pi) {
        phases.push_back(int(pi.phase));
        steps.push_back(pi.step);
    });
    const int enc = int(ProgressPhase::Encode), step = int(ProgressPhase::Step), dec = int(ProgressPhase::Decode);
    REQUIRE(phases == std::vector<int>{enc, step, step, step, dec});
    REQUIRE(steps == std::vector<int>{0, 1, 2, 3, 3});
    for (const auto stop_at : {ProgressPhase::Encode, ProgressPhase::Decode}) {
        int unet_steps = 0;
        REQUIRE_THROWS_WITH(pipe.run(
                                p, nullptr,
                                [&](const ProgressInfo& pi) {
                                    if (pi.phase == stop_at) throw std::runtime_error("cancelled");
                                },
                                [&](const StepRecord&) { ++unet_steps; }),
                            "cancelled");
        REQUIRE(unet_steps == (stop_at == ProgressPhase::Encode ? 0 : 3));
    }
}

TEST_CASE("the cache decision reads one device value per step: counted in the log and the report", "[freq][sd][d2h]") {
    namespace fs = std::filesystem;
    const fs::path dir = test::golden("sd/deepcache");
    auto cfg = sdgolden::read_json_file(dir / "config.json");
    auto models = sdgolden::load_run_models(dir, cfg);
    // host_read (unet/cache/shallow_probe.h) counts on the CPU what a GPU would wait for: the probe's r_k, the timestep
    // and the drift residual of freq travel together; DeepCache reads r_k alone.
    for (const char* spec : {"freq", "freq:fast", "deepcache:3"}) {
        INFO(spec);
        auto c = parse_cache_mode(spec);
        run_tiny(models, *c, 10);
        REQUIRE(c->log().size() == 10);
        for (const auto& s : c->log()) CHECK(s.d2h_scalars == 1);
        const auto j = cache_log_json(*c);
        CHECK(j.at("d2h_scalars_per_step") == 1);
        CHECK(j.at("steps")[3].at("d2h_scalars") == 1);
    }
    // One transfer for several values, each read back as it was.
    const auto before = host_reads();
    const auto v = host_read({torch::scalar_tensor(0.25, torch::kFloat64), torch::scalar_tensor(3.0f)});
    CHECK(host_reads() == before + 1);
    CHECK(v == std::vector<double>{0.25, 3.0});
}
