// The samplers added for issue 59 free-running on the tiny SD pipeline (tests/golden/sd/deepcache's model), with the
// caches off, DeepCache and freq: every model call is a loop step, the output is finite, and DeepCache's full steps
// fall on its interval over the model calls (Heun / KDPM2 run the cache on both calls of a step).
#include "tests/sd_pipeline_golden.h"
#include "tests/test_cli_util.h"
#include "tests/test_util.h"
#include "tests/tiny_sd_run.h"
#include "unet/cache/cache_config.h"
#include "unet/pipeline/infotext.h"

#include <catch2/catch.hpp>

#include <fstream>

using namespace anchor;
using namespace anchor::unet;

TEST_CASE("the samplers of issue 59 run txt2img on the tiny model with the caches off, deepcache, freq",
          "[sd][schedulers][pipeline][freq]") {
    // ddpm, heun, dpm2, dpm2_a, lcm, tcd, and the DPM-Solver family (dpmpp_2m_sde with fresh noise every step from
    // the pipeline's generator, dpmpp_2s, unipc, deis): a finite image under every cache mode, DeepCache's full
    // calls on its interval, and with the cache off every call full and the same seed giving the same image.
    auto models = test::deepcache_models();
    Txt2ImgPipeline pipe(models);
    c10::InferenceMode guard;
    const int steps = 6;
    for (const char* name :
         {"ddpm", "heun", "dpm2", "dpm2_a", "lcm", "tcd", "dpmpp_2m_sde", "dpmpp_2s", "unipc", "deis"}) {
        const SamplerKind kind = sampler_from_string(name);
        const bool two_calls =
            kind == SamplerKind::Heun || kind == SamplerKind::KDPM2 || kind == SamplerKind::KDPM2Ancestral;
        const int calls = two_calls ? 2 * steps - 1 : steps;
        const auto p = test::tiny_params(steps, kind);
        for (const char* mode : {"off", "deepcache:3", "freq"}) {
            INFO(name << " with " << mode);
            auto ctl = parse_cache_mode(mode);
            std::vector<bool> full;
            auto r = pipe.run(p, ctl.get(), {},
                              [&](const StepRecord&) { full.push_back(ctl ? ctl->last_step_was_full() : true); });
            CHECK(int(full.size()) == calls);
            CHECK(r.total_steps == calls);
            CHECK(torch::isfinite(r.final_latents).all().item<bool>());
            CHECK(torch::isfinite(r.image).all().item<bool>());
            if (std::string(mode) == "deepcache:3")
                for (int i = 0; i < calls; ++i) CHECK(full[size_t(i)] == (i % 3 == 0));
            if (std::string(mode) == "off") {
                CHECK(r.full_steps == calls);
                auto again = parse_cache_mode(mode);
                CHECK(torch::equal(pipe.run(p, again.get()).final_latents, r.final_latents));
            }
        }
    }
}

TEST_CASE("sampler names: ours, A1111's and stable-diffusion.cpp's / ComfyUI's name the same sampler",
          "[schedulers][png]") {
    CHECK(parse_sampler_name("heun", "--sampler") == SamplerKind::Heun);
    CHECK(parse_sampler_name("Heun", "--sampler") == SamplerKind::Heun);
    CHECK(parse_sampler_name("DPM2", "--sampler") == SamplerKind::KDPM2);
    CHECK(parse_sampler_name("DPM2 a", "--sampler") == SamplerKind::KDPM2Ancestral);
    CHECK(parse_sampler_name("dpm_2_ancestral", "--sampler") == SamplerKind::KDPM2Ancestral);
    CHECK(parse_sampler_name("LCM", "--sampler") == SamplerKind::LCM);
    CHECK(parse_sampler_name("DDPM", "--sampler") == SamplerKind::DDPM);
    CHECK(parse_sampler_name("TCD", "--sampler") == SamplerKind::TCD);
    CHECK(parse_sampler_name("DPM++ 2M Karras", "--sampler") == SamplerKind::DPMPP2MKarras);
    CHECK(parse_sampler_name("dpm++2m", "--sampler") == SamplerKind::DPMPP2M);
    CHECK(parse_sampler_name("Euler a", "--sampler") == SamplerKind::EulerAncestral);
    CHECK(sampler_from_any_name("dpm++2m karras", "") == SamplerKind::DPMPP2MKarras); // sd.cpp's infotext
    CHECK(sampler_from_any_name("DPM++ 2M", "Karras") == SamplerKind::DPMPP2MKarras);
    CHECK_FALSE(sampler_from_any_name("DPM++ 3M SDE", "").has_value());
    try {
        parse_sampler_name("nope", "--sampler");
        FAIL("expected ParamError");
    } catch (const ParamError& e) {
        CHECK(e.field() == "--sampler");
        CHECK_THAT(std::string(e.what()),
                   Catch::Contains("'nope'") && Catch::Contains("dpm2_a") && Catch::Contains("DPM++ 2M Karras"));
    }
    // Every sampler's A1111 name reads back as itself, in an infotext too.
    for (const auto& [name, k] : sampler_table()) {
        INFO(name);
        const auto a = a1111_sampler(k);
        CHECK(sampler_from_any_name(a.sampler, a.schedule_type) == k);
        const auto ip = image_parameters_from_infotext(
            "a cat\nSteps: 4, Sampler: " + a.sampler + ", Schedule type: " + a.schedule_type + ", Seed: 1", "x");
        CHECK(ip.sampler == k);
    }
    // Our JSON record takes an alias as well (a record written by another tool's name).
    CHECK(image_parameters_from_record({{"sampler", "dpm2"}}, "r").sampler == SamplerKind::KDPM2);
    CHECK(image_parameters_from_record({{"sampler", "k_dpm_2_a"}}, "r").sampler == SamplerKind::KDPM2Ancestral);
}

