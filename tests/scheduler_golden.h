// The scheduler golden loop (tests/golden/sd/schedulers/README.md), shared by tests/test_schedulers.cpp and the
// golden_runner checker: fake model eps = 0.1 * model_input + 0.01 * t / 1000, free-running from the stored initial
// noise, every step's model_input and prev_sample compared to the reference.
#pragma once

#include "cache/io/error.h"
#include "cache/io/safetensors.h"
#include "unet/scheduler.h"

#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <functional>
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

// Runs `<dir>/<run>.json` + `<run>.safetensors` (+ `common.safetensors` for the initial noise).
inline void run_scheduler_golden(const std::filesystem::path& dir, const std::string& run,
                                 const SchedulerGoldenSink& sink) {
    using namespace anchor::unet;
    const auto j = read_json_file(dir / (run + ".json"));
    SchedulerConfig cfg = SchedulerConfig::from_json_text(j.at("config").dump(), (dir / (run + ".json")).string());
    cfg.class_name = scheduler_golden_class(j);
    const SamplerKind kind = sampler_from_class_name(cfg.class_name, cfg.use_karras_sigmas);
    double eta = 0.0;
    if (j.contains("step_kwargs") && j["step_kwargs"].contains("eta")) eta = j["step_kwargs"]["eta"].get<double>();
    auto sched = make_scheduler(kind, cfg, eta);
    sched->set_timesteps(j.at("num_inference_steps").get<int>());

    const int loop_steps = j.at("num_loop_steps").get<int>();
    sink.fact("num_loop_steps", sched->num_loop_steps() == loop_steps,
              "got " + std::to_string(sched->num_loop_steps()) + ", want " + std::to_string(loop_steps));
    const auto ts = j.at("timesteps").get<std::vector<double>>();
    const auto got_ts = sched->timesteps();
    bool ts_ok = ts == got_ts;
    std::ostringstream ts_detail;
    for (size_t i = 0; i < got_ts.size(); ++i) ts_detail << (i ? "," : "got ") << got_ts[i];
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

    // Ancestral runs: one generator seeded 7 per run; a twin generator reproduces each step's draw for comparison.
    const bool uses_generator = ref->has("noise.0");
    auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
    auto twin = at::make_generator<at::CPUGeneratorImpl>(7);

    torch::Tensor x = common->tensor("initial_noise").clone() * sched->init_noise_sigma();
    sink.tensor("sample_0", x, ref->tensor("sample_0"), atol, rtol);
    for (int i = 0; i < loop_steps; ++i) {
        const std::string s = std::to_string(i);
        auto mi = sched->scale_model_input(x, i);
        sink.tensor("model_input." + s, mi, ref->tensor("model_input." + s), atol, rtol);
        const double t = sched->timestep(i);
        auto eps = mi * 0.1 + (0.01 * t / 1000.0);
        if (uses_generator) {
            auto noise = torch::randn(x.sizes(), twin, torch::kFloat32);
            sink.tensor("noise." + s, noise, ref->tensor("noise." + s), 0.0, 0.0);
        }
        x = sched->step(eps, i, x, &gen);
        sink.tensor("prev_sample." + s, x, ref->tensor("prev_sample." + s), atol, rtol);
    }
    sink.tensor("final", x, ref->tensor("final"), atol, rtol);
}

} // namespace anchor::test
