#include "cache/io/error.h"
#include "cache/io/safetensors.h"
#include "tests/scheduler_golden.h"
#include "tests/test_util.h"
#include "unet/pipeline/infotext.h"
#include "unet/samplers/scheduler.h"

#include <catch2/catch.hpp>
#include <torch/version.h>

#include <cmath>
#include <fstream>
#include <functional>

using namespace anchor;
using namespace anchor::unet;

namespace {

const char* kRuns[] = {"ddim_10",
                       "ddim_20",
                       "ddim_50",
                       "pndm_10",
                       "pndm_20",
                       "pndm_50",
                       "euler_10",
                       "euler_20",
                       "euler_50",
                       "euler_ancestral_10",
                       "euler_ancestral_20",
                       "euler_ancestral_50",
                       "dpmpp_2m_10",
                       "dpmpp_2m_20",
                       "dpmpp_2m_50",
                       "dpmpp_2m_karras_10",
                       "dpmpp_2m_karras_20",
                       "dpmpp_2m_karras_50",
                       "lms_10",
                       "lms_20",
                       "lms_50"};

// max over elements of |a - g| - (atol + rtol |g|): <= 0 means within tolerance.
double excess(const torch::Tensor& a, const torch::Tensor& g, double atol, double rtol) {
    auto a64 = a.to(torch::kFloat64), g64 = g.to(torch::kFloat64);
    return ((a64 - g64).abs() - (atol + rtol * g64.abs())).max().item<double>();
}

// A sink that CHECKs every tensor (within atol + rtol * |golden|) and fact of one run, counting the tensors and
// keeping the largest absolute difference.
test::SchedulerGoldenSink checking_sink(const std::string& run, int& tensors, double& max_abs) {
    test::SchedulerGoldenSink sink;
    sink.tensor = [&tensors, &max_abs, run](const std::string& what, const torch::Tensor& a, const torch::Tensor& g,
                                            double atol, double rtol) {
        INFO(run << " " << what);
        REQUIRE(a.sizes() == g.sizes());
        CHECK(excess(a, g, atol, rtol) <= 0.0);
        max_abs = std::max(max_abs, test::max_abs_diff(a, g));
        ++tensors;
    };
    sink.fact = [run](const std::string& what, bool ok, const std::string& detail) {
        INFO(run << " " << what << ": " << detail);
        CHECK(ok);
    };
    return sink;
}

// Every run of `dir` through checking_sink: at least `min_tensors` compared per run; returns the worst |diff|.
double check_runs(const std::filesystem::path& dir, const std::vector<std::string>& runs, int min_tensors) {
    double worst = 0.0;
    for (const auto& run : runs) {
        DYNAMIC_SECTION(run) {
            double run_abs = 0.0;
            int tensors = 0;
            test::run_scheduler_golden(dir, run, checking_sink(run, tensors, run_abs));
            CHECK(tensors > min_tensors);
            WARN(run << ": max |diff| = " << run_abs << " over " << tensors << " tensors");
            worst = std::max(worst, run_abs);
        }
    }
    return worst;
}

} // namespace

TEST_CASE("scheduler golden loops match diffusers 0.27.2 (21 runs)", "[schedulers][golden]") {
    check_runs(test::golden("sd/schedulers"), std::vector<std::string>(std::begin(kRuns), std::end(kRuns)), 20);
}

TEST_CASE("DDPM, Heun, KDPM2, KDPM2 ancestral, LCM and TCD loops match diffusers 0.27.2 (schedulers_more)",
          "[schedulers][golden]") {
    // tests/golden/sd/schedulers_more: 4, 10 and 20 steps each; Heun / KDPM2 list both model calls of a step, the
    // ancestral ones draw from the case's generator, LCM also compares each step's denoised estimate.
    std::vector<std::string> runs;
    for (const char* s : {"ddpm", "heun", "kdpm2", "kdpm2_ancestral", "lcm", "tcd"})
        for (const char* n : {"_4", "_10", "_20"}) runs.push_back(std::string(s) + n);
    check_runs(test::golden("sd/schedulers_more"), runs, 8);
    // Other step counts, spacings, Karras sigmas, v_prediction, original_inference_steps and TCD's gamma, another
    // noise and generator seed (anchorcache_cases/generate/gen_sched_more.py).
    check_runs(test::golden("sd/anchorcache_cases/schedulers_more_seed123"),
               {"ddpm_7", "ddpm_trailing_5", "ddpm_v_9", "heun_7", "heun_karras_9", "heun_linspace_6", "heun_v_5",
                "kdpm2_7", "kdpm2_karras_8", "kdpm2_trailing_6", "kdpm2_ancestral_5", "kdpm2_ancestral_karras_9",
                "kdpm2_ancestral_linspace_12", "lcm_3", "lcm_orig20_6", "lcm_v_8", "tcd_5", "tcd_gamma0_4",
                "tcd_gamma1_6"},
               8);
}

TEST_CASE("scheduler loops with another noise seed, batch and ancestral generator seed match diffusers",
          "[schedulers][golden]") {
    // tests/golden/sd/anchorcache_cases/schedulers_seed123: [2, 4, 6, 8] noise from seed 5, Euler ancestral's generator
    // seeded 123 (config.json ancestral_generator_seed and each run's step_kwargs), step counts the public set lacks.
    const std::filesystem::path dir = test::golden("sd/anchorcache_cases/schedulers_seed123");
    check_runs(dir,
               {"euler_ancestral_7", "euler_ancestral_30", "ddim_13", "pndm_9", "euler_15", "dpmpp_2m_12",
                "dpmpp_2m_karras_25", "lms_11"},
               15);
    // The seed is the case's: a generator text and ancestral_generator_seed that disagree are refused, naming both.
    const auto scratch = test::scratch_dir("sched_seed_conflict");
    for (const auto& e : std::filesystem::directory_iterator(dir))
        std::filesystem::copy_file(e.path(), scratch / e.path().filename());
    auto cfg = test::read_json_file(dir / "config.json");
    cfg["ancestral_generator_seed"] = 8;
    std::ofstream(std::filesystem::path(scratch) / "config.json") << cfg.dump();
    test::SchedulerGoldenSink quiet;
    quiet.tensor = [](const std::string&, const torch::Tensor&, const torch::Tensor&, double, double) {};
    quiet.fact = [](const std::string&, bool, const std::string&) {};
    CHECK_THROWS_WITH(test::run_scheduler_golden(scratch, "euler_ancestral_7", quiet),
                      Catch::Contains("seeds 123") && Catch::Contains("is 8"));
}

