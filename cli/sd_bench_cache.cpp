// `anchor-sd bench-cache`: every cache mode against `off` in one run, same seeds, interleaved repeats.
//
// * Without -m: an SD 1.5-shaped UNet with random weights (no download), a random text context, a 20-step DDIM loop
//   with classifier-free guidance (batch 2), on the CPU or a CUDA device (--device). Reports per mode the full steps,
//   the analytic MACs per step (unet/unet_macs.h, counted by the controllers' per-step records), wall seconds
//   min/median/max over --repeat interleaved runs, speed-up vs off from the same run, and the PSNR of the final
//   latents vs off (random weights: a consistency figure, not an image-quality one).
// * With -m MODEL: the whole txt2img pipeline over the prompts of --prompts and --seeds seeds per prompt; PSNR/SSIM
//   of the images vs off (cache/metrics.h), averaged.
#include "cli/sd_bench_cache.h"

#include "cache/io/atomic_file.h"
#include "cache/io/error.h"
#include "cache/metrics.h"
#include "cache/util/bench.h"
#include "cli/common.h"
#include "unet/checkpoint.h"
#include "unet/freq_cache.h"
#include "unet/pipeline.h"
#include "unet/scheduler.h"
#include "unet/unet_macs.h"
#include "unet/unet_model.h"

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <cmath>
#include <fstream>
#include <iostream>
#include <sstream>