TEST_CASE("LCM / TCD timesteps: the distillation schedule of the config, and its limits", "[schedulers]") {
    SchedulerConfig cfg;
    cfg.original_inference_steps = 50;
    auto lcm = make_scheduler(SamplerKind::LCM, cfg);
    lcm->set_timesteps(4);
    CHECK(lcm->timesteps() == std::vector<double>{999, 759, 499, 259});
    // K = 20 distillation steps of N / K = 50: (1..20) * 50 - 1 from the top, indices floor(i * 20 / 3).
    cfg.original_inference_steps = 20;
    lcm = make_scheduler(SamplerKind::LCM, cfg);
    lcm->set_timesteps(3);
    CHECK(lcm->timesteps() == std::vector<double>{999, 699, 349});
    CHECK_THROWS_AS(lcm->set_timesteps(21), ParamError);
    CHECK_THROWS_AS(make_scheduler(SamplerKind::TCD, cfg, 1.5), ParamError);
    // gamma = 0: TCD draws no noise, the same run twice with different generators is equal.
    auto tcd = make_scheduler(SamplerKind::TCD, cfg, 0.0);
    tcd->set_timesteps(3);
    const auto x = torch::randn({1, 4, 4, 4}, at::make_generator<at::CPUGeneratorImpl>(1));
    auto g1 = at::make_generator<at::CPUGeneratorImpl>(2), g2 = at::make_generator<at::CPUGeneratorImpl>(3);
    auto a = x.clone(), b = x.clone();
    for (int i = 0; i < 3; ++i) {
        a = tcd->step(0.1 * a, i, a, &g1);
        CHECK(tcd->denoised().defined());
    }
    tcd->set_timesteps(3);
    for (int i = 0; i < 3; ++i) b = tcd->step(0.1 * b, i, b, &g2);
    CHECK(torch::equal(a, b));
    CHECK_FALSE(tcd->injected_noise().defined());
}

TEST_CASE("anchor-sd --sampler takes our names, A1111's and stable-diffusion.cpp's, and records ours",
          "[cli][sd][schedulers]") {
    const auto dir = test::scratch_dir("cli_sd_sampler_aliases");
    const std::vector<std::pair<std::string, std::string>> runs = {
        {"heun", "heun"}, {"DPM2 a", "dpm2_a"}, {"dpm2", "dpm2"}, {"dpm++2m", "dpmpp_2m"},
        {"LCM", "lcm"},   {"ddpm", "ddpm"},     {"tcd", "tcd"},   {"DPM++ 2M Karras", "dpmpp_2m_karras"}};
    int k = 0;
    for (const auto& [given, recorded] : runs) {
        const std::string png = dir + "/s" + std::to_string(k++) + ".png";
        auto r = test::run_program(test::sd_bin(), {"-m", "assets/models/sd15-tiny-random", "-p", "a cat", "--steps",
                                                    "2", "-o", png, "--threads", "1", "--sampler", given});
        INFO(given << ": " << r.output);
        REQUIRE(r.exit_code == 0);
        std::ifstream f(png + ".json");
        CHECK(nlohmann::json::parse(f)["sampler"] == recorded);
    }
    auto bad = test::run_program(
        test::sd_bin(), {"-m", "assets/models/sd15-tiny-random", "-p", "a", "--sampler", "DPM9", "-o", dir + "/x.png"});
    CHECK(bad.exit_code == 2);
    CHECK(bad.output.find("DPM9") != std::string::npos);
    CHECK(bad.output.find("dpm2_a") != std::string::npos);
}