TEST_CASE("schedule matches diffusers' float32 betas and alphas_cumprod exactly", "[schedulers]") {
    auto common = SafeTensorsFile::open(test::golden("sd/schedulers/common.safetensors"));
    SchedulerConfig cfg;
#if TORCH_VERSION_MAJOR >= 2
    // LibTorch 2's float32 linspace rounds some betas differently in the last bit than torch 1.13, which made the
    // reference: within float32 rounding there, bit for bit on 1.x.
    CHECK(torch::allclose(make_betas(cfg), common->tensor("betas"), 1e-6, 0.0));
    CHECK(torch::allclose(make_alphas_cumprod(cfg), common->tensor("alphas_cumprod"), 1e-5, 0.0));
#else
    CHECK(torch::equal(make_betas(cfg), common->tensor("betas")));
    CHECK(torch::equal(make_alphas_cumprod(cfg), common->tensor("alphas_cumprod")));
#endif
    cfg.beta_schedule = BetaSchedule::Linear;
    auto lin = make_betas(cfg);
    CHECK(lin[0].item<float>() == Approx(0.00085f));
    CHECK(lin[999].item<float>() == Approx(0.012f));
    cfg.beta_schedule = BetaSchedule::SquaredCosCapV2;
    auto cos = make_betas(cfg);
    CHECK(cos.max().item<float>() <= 0.999f);
    CHECK(cos[0].item<float>() > 0.0f);
    // an unknown schedule is refused where it is read, naming the file, the field and the choices
    CHECK_THROWS_WITH(SchedulerConfig::from_json_text(R"({"beta_schedule": "cubic"})", "sched.json"),
                      Catch::Contains("sched.json") && Catch::Contains("beta_schedule") &&
                          Catch::Contains("squaredcos_cap_v2"));
}

TEST_CASE("sampler names drive parsing and errors list the valid names", "[schedulers]") {
    CHECK(sampler_table().size() == 18);
    for (const auto& [name, kind] : sampler_table()) {
        CHECK(sampler_from_string(name) == kind);
        CHECK(sampler_name(kind) == name);
    }
    // Aliases name a sampler of the table and never shadow one of its names.
    for (const auto& [alias, kind] : sampler_alias_table()) {
        INFO(alias);
        CHECK(sampler_from_string(alias) == kind);
        for (const auto& [name, k] : sampler_table()) CHECK(name != alias);
    }
    CHECK(sampler_from_string("dpm++2m") == SamplerKind::DPMPP2M);
    CHECK(sampler_from_string("dpm_2_ancestral") == SamplerKind::KDPM2Ancestral);
    try {
        sampler_from_string("heun_pp");
        FAIL("expected ParamError");
    } catch (const ParamError& e) {
        CHECK(e.field() == "sampler");
        std::string msg = e.what();
        CHECK(msg.find("heun_pp") != std::string::npos);
        CHECK(msg.find("dpmpp_2m_karras") != std::string::npos);
        CHECK(msg.find("dpm2_a") != std::string::npos);
    }
    CHECK(sampler_from_class_name("DPMSolverMultistepScheduler", true) == SamplerKind::DPMPP2MKarras);
    CHECK(sampler_from_class_name("DPMSolverMultistepScheduler", false) == SamplerKind::DPMPP2M);
    CHECK(sampler_from_class_name("HeunDiscreteScheduler") == SamplerKind::Heun);
    CHECK(sampler_from_class_name("KDPM2AncestralDiscreteScheduler") == SamplerKind::KDPM2Ancestral);
    CHECK(sampler_from_class_name("TCDScheduler") == SamplerKind::TCD);
    CHECK_THROWS_AS(sampler_from_class_name("NoSuchScheduler"), Error);
}

TEST_CASE("SchedulerConfig reads diffusers' scheduler_config.json", "[schedulers]") {
    const auto dir = test::scratch_dir("sched_cfg");
    const std::string path = dir + "/scheduler_config.json";
    {
        std::ofstream o(path);
        o << R"({"_class_name": "EulerDiscreteScheduler", "_diffusers_version": "0.27.2", "beta_end": 0.012,
                 "beta_schedule": "scaled_linear", "beta_start": 0.00085, "clip_sample": false,
                 "num_train_timesteps": 1000, "prediction_type": "v_prediction", "set_alpha_to_one": false,
                 "steps_offset": 1, "timestep_spacing": "trailing", "trained_betas": null,
                 "use_karras_sigmas": true})";
    }
    auto c = SchedulerConfig::from_json_file(path);
    CHECK(c.class_name == "EulerDiscreteScheduler");
    CHECK(c.prediction_type == PredictionType::VPrediction);
    CHECK(c.timestep_spacing == TimestepSpacing::Trailing);
    CHECK(c.use_karras_sigmas);
    CHECK(c.steps_offset == 1);
    CHECK_THROWS_AS(SchedulerConfig::from_json_file(dir + "/missing.json"), Error);
    CHECK_THROWS_AS(SchedulerConfig::from_json_text("{\"beta_start\": \"x\"}"), Error);
    CHECK_THROWS_AS(SchedulerConfig::from_json_text("[1, 2"), Error);
    // Missing fields keep SD 1.5's defaults.
    auto d = SchedulerConfig::from_json_text("{}");
    CHECK(d.beta_schedule == BetaSchedule::ScaledLinear);
    CHECK(d.steps_offset == 1);
}