namespace anchor::cli {

namespace {

using namespace util;

struct Options {
    std::string model, prompts = "assets/prompts/sd_bench.txt",
                       modes = "off,deepcache:2,deepcache:3,deepcache:5,freq:thr=0.5,freq,freq:thr=2";
    std::string unet_config, device = "cpu", output, sampler = "ddim";
    int width = 0, height = 0, steps = 20, repeat = 3, seeds = 1, max_prompts = 4;
    double cfg_scale = 7.5;
    int64_t seed = 0;
    bool overwrite = false;
};

struct ModeResult {
    std::string mode;
    std::vector<double> wall;
    int full_steps = 0, total_steps = 0;
    double macs_per_step = 0;       // per sample, mean over the loop
    std::vector<double> psnr, ssim; // vs off, per (prompt, seed) or per repeat
};

// Mean per-step MACs and full-step count from a controller's per-step log.
void take_log(const unet::CacheController& c, ModeResult& m) {
    double macs = 0;
    int full = 0;
    for (const auto& s : c.log()) macs += s.macs, full += s.full ? 1 : 0;
    m.full_steps = full;
    m.total_steps = int(c.log().size());
    m.macs_per_step = c.log().empty() ? 0 : macs / double(c.log().size());
}

double mean_of(const std::vector<double>& v) {
    if (v.empty()) return NAN;
    double s = 0;
    for (double x : v) s += std::isinf(x) ? 0 : x;
    size_t n = 0;
    for (double x : v) n += std::isinf(x) ? 0 : 1;
    return n ? s / double(n) : INFINITY; // all identical -> inf
}

// Random-weight UNet loop (CFG batch 2) with the scheduler on the CPU and the UNet on `dev`.
torch::Tensor run_random(unet::UNet2DConditionModelImpl& model, unet::Scheduler& sched, unet::CacheController& ctl,
                         const torch::Tensor& init, const torch::Tensor& ctx, double guidance, torch::Device dev,
                         int steps, double* wall) {
    c10::InferenceMode guard;
    sched.set_timesteps(steps);
    const int n = sched.num_loop_steps();
    torch::Generator gen = at::detail::createCPUGenerator(0);
    auto latents = init * sched.init_noise_sigma();
    ctl.begin(n, int(init.size(0)));
    const double t0 = now_s();
    for (int i = 0; i < n; ++i) {
        auto x = sched.scale_model_input(torch::cat({latents, latents}, 0), i).to(dev);
        auto t = torch::tensor(sched.timestep(i), torch::kFloat).reshape({}).to(dev);
        auto eps = ctl.predict(model, x, t, ctx, i).to(torch::kCPU).to(torch::kFloat); // .to(CPU) synchronises
        latents = sched.step(unet::cfg_combine(eps, guidance), i, latents, &gen);
    }
    *wall = now_s() - t0;
    return latents;
}

int run_bench_cache(const Options& o) {
    const auto modes = unet::split_mode_list(o.modes);
    if (modes.empty()) throw UsageError("bench-cache: --modes is empty");
    for (const auto& m : modes) unet::parse_cache_mode(m); // validate before any work
    if (o.repeat < 1 || o.steps < 1 || o.seeds < 1 || o.max_prompts < 1)
        throw UsageError("bench-cache: --repeat, --steps, --seeds and --max-prompts must be >= 1");
    torch::Device dev(torch::kCPU);
    try {
        dev = torch::Device(o.device);
    } catch (const std::exception&) {
        throw UsageError("bench-cache: --device must be cpu or cuda[:N], got '" + o.device + "'");
    }
    if (dev.is_cuda() && !torch::cuda::is_available())
        throw UsageError("bench-cache: --device " + o.device + " but no CUDA device is available to this LibTorch");
    if (!o.model.empty() && !dev.is_cpu()) throw UsageError("bench-cache: -m runs the pipeline on the CPU only");
    if (!o.output.empty()) check_output_path(o.output, o.overwrite);
    const auto sampler = unet::sampler_from_string(o.sampler);

    std::ostringstream out;
    auto emit = [&](const std::string& line) {
        std::cout << line << std::endl;
        out << line << "\n";
    };
    std::vector<ModeResult> res(modes.size());
    for (size_t k = 0; k < modes.size(); ++k) res[k].mode = unet::parse_cache_mode(modes[k])->spec();
    std::string what;

    if (o.model.empty()) {
        const unet::UNetConfig cfg =
            o.unet_config.empty() ? unet::UNetConfig{} : unet::UNetConfig::from_json_file(o.unet_config);
        const int w = o.width ? o.width : 256, h = o.height ? o.height : 256;
        if (w % 8 || h % 8) throw UsageError("bench-cache: -W/-H must be multiples of 8");
        what = std::string(o.unet_config.empty() ? "SD 1.5 UNet" : o.unet_config) + " (random weights), " +
               std::to_string(w) + "x" + std::to_string(h) + ", " + std::to_string(o.steps) + " " + o.sampler +
               " steps, CFG " + fmt("%.1f", o.cfg_scale) + ", float32 on " + dev.str() +
               (dev.is_cpu() ? ", " + std::to_string(torch::get_num_threads()) + " threads" : "");
        emit("anchor-sd bench-cache: " + what);
        emit("  load average at start: " + load_average());
        torch::manual_seed(uint64_t(o.seed));
        unet::UNet2DConditionModel model(cfg);
        model->eval();
        for (auto& p : model->parameters()) p.set_requires_grad(false);
        model->to(dev);
        auto ctx = torch::randn({2, 77, cfg.cross_attention_dim}).to(dev);
        torch::Generator gen = at::detail::createCPUGenerator(uint64_t(o.seed) + 1);
        auto init = torch::randn({1, cfg.in_channels, h / 8, w / 8}, gen);
        auto sched = unet::make_scheduler(sampler, unet::SchedulerConfig{});
        std::vector<torch::Tensor> finals(modes.size());
        { // warm-up: weights paged in / kernels loaded, the shallow shapes too
            auto c = unet::parse_cache_mode("deepcache:2");
            double t;
            run_random(*model, *sched, *c, init, ctx, o.cfg_scale, dev, std::min(o.steps, 3), &t);
        }
        for (int r = 0; r < o.repeat; ++r)
            for (size_t k = 0; k < modes.size(); ++k) { // interleaved: every mode sees the same machine state
                auto c = unet::parse_cache_mode(modes[k]);
                double t = 0;
                finals[k] = run_random(*model, *sched, *c, init, ctx, o.cfg_scale, dev, o.steps, &t);
                res[k].wall.push_back(t);
                take_log(*c, res[k]);
            }
        for (size_t k = 0; k < modes.size(); ++k) {
            const double range = (finals[0].max() - finals[0].min()).item<double>();
            const double mse = (finals[k] - finals[0]).pow(2).mean().item<double>();
            res[k].psnr.push_back(mse == 0 ? INFINITY : 10 * std::log10(range * range / mse));
        }
    } else {
        auto models = unet::load_sd_models(o.model);
        unet::Txt2ImgPipeline pipe(models);
        const auto prompts = read_prompts_file(o.prompts, o.max_prompts);
        unet::Txt2ImgParams p;
        p.steps = o.steps;
        p.sampler = sampler;
        p.guidance_scale = o.cfg_scale;
        p.width = o.width;
        p.height = o.height;
        p = pipe.resolved(p);
        what = o.model + ", " + std::to_string(p.width) + "x" + std::to_string(p.height) + ", " +
               std::to_string(o.steps) + " " + o.sampler + " steps, CFG " + fmt("%.1f", o.cfg_scale) + ", " +
               std::to_string(prompts.size()) + " prompts x " + std::to_string(o.seeds) + " seeds, " +
               std::to_string(torch::get_num_threads()) + " threads";
        emit("anchor-sd bench-cache: " + what);
        emit("  load average at start: " + load_average());
        pipe.run(p); // warm-up
        for (const auto& prompt : prompts)
            for (int s = 0; s < o.seeds; ++s) {
                p.prompts = {prompt};
                p.seed = o.seed + s;
                torch::Tensor ref;
                for (size_t k = 0; k < modes.size(); ++k) {
                    auto c = unet::parse_cache_mode(modes[k]);
                    auto r = pipe.run(p, c.get());
                    res[k].wall.push_back(r.denoise_s);
                    take_log(*c, res[k]);
                    const auto img = r.image[0].permute({1, 2, 0}).contiguous();
                    if (k == 0) ref = img;
                    res[k].psnr.push_back(cache::psnr(img, ref, 1.0));
                    res[k].ssim.push_back(cache::ssim(img, ref, 1.0));
                }
            }
    }

    const Stats base = stats_of(res[0].wall);
    const bool images = !o.model.empty();
    emit("");
    size_t wmode = 4;
    for (const auto& m : res) wmode = std::max(wmode, m.mode.size());
    char line[512];
    std::snprintf(line, sizeof line, "%-*s %6s %10s %8s %24s %9s %10s %7s", int(wmode), "mode", "full", "GMACs/step",
                  "MAC red.", "wall s min/median/max", "speed-up", images ? "PSNR" : "latentPSNR",
                  images ? "SSIM" : "");
    emit(line);
    nlohmann::json rep = {{"benchmark", "anchor-sd bench-cache"}, {"setup", what}, {"modes", nlohmann::json::array()}};
    const double macs0 = res[0].macs_per_step;
    for (const auto& m : res) {
        const Stats s = stats_of(m.wall);
        const double psnr = mean_of(m.psnr), ssim = m.ssim.empty() ? NAN : mean_of(m.ssim);
        const std::string walls = fmt("%.3f", s.min) + "/" + fmt("%.3f", s.median) + "/" + fmt("%.3f", s.max);
        const std::string full = std::to_string(m.full_steps) + "/" + std::to_string(m.total_steps);
        std::snprintf(line, sizeof line, "%-*s %6s %10.2f %7.2fx %24s %8.2fx %10s %7s", int(wmode), m.mode.c_str(),
                      full.c_str(), m.macs_per_step / 1e9, macs0 / m.macs_per_step, walls.c_str(),
                      base.median / s.median, std::isinf(psnr) ? "inf" : fmt("%.2f dB", psnr).c_str(),
                      images ? fmt("%.4f", ssim).c_str() : "");
        emit(line);
        rep["modes"].push_back(
            {{"mode", m.mode},
             {"full_steps", m.full_steps},
             {"total_steps", m.total_steps},
             {"gmacs_per_step", m.macs_per_step / 1e9},
             {"wall_s", m.wall},
             {"wall_s_median", s.median},
             {"speedup_vs_first_median", base.median / s.median},
             {images ? "psnr_db" : "latent_psnr_db", std::isinf(psnr) ? nlohmann::json("inf") : nlohmann::json(psnr)},
             {"ssim", images ? nlohmann::json(ssim) : nlohmann::json(nullptr)}});
    }
    emit("");
    emit("speed-up = median wall of the first mode / median wall of the mode, " + std::to_string(res[0].wall.size()) +
         " interleaved runs each; MACs = conv + linear layers per sample (DeepCache's definition)");
    const auto b512 = unet::unet_mac_breakdown(unet::UNetConfig{}, 64, 64);
    emit("DeepCache reference (SD 1.5, 512x512): deepcache:5 analytic " + fmt("%.2f", b512.full().total() / 1e9) +
         " G -> " + fmt("%.2f", unet::deepcache_macs_per_step(b512, 5, 0) / 1e9) +
         " G per step here, published 338.83 G -> 130.45 G");
    emit("peak RSS (VmHWM): " + fmt("%.0f", peak_rss_mib()) + " MiB; load average at end: " + load_average());
    if (!o.output.empty()) {
        write_file_atomic(o.output, out.str(), o.overwrite);
        write_file_atomic(o.output + ".json", rep.dump(2) + "\n", o.overwrite);
    }
    return 0;
}

} // namespace

void add_sd_bench_cache_command(CLI::App& app, std::vector<std::pair<CLI::App*, std::function<int()>>>& runners) {
    auto* cmd = app.add_subcommand("bench-cache", "every cache mode vs off in one run: MACs, wall time, speed-up, "
                                                  "quality");
    cmd->fallthrough();
    auto o = std::make_shared<Options>();
    cmd->add_option("-m,--model", o->model, "SD model (diffusers folder or single file); default: random SD 1.5 UNet");
    cmd->add_option("--modes", o->modes,
                    "comma-separated cache modes, the first is the reference:\n" + unet::cache_mode_help())
        ->capture_default_str();
    cmd->add_option("--prompts", o->prompts, "prompt file (one per line, # comments) for -m")->capture_default_str();
    cmd->add_option("--max-prompts", o->max_prompts, "use at most this many prompts")->capture_default_str();
    cmd->add_option("--seeds", o->seeds, "seeds per prompt (seed, seed+1, ...) for -m")->capture_default_str();
    cmd->add_option("-s,--seed", o->seed, "first seed (random weights: weights and noise)")->capture_default_str();
    cmd->add_option("-W,--width", o->width, "image width; default 256 (random) or the model's size");
    cmd->add_option("-H,--height", o->height, "image height; default 256 (random) or the model's size");
    cmd->add_option("--steps", o->steps, "sampling steps")->capture_default_str();
    cmd->add_option("--sampler", o->sampler, "sampler")->capture_default_str();
    cmd->add_option("--cfg-scale", o->cfg_scale, "guidance scale")->capture_default_str();
    cmd->add_option("--repeat", o->repeat, "interleaved runs of every mode (random weights)")->capture_default_str();
    cmd->add_option("--unet-config", o->unet_config, "diffusers UNet config.json instead of SD 1.5's shapes");
    cmd->add_option("--device", o->device, "cpu or cuda[:N] (random weights only)")->capture_default_str();
    cmd->add_option("-o,--output", o->output, "also write the table to this file and a JSON report to <file>.json");
    cmd->add_flag("--overwrite", o->overwrite, "replace existing --output files");
    runners.emplace_back(cmd, [o]() { return run_bench_cache(*o); });
}

} // namespace anchor::cli
