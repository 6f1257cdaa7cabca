// The scheduler golden loop (tests/golden/sd/schedulers/README.md), shared by tests/test_schedulers.cpp and the
// golden_runner checker: fake model eps = 0.1 * model_input + 0.01 * t / 1000, free-running from the stored initial
// noise, every step's model_input and prev_sample compared to the reference.
#pragma once

#include "cache/io/error.h"
#include "cache/io/safetensors.h"
#include "unet/samplers/scheduler.h"

#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <regex>
#include <set>
#include <sstream>
#include <string>

namespace anchor::test {

struct SchedulerGoldenSink {
    // Elementwise |actual - golden| <= atol + rtol * |golden|.
    std::function<void(const std::string& what, const torch::Tensor& actual, const torch::Tensor& golden, double atol,
                       double rtol)>
        tensor;
    // Exact / structural facts (timesteps, step counts).
    std::function<void(const std::string& what, bool ok, const std::string& detail)> fact;
};

inline nlohmann::json read_json_file(const std::filesystem::path& p) {
    std::ifstream in(p);
    if (!in) throw Error("cannot open '" + p.string() + "'");
    nlohmann::json j;
    in >> j;
    return j;
}

// True when `run_json` describes a scheduler loop this code knows (class in "scheduler" or config._class_name).
inline std::string scheduler_golden_class(const nlohmann::json& j) {
    if (j.contains("scheduler") && j["scheduler"].is_string()) return j["scheduler"].get<std::string>();
    if (j.contains("config") && j["config"].is_object() && j["config"].contains("_class_name"))
        return j["config"]["_class_name"].get<std::string>();
    return "";
}

// The N of the first "manual_seed(N)" in `text`, or -1.
inline int64_t manual_seed_in(const std::string& text) {
    std::smatch m;
    static const std::regex re(R"(manual_seed\(\s*(-?\d+)\s*\))");
    return std::regex_search(text, m, re) ? std::stoll(m[1].str()) : -1;
}

// The fake model of the scheduler cases, eps = a * model_input + b * t / c, with a, b, c read from the folder's
// config.json "fake_model" text (tests/golden/sd/schedulers/README.md).
struct FakeModel {
    double a = 0, b = 0, c = 1;
    torch::Tensor operator()(const torch::Tensor& model_input, double t) const { return model_input * a + (b * t / c); }
};

inline FakeModel fake_model_of(const std::filesystem::path& dir) {
    const auto cfg_path = dir / "config.json";
    if (!std::filesystem::exists(cfg_path))
        throw Error("'" + cfg_path.string() + "' is missing: no fake_model formula");
    const auto cfg = read_json_file(cfg_path);
    if (!cfg.contains("fake_model") || !cfg["fake_model"].is_string())
        throw Error("'" + cfg_path.string() + "' has no \"fake_model\" formula");
    const std::string f = cfg["fake_model"].get<std::string>();
    std::smatch m;
    static const std::regex re(
        R"(^\s*eps\s*=\s*([0-9.eE+-]+)\s*\*\s*model_input\s*\+\s*([0-9.eE+-]+)\s*\*\s*t\s*/\s*([0-9.eE+-]+)(\s|$|\())");
    if (!std::regex_search(f, m, re))
        throw Error("'" + cfg_path.string() + "': fake_model '" + f +
                    "' is not of the form 'eps = A * model_input + B * t / C' this checker implements");
    return {std::stod(m[1].str()), std::stod(m[2].str()), std::stod(m[3].str())};
}

// Runs `<dir>/<run>.json` + `<run>.safetensors` (+ `common.safetensors` for the initial noise). Every parameter comes
// from the case: the scheduler config, eta, the generator seed (the run's step_kwargs "manual_seed(N)" text, else
// config.json "ancestral_generator_seed"), the fake model's coefficients. A step argument this checker does not know,
// or a generator without a seed, is an error (the case FAILs with the reason), never a default.
inline void run_scheduler_golden(const std::filesystem::path& dir, const std::string& run,
                                 const SchedulerGoldenSink& sink) {
    using namespace anchor::unet;
    const auto run_path = dir / (run + ".json");
    const auto j = read_json_file(run_path);
    static const std::set<std::string> known = {
        "scheduler", "config",           "num_inference_steps", "num_loop_steps", "timesteps", "timesteps_dtype",
        "sigmas",    "init_noise_sigma", "step_kwargs",         "final_mean",     "final_std"};
    for (const auto& [key, value] : j.items())
        if (!known.count(key)) throw Error(run_path.string() + ": '" + key + "' is not understood by this checker");
    // The class first (an unsupported one FAILs naming it), then every setting of the config that this sampler
    // would not run as diffusers does (FAIL naming the key and value, never run as something else).
    const std::string cls = scheduler_golden_class(j);
    const bool karras = j.contains("config") && j["config"].value("use_karras_sigmas", false);
    const std::string algorithm = j.contains("config") ? j["config"].value("algorithm_type", "") : "";
    const SamplerKind kind = sampler_from_class_name(cls, karras, algorithm);
    std::string unsupported;
    for (const auto& u : unsupported_scheduler_settings(j.at("config").dump(), kind))
        unsupported += (unsupported.empty() ? "" : "; ") + u;
    if (!unsupported.empty()) throw Error(run_path.string() + ": " + cls + " with " + unsupported);
    SchedulerConfig cfg = SchedulerConfig::from_json_text(j.at("config").dump(), run_path.string());
    cfg.class_name = cls;
    const FakeModel model = fake_model_of(dir);
    std::optional<double> eta; // only DDIM runs state one (their step_kwargs); unset = the sampler's default
    int64_t seed = -1;
    if (j.contains("step_kwargs")) {
        for (const auto& [key, value] : j["step_kwargs"].items()) {
            if (key == "eta") {
                eta = value.get<double>();
            } else if (key == "generator") {
                seed = manual_seed_in(value.is_string() ? value.get<std::string>() : value.dump());
                if (seed < 0)
                    throw Error(run_path.string() + ": step_kwargs.generator '" + value.dump() +
                                "' names no manual_seed(N)");
            } else {
                throw Error(run_path.string() + ": step argument '" + key + "' is not understood by this checker");
            }
        }
    }
    const auto folder_cfg = read_json_file(dir / "config.json");
    if (folder_cfg.contains("ancestral_generator_seed")) {
        const int64_t s = folder_cfg["ancestral_generator_seed"].get<int64_t>();
        if (seed >= 0 && s != seed)
            throw Error(run_path.string() + ": step_kwargs.generator seeds " + std::to_string(seed) +
                        " but config.json ancestral_generator_seed is " + std::to_string(s));
        if (seed < 0 && (kind == SamplerKind::EulerAncestral || j.contains("step_kwargs"))) seed = s;
    }
    auto sched = make_scheduler(kind, cfg, eta);
    sched->set_timesteps(j.at("num_inference_steps").get<int>());

    const int loop_steps = j.at("num_loop_steps").get<int>();
    sink.fact("num_loop_steps", sched->num_loop_steps() == loop_steps,
              "got " + std::to_string(sched->num_loop_steps()) + ", want " + std::to_string(loop_steps));
    const auto ts = j.at("timesteps").get<std::vector<double>>();
    const auto got_ts = sched->timesteps();
    // Integer timesteps exactly; fractional ones (Euler / LMS on Karras sigmas: _sigma_to_t of float64 sigmas) to
    // 1e-6 relative, since the reference's own sigmas come from numpy's vectorised power, whose last bit depends on
    // the CPU (SIMD vs libm pow) and moves a float32 timestep by one ulp now and then.
    // On LibTorch 2 the float32 betas differ from the reference's in the last bit (test_schedulers.cpp), and a
    // fractional timestep near t = 0 inherits that through sigma = sqrt((1 - abar) / abar), where 1 - abar ~ 1e-3
    // cancels: one ulp of abar moves log sigma by ~1e-4 and the timestep (_sigma_to_t) by as much. There a fractional
    // timestep may also be 2e-4 off in absolute terms; bit for bit / 1e-6 relative on the reference's LibTorch.
#if TORCH_VERSION_MAJOR >= 2
    const double ts_atol = 2e-4;
#else
    const double ts_atol = 0.0;
#endif
    bool ts_ok = ts.size() == got_ts.size();
    for (size_t i = 0; ts_ok && i < ts.size(); ++i) {
        const bool integral = ts[i] == std::floor(ts[i]) && got_ts[i] == std::floor(got_ts[i]);
        ts_ok = integral ? ts[i] == got_ts[i] : std::abs(ts[i] - got_ts[i]) <= ts_atol + 1e-6 * std::abs(ts[i]);
    }
    std::ostringstream ts_detail;
    ts_detail.precision(9);
    for (size_t i = 0; i < got_ts.size(); ++i) ts_detail << (i ? "," : "got ") << got_ts[i];
    for (size_t i = 0; i < ts.size(); ++i) ts_detail << (i ? "," : ", want ") << ts[i];
    sink.fact("timesteps", ts_ok, ts_detail.str());
    if (!j.at("sigmas").is_null()) {
        const auto sig = j["sigmas"].get<std::vector<double>>();
        const auto got = sched->sigmas();
        sink.fact("sigmas.size", got.size() == sig.size(),
                  "got " + std::to_string(got.size()) + ", want " + std::to_string(sig.size()));
        if (got.size() == sig.size())
            sink.tensor("sigmas", torch::tensor(got, torch::kFloat64), torch::tensor(sig, torch::kFloat64), 0.0, 1e-6);
    }
    const double ins = j.at("init_noise_sigma").get<double>();
    sink.tensor("init_noise_sigma", torch::tensor({sched->init_noise_sigma()}, torch::kFloat64),
                torch::tensor({ins}, torch::kFloat64), 0.0, 1e-6);
    if (!ts_ok || sched->num_loop_steps() != loop_steps) return; // the loop cannot line up

    auto common = SafeTensorsFile::open((dir / "common.safetensors").string());
    auto ref = SafeTensorsFile::open((dir / (run + ".safetensors")).string());
    const double atol = 1e-4, rtol = 1e-4;

    // Runs with a generator: one generator per run, seeded from the case; a twin generator reproduces each step's
    // draw for comparison with the stored noise.
    const bool uses_generator = ref->has("noise.0");
    if ((uses_generator || kind == SamplerKind::EulerAncestral) && seed < 0)
        throw Error(run_path.string() + ": the run draws noise but neither step_kwargs.generator nor config.json "
                                        "ancestral_generator_seed gives its seed");
    auto gen = at::make_generator<at::CPUGeneratorImpl>(uint64_t(std::max<int64_t>(seed, 0)));
    auto twin = at::make_generator<at::CPUGeneratorImpl>(uint64_t(std::max<int64_t>(seed, 0)));

    torch::Tensor x = common->tensor("initial_noise").clone() * sched->init_noise_sigma();
    sink.tensor("sample_0", x, ref->tensor("sample_0"), atol, rtol);
    for (int i = 0; i < loop_steps; ++i) {
        const std::string s = std::to_string(i);
        auto mi = sched->scale_model_input(x, i);
        sink.tensor("model_input." + s, mi, ref->tensor("model_input." + s), atol, rtol);
        const double t = sched->timestep(i);
        auto eps = model(mi, t);
        if (uses_generator) {
            auto noise = torch::randn(x.sizes(), twin, torch::kFloat32);
            sink.tensor("noise." + s, noise, ref->tensor("noise." + s), 0.0, 0.0);
        }
        x = sched->step(eps, i, x, &gen);
        sink.tensor("prev_sample." + s, x, ref->tensor("prev_sample." + s), atol, rtol);
        // The step's clean estimate where the reference stored it (LCM's `denoised`).
        if (ref->has("denoised." + s)) {
            const auto d = sched->denoised();
            sink.fact("denoised." + s, d.defined(), "this sampler returns no denoised estimate");
            if (d.defined()) sink.tensor("denoised." + s, d, ref->tensor("denoised." + s), atol, rtol);
        }
    }
    sink.tensor("final", x, ref->tensor("final"), atol, rtol);
}

} // namespace anchor::test