TEST_CASE("timestep spacings follow diffusers' numpy formulas", "[schedulers]") {
    SchedulerConfig cfg;
    cfg.timestep_spacing = TimestepSpacing::Trailing;
    auto ddim = make_scheduler(SamplerKind::DDIM, cfg);
    ddim->set_timesteps(10);
    CHECK(ddim->timesteps() == std::vector<double>{999, 899, 799, 699, 599, 499, 399, 299, 199, 99});
    cfg.timestep_spacing = TimestepSpacing::Linspace;
    auto ddim_l = make_scheduler(SamplerKind::DDIM, cfg);
    ddim_l->set_timesteps(4);
    CHECK(ddim_l->timesteps() == std::vector<double>{999, 666, 333, 0});
    // Euler keeps linspace timesteps unrounded (float32) and interpolates sigma.
    auto euler = make_scheduler(SamplerKind::Euler, cfg);
    euler->set_timesteps(4);
    CHECK(euler->timesteps()[1] == Approx(666.0));
    CHECK(euler->init_noise_sigma() == Approx(euler->sigmas()[0])); // linspace: sigma_max, not sqrt(s^2 + 1)
    CHECK_THROWS_WITH(SchedulerConfig::from_json_text(R"({"timestep_spacing": "bogus"})"),
                      Catch::Contains("timestep_spacing") && Catch::Contains("linspace"));
    try {
        make_scheduler(SamplerKind::DDIM)->set_timesteps(0);
        FAIL("expected ParamError");
    } catch (const ParamError& e) {
        CHECK(e.field() == "steps");
    }
    CHECK_THROWS_AS(make_scheduler(SamplerKind::DDIM)->step(torch::zeros({1}), 0, torch::zeros({1}), nullptr), Error);
}

TEST_CASE("multistep samplers reject out-of-order steps", "[schedulers]") {
    for (auto kind : {SamplerKind::PNDM, SamplerKind::DPMPP2M, SamplerKind::LMS, SamplerKind::DPMPP2MSDE,
                      SamplerKind::DPMPP2S, SamplerKind::UniPC, SamplerKind::DEIS}) {
        auto s = make_scheduler(kind);
        s->set_timesteps(10);
        auto x = torch::randn({1, 4, 2, 2});
        s->step(x * 0.1, 0, x, nullptr);
        CHECK_THROWS_AS(s->step(x * 0.1, 2, x, nullptr), Error);
    }
}

// DDIM with eta = 1 over all 1000 training steps is ancestral DDPM (Song et al. 2021, sec. 4.1): the step must equal
// the DDPM posterior mean (Ho et al. 2020, eq. 7) plus sqrt(beta_tilde) z with the generator's z.
TEST_CASE("DDIM eta=1 with consecutive timesteps is the DDPM posterior step", "[schedulers]") {
    SchedulerConfig cfg;
    cfg.steps_offset = 0;
    auto s = make_scheduler(SamplerKind::DDIM, cfg, 1.0);
    s->set_timesteps(1000);
    const auto abar = make_alphas_cumprod(cfg).to(torch::kFloat64);
    const auto x = torch::randn({1, 4, 4, 4});
    const auto eps = torch::randn({1, 4, 4, 4});
    for (int i : {0, 500, 998}) {
        const int t = static_cast<int>(s->timestep(i));
        auto gen = at::make_generator<at::CPUGeneratorImpl>(123);
        auto twin = at::make_generator<at::CPUGeneratorImpl>(123);
        auto got = s->step(eps, i, x, &gen).to(torch::kFloat64);
        const double a_t = abar[t].item<double>(), a_p = abar[t - 1].item<double>();
        const double beta_t = 1 - a_t / a_p;
        auto x64 = x.to(torch::kFloat64), e64 = eps.to(torch::kFloat64);
        auto x0 = (x64 - std::sqrt(1 - a_t) * e64) / std::sqrt(a_t);
        auto mean = std::sqrt(a_p) * beta_t / (1 - a_t) * x0 + std::sqrt(a_t / a_p) * (1 - a_p) / (1 - a_t) * x64;
        const double var = (1 - a_p) / (1 - a_t) * beta_t;
        auto z = torch::randn({1, 4, 4, 4}, twin, torch::kFloat32).to(torch::kFloat64);
        auto want = mean + std::sqrt(var) * z;
        INFO("t=" << t);
        CHECK(test::max_abs_diff(got, want) < 1e-4);
    }
}

// v-prediction must give the same trajectory as epsilon when the model's v is computed from the same eps and x0.
TEST_CASE("v_prediction parameterisation agrees with epsilon", "[schedulers]") {
    // (PNDM is left out: diffusers combines raw v outputs of different samples before converting, so its v and eps
    // trajectories legitimately differ.)
    for (auto kind : {SamplerKind::DDIM, SamplerKind::Euler, SamplerKind::DPMPP2M, SamplerKind::LMS,
                      SamplerKind::DPMPP2S, SamplerKind::UniPC, SamplerKind::DEIS}) {
        SchedulerConfig ce, cv;
        cv.prediction_type = PredictionType::VPrediction;
        auto se = make_scheduler(kind, ce), sv = make_scheduler(kind, cv);
        se->set_timesteps(8);
        sv->set_timesteps(8);
        torch::manual_seed(3);
        auto x = torch::randn({1, 2, 3, 3}) * se->init_noise_sigma();
        auto xv = x.clone();
        const auto abar = make_alphas_cumprod(ce).to(torch::kFloat64);
        for (int i = 0; i < se->num_loop_steps(); ++i) {
            auto eps = torch::sin(x * 3.0 + double(i)) * 0.5; // any smooth "model"
            // scaled input x_in = sqrt(abar) x0 + sqrt(1-abar) eps (VP) -> x0 -> v = sqrt(abar) eps - sqrt(1-abar) x0.
            const double t = se->timestep(i);
            const double a = abar[static_cast<int64_t>(std::llround(t))].item<double>();
            auto x_in = se->scale_model_input(x, i);
            auto x0 = (x_in - std::sqrt(1 - a) * eps) / std::sqrt(a);
            auto v = std::sqrt(a) * eps - std::sqrt(1 - a) * x0;
            x = se->step(eps, i, x, nullptr);
            xv = sv->step(v, i, xv, nullptr);
        }
        INFO(sampler_name(kind));
        CHECK(test::max_abs_diff(x, xv) < 1e-4 * (1 + x.abs().max().item<double>()));
    }
}

// ---- noise schedules and Euler ancestral eta ---------------------------------------------------------------------

namespace {

nlohmann::json noise_schedule_refs() {
    // tests/golden/sd/anchorcache_cases/generate/gen_noise_schedules.py: karras from diffusers 0.27.2 itself,
    // exponential / sgm_uniform / simple from a Python reimplementation of k-diffusion's and ComfyUI's formulas.
    return test::read_json_file(test::golden("sd/anchorcache_cases/noise_schedules/noise_schedules.json"));
}

SchedulerConfig with_schedule(NoiseSchedule s, TimestepSpacing spacing = TimestepSpacing::Leading) {
    SchedulerConfig c;
    c.schedule = s;
    c.timestep_spacing = spacing;
    return c;
}

// max |a_k - b_k| / max(|b_k|, 1e-3)
double max_rel(const std::vector<double>& a, const std::vector<double>& b) {
    REQUIRE(a.size() == b.size());
    double m = 0;
    for (size_t k = 0; k < a.size(); ++k) m = std::max(m, std::abs(a[k] - b[k]) / std::max(std::abs(b[k]), 1e-3));
    return m;
}

// The gen_sched.py fake model through a whole loop, generator seeded `gen_seed`, from `noise`.
torch::Tensor fake_loop(Scheduler& s, int steps, const torch::Tensor& noise, uint64_t gen_seed) {
    s.set_timesteps(steps);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(gen_seed);
    auto x = noise * s.init_noise_sigma();
    for (int i = 0; i < s.num_loop_steps(); ++i) {
        auto eps = 0.1 * s.scale_model_input(x, i) + 0.01 * s.timestep(i) / 1000;
        x = s.step(eps, i, x, &gen);
    }
    return x;
}

} // namespace

TEST_CASE("noise schedule names drive parsing and give A1111's labels", "[schedulers]") {
    CHECK(noise_schedule_table().size() == 5);
    for (const auto& [name, s] : noise_schedule_table()) CHECK(noise_schedule_name(s) == name);
    CHECK(noise_schedule_label(NoiseSchedule::Karras) == "Karras");
    CHECK(noise_schedule_label(NoiseSchedule::SgmUniform) == "SGM Uniform");
    CHECK(noise_schedule_label(NoiseSchedule::Default) == "Automatic");
    CHECK_THROWS_WITH(enum_from_string(noise_schedule_table(), "bogus", "schedule"),
                      Catch::Contains("bogus") && Catch::Contains("sgm_uniform") && Catch::Contains("karras"));
}

TEST_CASE("noise schedules match diffusers' karras and the reference exponential, sgm_uniform and simple",
          "[schedulers]") {
    const auto refs = noise_schedule_refs();
    int checked = 0;
    for (const auto& r : refs["schedules"]) {
        const auto name = r["schedule"].get<std::string>();
        const auto source = r["source"].get<std::string>();
        const int n = r["steps"].get<int>();
        const auto want_sig = r["sigmas"].get<std::vector<double>>();
        const auto want_t = r["timesteps"].get<std::vector<double>>();
        const auto s = enum_from_string(noise_schedule_table(), name, "schedule");
        INFO(name << " " << n << " steps, reference " << source);
        const auto lv = schedule_levels(s, SchedulerConfig{}, n);
        CHECK(max_rel(lv.sigmas, want_sig) < 1e-6);
        if (!r["timesteps_rounded"].get<bool>()) {
            CHECK(max_rel(lv.timesteps, want_t) < 1e-6);
        }
        // Every sigma sampler steps on them (float32, then 0): Euler / Euler a / LMS with the fractional timesteps,
        // DPM++ 2M with them rounded.
        std::vector<double> want_sig0 = want_sig;
        want_sig0.push_back(0.0);
        for (auto kind : {SamplerKind::Euler, SamplerKind::EulerAncestral, SamplerKind::LMS, SamplerKind::DPMPP2M}) {
            INFO(sampler_name(kind));
            auto sch = make_scheduler(kind, with_schedule(s));
            sch->set_timesteps(n);
            CHECK(max_rel(sch->sigmas(), want_sig0) < 1e-6);
            const auto got_t = sch->timesteps();
            REQUIRE(got_t.size() == want_t.size());
            for (size_t k = 0; k < got_t.size(); ++k) {
                if (kind == SamplerKind::DPMPP2M)
                    CHECK(got_t[k] == std::nearbyint(r["timesteps_rounded"].get<bool>() ? want_t[k] : lv.timesteps[k]));
                else if (!r["timesteps_rounded"].get<bool>())
                    CHECK(got_t[k] == Approx(want_t[k]).epsilon(1e-6));
            }
        }
        // The timestep samplers run on the rounded timesteps; PNDM repeats the second one as diffusers' PLMS does.
        auto ddim = make_scheduler(SamplerKind::DDIM, with_schedule(s));
        ddim->set_timesteps(n);
        std::vector<double> rounded;
        for (double t : lv.timesteps) rounded.push_back(std::nearbyint(t));
        CHECK(ddim->timesteps() == rounded);
        auto pndm = make_scheduler(SamplerKind::PNDM, with_schedule(s));
        pndm->set_timesteps(n);
        auto plms = rounded;
        if (n > 1) plms.insert(plms.begin() + 1, rounded[1]);
        CHECK(pndm->timesteps() == plms);
        ++checked;
    }
    CHECK(checked == 19); // 4 step counts x 5 references, less diffusers Euler's degenerate 1-step linspace
    // dpmpp_2m_karras is dpmpp_2m on karras, and the diffusers Euler reference with 'linspace' spacing gives the
    // same sigmas as the model-range karras of 'leading' (the spacing only changes init_noise_sigma).
    auto a = make_scheduler(SamplerKind::DPMPP2MKarras),
         b = make_scheduler(SamplerKind::DPMPP2M, with_schedule(NoiseSchedule::Karras));
    a->set_timesteps(13);
    b->set_timesteps(13);
    CHECK(a->timesteps() == b->timesteps());
    CHECK(a->sigmas() == b->sigmas());
}

TEST_CASE("the default schedule is each sampler's own spacing, and use_karras_sigmas selects karras", "[schedulers]") {
    for (const auto& [name, kind] : sampler_table()) {
        if (kind == SamplerKind::DPMPP2MKarras) continue;
        INFO(name);
        auto unset = make_scheduler(kind), dflt = make_scheduler(kind, with_schedule(NoiseSchedule::Default));
        unset->set_timesteps(17);
        dflt->set_timesteps(17);
        CHECK(unset->timesteps() == dflt->timesteps());
        CHECK(unset->sigmas() == dflt->sigmas());
        CHECK(effective_schedule(kind, SchedulerConfig{}) == NoiseSchedule::Default);
    }
    auto cfg =
        SchedulerConfig::from_json_text(R"({"_class_name": "EulerDiscreteScheduler", "use_karras_sigmas": true})");
    CHECK(effective_schedule(SamplerKind::Euler, cfg) == NoiseSchedule::Karras);
    CHECK(effective_schedule(SamplerKind::DDIM, cfg) == NoiseSchedule::Karras);
    cfg.schedule = NoiseSchedule::Simple; // a given schedule wins over the file's switch
    CHECK(effective_schedule(SamplerKind::Euler, cfg) == NoiseSchedule::Simple);
    CHECK(effective_schedule(SamplerKind::DPMPP2MKarras, SchedulerConfig{}) == NoiseSchedule::Karras);
}

TEST_CASE("Karras sigmas: a config's use_karras_sigmas is diffusers' of that class, --schedule karras the model's",
          "[schedulers]") {
    // diffusers' EulerDiscreteScheduler converts the sigmas of its spaced timesteps: with 'leading' spacing at 6 steps
    // the range is [sigma(1), sigma(831)], not the model's [sigma(0), sigma(999)]; so are its timesteps
    // (_sigma_to_t) and init_noise_sigma. DPMSolverMultistepScheduler takes the model's range.
    auto cfg = SchedulerConfig::from_json_text(
        R"({"_class_name": "EulerDiscreteScheduler", "use_karras_sigmas": true, "timestep_spacing": "leading",
            "steps_offset": 1, "sigma_min": null, "sigma_max": null})");
    const auto full = torch::sqrt((1 - make_alphas_cumprod(cfg)) / make_alphas_cumprod(cfg));
    auto euler = make_scheduler(SamplerKind::Euler, cfg);
    euler->set_timesteps(6);
    CHECK(euler->timesteps().front() == 831.0);
    CHECK(euler->timesteps().back() == 1.0);
    CHECK(std::abs(euler->sigmas().front() - full[831].item<double>()) < 1e-6);
    CHECK(std::abs(euler->sigmas()[5] - full[1].item<double>()) < 1e-7);
    const double s0 = euler->sigmas().front();
    CHECK(std::abs(euler->init_noise_sigma() - std::sqrt(s0 * s0 + 1)) < 1e-5);
    // --schedule karras: the model's range (A1111 / k-diffusion), whatever the spacing.
    auto given = cfg;
    given.schedule = NoiseSchedule::Karras;
    auto model_range = make_scheduler(SamplerKind::Euler, given);
    model_range->set_timesteps(6);
    CHECK(model_range->timesteps().front() == Approx(999.0));
    CHECK(std::abs(model_range->sigmas().front() - full[999].item<double>()) < 1e-5);
    // sigma_min / sigma_max of the config bound diffusers' range.
    auto bounded =
        SchedulerConfig::from_json_text(R"({"use_karras_sigmas": true, "sigma_min": 0.1, "sigma_max": 10.0})");
    auto b = make_scheduler(SamplerKind::Euler, bounded);
    b->set_timesteps(5);
    CHECK(b->sigmas().front() == Approx(10.0));
    CHECK(b->sigmas()[4] == Approx(0.1));
    // LMS as Euler; DPM-Solver++ the model's range.
    auto lms = make_scheduler(SamplerKind::LMS, cfg);
    lms->set_timesteps(6);
    CHECK(std::abs(lms->sigmas().front() - full[831].item<double>()) < 1e-6);
    auto dpm = make_scheduler(SamplerKind::DPMPP2M, cfg);
    dpm->set_timesteps(6);
    CHECK(dpm->timesteps().front() == 999.0);
}

TEST_CASE("scheduler settings this engine does not implement are named, never run as something else", "[schedulers]") {
    CHECK(unsupported_scheduler_settings(R"({"algorithm_type": "dpmsolver++", "solver_order": 2,
        "lambda_min_clipped": "-inf", "variance_type": null, "thresholding": false})",
                                         SamplerKind::DPMPP2M)
              .empty());
    auto u = unsupported_scheduler_settings(R"({"algorithm_type": "sde-dpmsolver++"})", SamplerKind::DPMPP2M);
    REQUIRE(u.size() == 1);
    CHECK_THAT(u[0], Catch::Contains("algorithm_type") && Catch::Contains("sde-dpmsolver++"));
    CHECK(unsupported_scheduler_settings(R"({"solver_order": 4})", SamplerKind::DPMPP2MKarras).size() == 1);
    CHECK(unsupported_scheduler_settings(R"({"interpolation_type": "log_linear"})", SamplerKind::Euler).size() == 1);
    CHECK(unsupported_scheduler_settings(R"({"thresholding": true})", SamplerKind::DDIM).size() == 1);
    CHECK(unsupported_scheduler_settings(R"({"skip_prk_steps": false})", SamplerKind::PNDM).size() == 1);
    // Another class's key that diffusers' from_config ignores for this one, and inert unknown keys.
    CHECK(unsupported_scheduler_settings(R"({"skip_prk_steps": false, "algorithm_type": "deis"})", SamplerKind::Euler)
              .empty());
    CHECK(unsupported_scheduler_settings(R"({"use_exponential_sigmas": false, "foo": null})", SamplerKind::Euler)
              .empty());
    u = unsupported_scheduler_settings(R"({"use_exponential_sigmas": true})", SamplerKind::Euler);
    REQUIRE(u.size() == 1);
    CHECK_THAT(u[0], Catch::Contains("use_exponential_sigmas"));
}

TEST_CASE("DDIM on a custom schedule steps to the next timestep of its list", "[schedulers]") {
    // Song et al. 2021 eq. 12 with eta = 0: x_prev = sqrt(a_prev) x0 + sqrt(1 - a_prev) eps, a_prev = abar at the
    // next listed timestep (final_alpha = abar[0] after the last, set_alpha_to_one false).
    SchedulerConfig cfg = with_schedule(NoiseSchedule::Karras);
    auto s = make_scheduler(SamplerKind::DDIM, cfg);
    s->set_timesteps(6);
    const auto abar = make_alphas_cumprod(cfg).to(torch::kFloat64);
    const auto ts = s->timesteps();
    torch::manual_seed(5);
    const auto x = torch::randn({1, 2, 3, 3}), eps = torch::randn({1, 2, 3, 3});
    for (int i = 0; i < 6; ++i) {
        const double a_t = abar[int64_t(ts[size_t(i)])].item<double>();
        const double a_p = i + 1 < 6 ? abar[int64_t(ts[size_t(i) + 1])].item<double>() : abar[0].item<double>();
        auto x64 = x.to(torch::kFloat64), e64 = eps.to(torch::kFloat64);
        auto want = std::sqrt(a_p) * (x64 - std::sqrt(1 - a_t) * e64) / std::sqrt(a_t) + std::sqrt(1 - a_p) * e64;
        INFO("step " << i << " t=" << ts[size_t(i)]);
        CHECK(test::max_abs_diff(s->step(eps, i, x, nullptr).to(torch::kFloat64), want) < 1e-5);
    }
}

TEST_CASE("Euler ancestral eta: k-diffusion's ancestral step, 1 is today's sampler and 0 the Euler step",
          "[schedulers]") {
    const auto refs = noise_schedule_refs();
    const auto noise = torch::randn({1, 2, 3, 3}, at::make_generator<at::CPUGeneratorImpl>(11));
    const uint64_t gen_seed = refs["generator_seed"].get<uint64_t>();
    for (const auto& loop : refs["euler_ancestral"]) {
        const auto s = enum_from_string(noise_schedule_table(), loop["schedule"].get<std::string>(), "schedule");
        const double eta = loop["eta"].get<double>();
        INFO(loop["source"].get<std::string>() << ": " << noise_schedule_name(s) << ", eta " << eta);
        auto sch = make_scheduler(SamplerKind::EulerAncestral, with_schedule(s), eta);
        const auto got = fake_loop(*sch, loop["steps"].get<int>(), noise, gen_seed);
        const auto want = torch::tensor(loop["final"].get<std::vector<float>>()).reshape({1, 2, 3, 3});
        CHECK(excess(got, want, 1e-5, 1e-5) <= 0.0);
    }
    for (auto s : {NoiseSchedule::Default, NoiseSchedule::Karras, NoiseSchedule::SgmUniform}) {
        INFO(noise_schedule_name(s));
        // eta = 1 given is the default, to the bit.
        auto unset = make_scheduler(SamplerKind::EulerAncestral, with_schedule(s));
        auto one = make_scheduler(SamplerKind::EulerAncestral, with_schedule(s), 1.0);
        CHECK(torch::equal(fake_loop(*unset, 9, noise, 4), fake_loop(*one, 9, noise, 4)));
        // eta = 0: sigma_up = 0 and sigma_down = sigma_to, the deterministic Euler step on the same sigmas (both draw
        // one noise tensor per step, so the generator makes no difference).
        auto zero = make_scheduler(SamplerKind::EulerAncestral, with_schedule(s), 0.0);
        auto euler = make_scheduler(SamplerKind::Euler, with_schedule(s));
        const auto a = fake_loop(*zero, 9, noise, 4), b = fake_loop(*euler, 9, noise, 77);
        CHECK(test::max_abs_diff(a, b) <= 1e-6 * (1 + b.abs().max().item<double>()));
        // eta > 0 draws on the generator: another seed, another result.
        auto half = make_scheduler(SamplerKind::EulerAncestral, with_schedule(s), 0.5);
        auto half2 = make_scheduler(SamplerKind::EulerAncestral, with_schedule(s), 0.5);
        CHECK_FALSE(torch::equal(fake_loop(*half, 9, noise, 4), fake_loop(*half2, 9, noise, 5)));
    }
}

TEST_CASE("eta and schedule errors name the field and the valid choices", "[schedulers]") {
    auto field_of = [](const std::function<void()>& f) -> std::string {
        try {
            f();
        } catch (const ParamError& e) {
            return e.field() + ": " + e.detail();
        }
        return "(no error)";
    };
    for (auto kind :
         {SamplerKind::Euler, SamplerKind::DPMPP2M, SamplerKind::DPMPP2MKarras, SamplerKind::LMS, SamplerKind::PNDM}) {
        const auto msg = field_of([&] { make_scheduler(kind, {}, 0.5); });
        INFO(sampler_name(kind) << ": " << msg);
        CHECK(msg.rfind("eta: ", 0) == 0);
        CHECK(msg.find(sampler_name(kind)) != std::string::npos);
        CHECK(msg.find("ddim and euler_a") != std::string::npos);
        CHECK_FALSE(effective_eta(kind, std::nullopt).has_value());
    }
    for (double bad : {-0.1, std::nan("")}) {
        CHECK(field_of([&] { make_scheduler(SamplerKind::DDIM, {}, bad); }).find("eta: must be a finite number >= 0") ==
              0);
        CHECK(field_of([&] { make_scheduler(SamplerKind::EulerAncestral, {}, bad); }).rfind("eta: ", 0) == 0);
    }
    CHECK(*effective_eta(SamplerKind::DDIM, std::nullopt) == 0.0);
    CHECK(*effective_eta(SamplerKind::EulerAncestral, std::nullopt) == 1.0);
    CHECK(*effective_eta(SamplerKind::EulerAncestral, 0.25) == 0.25);
    for (auto s :
         {NoiseSchedule::Default, NoiseSchedule::Exponential, NoiseSchedule::SgmUniform, NoiseSchedule::Simple}) {
        const auto msg = field_of([&] { make_scheduler(SamplerKind::DPMPP2MKarras, with_schedule(s)); });
        INFO(msg);
        CHECK(msg.rfind("schedule: ", 0) == 0);
        CHECK(msg.find(noise_schedule_name(s)) != std::string::npos);
        CHECK(msg.find("dpmpp_2m") != std::string::npos);
    }
    CHECK_NOTHROW(make_scheduler(SamplerKind::DPMPP2MKarras, with_schedule(NoiseSchedule::Karras)));
    CHECK_THROWS_AS(schedule_levels(NoiseSchedule::Default, {}, 10), Error);
}

TEST_CASE("every sampler runs a whole loop on every schedule, also from a begin index", "[schedulers]") {
    const auto noise = torch::randn({1, 2, 3, 3}, at::make_generator<at::CPUGeneratorImpl>(3));
    for (const auto& [sname, s] : noise_schedule_table()) {
        for (const auto& [kname, kind] : sampler_table()) {
            if (kind == SamplerKind::DPMPP2MKarras && s != NoiseSchedule::Karras) continue;
            INFO(kname << " on " << sname);
            // LCM and TCD run on their distillation timesteps only, flow-matching Euler on its shifted sigmas.
            if ((kind == SamplerKind::LCM || kind == SamplerKind::TCD || kind == SamplerKind::FlowMatchEuler) &&
                s != NoiseSchedule::Default) {
                CHECK_THROWS_AS(make_scheduler(kind, with_schedule(s))->set_timesteps(10), ParamError);
                continue;
            }
            auto sch = make_scheduler(kind, with_schedule(s));
            const auto x = fake_loop(*sch, 10, noise, 9);
            CHECK(torch::isfinite(x).all().item<bool>());
            // img2img's truncated loop: begin at step 3 (loop step 3 * order) and run to the end in order.
            sch->set_timesteps(10);
            const int b = 3 * sch->order();
            sch->set_begin_index(b);
            auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
            auto y = sch->add_noise(torch::zeros_like(noise), noise, b);
            for (int i = b; i < sch->num_loop_steps(); ++i)
                y = sch->step(0.1 * sch->scale_model_input(y, i), i, y, &gen);
            CHECK(torch::isfinite(y).all().item<bool>());
        }
    }
}

// ---- the DPM-Solver family: dpmpp_2m_sde, dpmpp_2s, unipc, deis ---------------------------------------------------

TEST_CASE("DPM-Solver family: class names, algorithm types and solver settings pick and configure the sampler",
          "[schedulers]") {
    CHECK(sampler_from_class_name("DPMSolverMultistepScheduler", false, "sde-dpmsolver++") == SamplerKind::DPMPP2MSDE);
    CHECK(sampler_from_class_name("DPMSolverMultistepScheduler", true, "sde-dpmsolver++") == SamplerKind::DPMPP2MSDE);
    CHECK(sampler_from_class_name("DPMSolverMultistepScheduler", true, "dpmsolver++") == SamplerKind::DPMPP2MKarras);
    // An algorithm no row runs is the plain row, whose settings check then names it.
    CHECK(sampler_from_class_name("DPMSolverMultistepScheduler", false, "sde-dpmsolver") == SamplerKind::DPMPP2M);
    CHECK(sampler_from_class_name("DPMSolverSinglestepScheduler") == SamplerKind::DPMPP2S);
    CHECK(sampler_from_class_name("UniPCMultistepScheduler") == SamplerKind::UniPC);
    CHECK(sampler_from_class_name("DEISMultistepScheduler") == SamplerKind::DEIS);
    for (const char* name : {"dpmpp_2m_sde", "dpmpp_2s", "unipc", "deis"})
        CHECK(sampler_name(sampler_from_string(name)) == name);

    // Implemented values and the ones diffusers runs the same; the others named with the implemented ones.
    CHECK(unsupported_scheduler_settings(R"({"algorithm_type": "sde-dpmsolver++", "solver_order": 1,
        "solver_type": "heun", "final_sigmas_type": "sigma_min", "lower_order_final": false, "euler_at_final": true})",
                                         SamplerKind::DPMPP2MSDE)
              .empty());
    auto u = unsupported_scheduler_settings(R"({"algorithm_type": "sde-dpmsolver++", "solver_order": 3})",
                                            SamplerKind::DPMPP2MSDE);
    REQUIRE(u.size() == 1);
    CHECK_THAT(u[0], Catch::Contains("solver_order = 3") && Catch::Contains("dpmpp_2m_sde"));
    CHECK(unsupported_scheduler_settings(R"({"algorithm_type": "dpmsolver++"})", SamplerKind::DPMPP2MSDE).size() == 1);
    CHECK(unsupported_scheduler_settings(R"({"solver_order": 3})", SamplerKind::DPMPP2S).size() == 1);
    CHECK(unsupported_scheduler_settings(R"({"algorithm_type": "dpmsolver"})", SamplerKind::DPMPP2S).size() == 1);
    CHECK(unsupported_scheduler_settings(R"({"solver_order": 5, "solver_type": "midpoint", "predict_x0": false,
        "disable_corrector": [0, 2], "solver_p": null})",
                                         SamplerKind::UniPC)
              .empty());
    CHECK(unsupported_scheduler_settings(R"({"thresholding": true})", SamplerKind::UniPC).size() == 1);
    CHECK(unsupported_scheduler_settings(R"({"algorithm_type": "dpmsolver++", "solver_type": "bh2",
        "solver_order": 3})",
                                         SamplerKind::DEIS)
              .empty());
    CHECK(unsupported_scheduler_settings(R"({"solver_order": 4})", SamplerKind::DEIS).size() == 1);

    // The settings travel from the JSON to the sampler; a value outside its range is refused by the factory too.
    auto cfg = SchedulerConfig::from_json_text(R"({"solver_order": 3, "lower_order_final": false,
        "final_sigmas_type": "sigma_min", "solver_type": "heun", "euler_at_final": true, "predict_x0": false,
        "disable_corrector": [1]})");
    CHECK(cfg.solver.solver_order == 3);
    CHECK(cfg.solver.lower_order_final == false);
    CHECK(cfg.solver.final_sigmas_type == FinalSigmasType::SigmaMin);
    CHECK(cfg.solver.solver_type == SolverType::Heun);
    CHECK(cfg.solver.euler_at_final == true);
    CHECK(cfg.solver.predict_x0 == false);
    CHECK(cfg.solver.disable_corrector == std::vector<int>{1});
    CHECK_THROWS_AS(SchedulerConfig::from_json_text(R"({"solver_type": "rk4"})"), Error);
    CHECK_THROWS_AS(SchedulerConfig::from_json_text(R"({"solver_order": 0})"), Error);
    CHECK_THROWS_AS(make_scheduler(SamplerKind::DPMPP2MSDE, cfg), ParamError);
    CHECK_THROWS_AS(make_scheduler(SamplerKind::DPMPP2S, cfg), ParamError);
    CHECK(make_scheduler(SamplerKind::UniPC, cfg)->earlier_outputs() == 3);
    CHECK(make_scheduler(SamplerKind::DEIS, cfg)->earlier_outputs() == 2);
    // The DPM-Solver family's model input is the sample itself and init_noise_sigma 1; the final sigma is 0 for
    // DPM-Solver (final_sigmas_type zero) and sigma(0) for UniPC / DEIS.
    for (auto kind : {SamplerKind::DPMPP2MSDE, SamplerKind::DPMPP2S, SamplerKind::UniPC, SamplerKind::DEIS}) {
        auto s = make_scheduler(kind);
        s->set_timesteps(5);
        INFO(sampler_name(kind));
        CHECK(s->init_noise_sigma() == 1.0);
        const bool dpm = kind == SamplerKind::DPMPP2MSDE || kind == SamplerKind::DPMPP2S;
        CHECK((s->sigmas().back() == 0.0) == dpm);
    }
}

TEST_CASE("DPM-Solver family: the solver settings match diffusers 0.27.2 (solver_configs)", "[schedulers][golden]") {
    // tests/golden/sd/anchorcache_cases/solver_configs (generate/gen_solver_configs.py): orders 1 and 3, heun / bh1,
    // sigma_min, lower_order_final false, euler_at_final, predict_x0 false, disable_corrector, Karras, v-prediction.
    const std::filesystem::path dir = test::golden("sd/anchorcache_cases/solver_configs");
    std::vector<std::string> runs;
    const auto cfg = test::read_json_file(dir / "config.json");
    for (const auto& r : cfg.at("runs")) runs.push_back(r.at("file").get<std::string>());
    CHECK(runs.size() >= 20);
    check_runs(dir, runs, 10);
}

TEST_CASE("DPM++ 2M SDE: the injected noise carried forward leaves the deterministic trajectory", "[schedulers]") {
    // With a model whose data prediction is a fixed X0 (eps = (x - alpha X0) / sigma_vp), every SDE step is
    // x' = decay x + alpha_t (1 - e^{-2h}) X0 + sigma_t sqrt(1 - e^{-2h}) z (the second-order term vanishes: D1 = 0),
    // decay = sigma_t / sigma_s e^{-h}. Less the injected noise it must follow y' = decay y + alpha_t (1 - e^{-2h}) X0.
    auto sched = make_scheduler(SamplerKind::DPMPP2MSDE);
    sched->set_timesteps(6);
    const auto sig = sched->sigmas();
    torch::manual_seed(12);
    const auto X0 = torch::randn({1, 4, 3, 3});
    auto x = torch::randn({1, 4, 3, 3});
    auto y = x.clone();
    auto gen = at::make_generator<at::CPUGeneratorImpl>(6);
    auto vp = [](double s) { return std::pair{1 / std::sqrt(s * s + 1), s / std::sqrt(s * s + 1)}; };
    for (int i = 0; i < 6; ++i) {
        const auto [as, ss] = vp(sig[size_t(i)]);
        const auto [at, st] = vp(sig[size_t(i) + 1]);
        const double h = std::log(at / st) - std::log(as / ss);
        const double decay = st / ss * std::exp(-h);
        x = sched->step((x - as * X0) / ss, i, x, &gen);
        y = decay * y + at * (1 - std::exp(-2 * h)) * X0;
        INFO("step " << i);
        if (i < 5) {
            REQUIRE(sched->injected_noise().defined());
            CHECK(sched->injected_carry() > 0);
            CHECK(torch::allclose(x - sched->injected_noise(), y, 1e-4, 1e-4));
        } else {
            // The last step reaches sigma 0: no noise, the data prediction itself.
            CHECK(torch::allclose(x, X0, 1e-5, 1e-5));
        }
    }
    sched->set_timesteps(6);
    CHECK_FALSE(sched->injected_noise().defined());
    // The generator drives the noise: the same seed gives the same run, another seed another one.
    auto run = [&](uint64_t seed) {
        auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
        sched->set_timesteps(4);
        auto z = torch::ones({1, 4, 2, 2});
        for (int i = 0; i < 4; ++i) z = sched->step(0.1 * z, i, z, &g);
        return z;
    };
    CHECK(torch::equal(run(3), run(3)));
    CHECK_FALSE(torch::allclose(run(3), run(4)));
}

TEST_CASE("UniPC corrects the sample with the new output before predicting", "[schedulers]") {
    // disable_corrector naming every step turns UniPC into its predictor alone (UniP-2, Zhao et al. sec. 3.1); the
    // corrector changes the trajectory from the second step on but not the first.
    SchedulerConfig plain, no_corr;
    no_corr.solver.disable_corrector = {0, 1, 2, 3, 4, 5};
    auto a = make_scheduler(SamplerKind::UniPC, plain), b = make_scheduler(SamplerKind::UniPC, no_corr);
    a->set_timesteps(6);
    b->set_timesteps(6);
    torch::manual_seed(5);
    auto xa = torch::randn({1, 4, 3, 3});
    auto xb = xa.clone();
    for (int i = 0; i < 6; ++i) {
        xa = a->step(torch::sin(xa), i, xa, nullptr);
        xb = b->step(torch::sin(xb), i, xb, nullptr);
        INFO("step " << i);
        if (i == 0)
            CHECK(torch::equal(xa, xb));
        else
            CHECK_FALSE(torch::allclose(xa, xb, 1e-6, 1e-6));
    }
}

TEST_CASE("DPM-Solver family: A1111 names where A1111 has the same algorithm, ours elsewhere", "[schedulers][png]") {
    CHECK(a1111_sampler(SamplerKind::DPMPP2MSDE).sampler == "DPM++ 2M SDE");
    CHECK(a1111_sampler(SamplerKind::UniPC).sampler == "UniPC");
    // A1111's "DPM++ 2S a" is ancestral, and A1111 has no DEIS: our names, read back as themselves.
    CHECK(a1111_sampler(SamplerKind::DPMPP2S).sampler == "dpmpp_2s");
    CHECK(sampler_from_a1111("dpmpp_2s", "Automatic") == SamplerKind::DPMPP2S);
    CHECK(sampler_from_a1111("deis") == SamplerKind::DEIS);
    CHECK_FALSE(sampler_from_a1111("DPM++ 2S a").has_value());
    // "DPM++ 2M SDE" on an explicit schedule type is ours on that schedule; A1111's "Automatic" for it is
    // exponential, which the old one-field name with Karras is not.
    auto ip = image_parameters_from_infotext("a cat\nSteps: 9, Sampler: DPM++ 2M SDE, Schedule type: Karras, Seed: 1",
                                             "test");
    CHECK(ip.sampler == SamplerKind::DPMPP2MSDE);
    CHECK(ip.schedule == NoiseSchedule::Karras);
    ip = image_parameters_from_infotext("a cat\nSteps: 9, Sampler: DPM++ 2M SDE, Schedule type: Exponential", "test");
    CHECK(ip.sampler == SamplerKind::DPMPP2MSDE);
    CHECK(ip.schedule == NoiseSchedule::Exponential);
    ip = image_parameters_from_infotext("a cat\nSteps: 9, Sampler: UniPC, Schedule type: Automatic", "test");
    CHECK(ip.sampler == SamplerKind::UniPC);
    CHECK_FALSE(ip.schedule.has_value());
}
