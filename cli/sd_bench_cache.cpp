// `anchor-sd bench-cache`: every cache mode against `off` in one run (unet/bench/cache_bench.h): the option table, the
// models (a real one with -m, else a random-weight UNet on --device), printing and the result files.
#include "cli/sd_commands.h"

#include "cache/io/atomic_file.h"
#include "cache/io/error.h"
#include "cache/util/batch_job.h"
#include "cache/util/bench.h"
#include "cli/common.h"
#include "cli/enum_option.h"
#include "kernels/onednn.h"
#include "unet/model/checkpoint.h"
#include "unet/bench/cache_bench.h"
#include "unet/bench/cache_bench_sd3.h"
#include "unet/cache/freq_cache.h"
#include "unet/model/unet_macs.h"

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <iostream>
#include <sstream>

namespace anchor::cli {

namespace {

struct Options {
    unet::CacheBenchParams bench;
    std::string model, prompts_file = "assets/prompts/sd_bench.txt", unet_config, device = "cpu", output;
    std::string modes = "off,deepcache:2,deepcache:3,deepcache:5,freq:thr=0.5,freq,freq:thr=2";
    int max_prompts = 4, repeat = -1;
    bool overwrite = false;
    // -m only: the load options `anchor-sd -m` and `bench` take, so that a bf16 row times bf16 arithmetic.
    std::optional<kernels::GemmBackend> gemm;
    torch::ScalarType weights_dtype = torch::kFloat;
    // SD 3 / 3.5 models (-m, is_sd3_model): their defaults replace the UNet's where an option was not given.
    bool no_t5 = false;
    double shift = -1;
    CLI::Option *modes_opt = nullptr, *steps_opt = nullptr, *cfg_opt = nullptr;
    std::vector<CLI::Option*> unet_only; // --sampler, --gemm, --weights-dtype, --unet-config, --device
};

void emit_line(std::ostringstream& out, const std::string& line) {
    std::cout << line << std::endl;
    out << line << "\n";
}

// The report's first lines: what runs, and the load the timings were taken under.
void start_bench_report(std::ostringstream& out, const std::string& what) {
    emit_line(out, "anchor-sd bench-cache: " + what);
    emit_line(out, "  load average at start: " + util::load_average());
}

// The report's closing lines and files, for both model kinds.
void finish_bench_report(std::ostringstream& out, const unet::CacheBenchReport& rep,
                         const std::string& speedup_note) {
    emit_line(out, "  " + rep.setup + "\n");
    emit_line(out, rep.table());
    emit_line(out, speedup_note);
}

void write_bench_files(const Options& o, std::ostringstream& out, const unet::CacheBenchReport& rep) {
    emit_line(out, "peak RSS (VmHWM): " + util::fmt("%.0f", util::peak_rss_mib()) +
                       " MiB; load average at end: " + util::load_average());
    if (!o.output.empty()) {
        write_file_atomic(o.output, out.str(), o.overwrite);
        write_file_atomic(o.output + ".json", rep.to_json().dump(2) + "\n", o.overwrite);
    }
}

// bench-cache on an SD 3 / 3.5 model: the transformer's modes (default off,freq,fbcache,teacache,taylorseer), 28
// steps and guidance 7 unless given (anchor-sd's SD 3 defaults), the whole image timed per mode.
int run_bench_cache_sd3(Options& o) {
    for (const auto* opt : o.unet_only)
        if (opt->count() > 0)
            throw UsageError(opt->get_name() + " does not apply to SD 3 / 3.5 models ('" + o.model + "')");
    unet::Sd3CacheBenchParams b;
    b.modes = unet::parse_cache_list(o.modes_opt->count() > 0 ? o.modes : "off,freq,fbcache,teacache,taylorseer",
                                     "modes");
    b.repeat = o.repeat > 0 ? o.repeat : 1;
    b.seeds = o.bench.seeds;
    const auto& u = o.bench.base;
    b.base.steps = o.steps_opt->count() > 0 ? u.steps : 28;
    b.base.guidance_scale = o.cfg_opt->count() > 0 ? u.guidance_scale : 7.0;
    b.base.seed = u.seed;
    b.base.width = u.width, b.base.height = u.height;
    b.base.shift = o.shift;
    b.prompts = read_prompts_file(o.prompts_file, o.max_prompts);
    b.validate();
    if (!o.output.empty()) check_output_path(o.output, o.overwrite);
    unet::SD3Models m = unet::load_sd3_models(o.model, torch::kFloat, !o.no_t5);
    std::ostringstream out;
    start_bench_report(out, o.model + " (SD 3 / 3.5), " + std::to_string(torch::get_num_threads()) +
                                " threads, f32 weights");
    const auto rep = unet::run_sd3_cache_bench(m, b);
    finish_bench_report(out, rep,
                        "speed-up = median wall of the first mode / median wall of the mode over the interleaved runs "
                        "(loop: the denoising loop; image: the whole run with the three text encoders, the loop and "
                        "the VAE decode); full = steps that ran every transformer block");
    write_bench_files(o, out, rep);
    return 0;
}

torch::Device parse_device(const std::string& s) {
    try {
        // The programs' one device check: a CPU-only build or a missing GPU is a usage error naming the option.
        return batch::select_device(batch::DeviceSpec::parse(s), 0);
    } catch (const ParamError& e) {
        throw UsageError("--device: " + e.detail());
    }
}

int run_bench_cache(Options& o) {
    if (!o.model.empty() && unet::is_sd3_model(o.model)) return run_bench_cache_sd3(o);
    if (o.no_t5 || o.shift > 0) throw UsageError("--no-t5 and --shift apply to SD 3 / 3.5 models (-m)");
    auto& b = o.bench;
    b.modes = unet::parse_cache_list(o.modes, "modes");
    b.repeat = o.repeat > 0 ? o.repeat : (o.model.empty() ? 3 : 1);
    b.base.device = parse_device(o.device);
    if (!o.model.empty() && !b.base.device.is_cpu()) throw UsageError("-m runs the pipeline on the CPU only");
    if (o.model.empty() && (o.gemm || o.weights_dtype != torch::kFloat))
        throw UsageError("--gemm and --weights-dtype apply to a model loaded with -m");
    b.validate();
    if (!o.output.empty()) check_output_path(o.output, o.overwrite);
    unet::SDModels models;
    std::string what;
    if (o.model.empty()) {
        const auto cfg = o.unet_config.empty() ? unet::UNetConfig{} : unet::UNetConfig::from_json_file(o.unet_config);
        if (b.base.width == 0) b.base.width = b.base.height = 256;
        models = unet::random_unet_models(cfg, uint64_t(b.base.seed), b.base.device);
        what = (o.unet_config.empty() ? std::string("SD 1.5 UNet") : o.unet_config) + " (random weights)";
    } else {
        unet::LoadOptions lo;
        lo.gemm = o.gemm;
        lo.weights_dtype = o.weights_dtype;
        models = unet::load_sd_models(o.model, lo);
        b.prompts = read_prompts_file(o.prompts_file, o.max_prompts);
        what = o.model;
    }
    unet::Txt2ImgPipeline pipe(models);
    std::ostringstream out;
    start_bench_report(out, what + ", " + std::to_string(torch::get_num_threads()) + " threads, " +
                                enum_name(kernels::gemm_backend_table(), models.gemm) + " gemm, " +
                                enum_name(unet::weights_dtype_table(), models.weights_dtype) + " weights");
    const auto rep = unet::run_cache_bench(pipe, b);
    finish_bench_report(out, rep,
                        "speed-up = median wall of the first mode / median wall of the mode over the interleaved runs "
                        "(loop: the denoising loop; image: the whole txt2img call with the text encoder and the VAE "
                        "decode); MACs = conv + linear layers per sample (DeepCache's definition)");
    const auto b512 = unet::unet_mac_breakdown(unet::UNetConfig{}, 64, 64);
    emit_line(out, "DeepCache reference (SD 1.5, 512x512): deepcache:5 analytic " +
                       util::fmt("%.2f", b512.full().total() / 1e9) + " G -> " +
                       util::fmt("%.2f", unet::deepcache_macs_per_step(b512, 5, 0) / 1e9) +
                       " G per step here, published 338.83 G -> 130.45 G");
    write_bench_files(o, out, rep);
    return 0;
}

} // namespace

void add_sd_bench_cache_command(CLI::App& app, std::vector<std::pair<CLI::App*, std::function<int()>>>& runners) {
    auto* cmd = app.add_subcommand("bench-cache", "every cache mode vs off in one run: MACs, wall time, speed-up, "
                                                  "quality");
    cmd->fallthrough();
    auto o = std::make_shared<Options>();
    auto& p = o->bench.base;
    p.steps = 20;
    p.sampler = unet::SamplerKind::DDIM;
    p.seed = 0;
    cmd->add_option("-m,--model", o->model, "SD model (diffusers folder or single file); default: random SD 1.5 UNet");
    o->modes_opt = cmd->add_option("--modes", o->modes,
                                   "comma-separated cache modes, the first is the reference (SD 3 / 3.5 models: "
                                   "default off,freq,fbcache,teacache,taylorseer):\n" +
                                       unet::cache_mode_help())
                       ->capture_default_str();
    cmd->add_option("--prompts", o->prompts_file, "prompt file (one per line, # comments) for -m")
        ->capture_default_str();
    cmd->add_option("--max-prompts", o->max_prompts, "use at most this many prompts")->capture_default_str();
    cmd->add_option("--seeds", o->bench.seeds, "seeds per prompt (seed, seed+1, ...) for -m")->capture_default_str();
    cmd->add_option("-s,--seed", p.seed, "first seed (random weights: weights and noise)")->capture_default_str();
    cmd->add_option("-W,--width", p.width, "image width; default 256 (random) or the model's size");
    cmd->add_option("-H,--height", p.height, "image height; default 256 (random) or the model's size");
    o->steps_opt = cmd->add_option("--steps", p.steps, "sampling steps (SD 3 / 3.5 models: default 28)")
                       ->capture_default_str();
    o->unet_only.push_back(add_enum_option(*cmd, "--sampler", p.sampler, unet::sampler_table(), "sampler"));
    o->cfg_opt = cmd->add_option("--cfg-scale", p.guidance_scale, "guidance scale (SD 3 / 3.5 models: default 7)")
                     ->capture_default_str();
    cmd->add_option("--repeat", o->repeat,
                    "interleaved runs of every mode per prompt and seed (default 3 with random weights, 1 with -m)");
    o->unet_only.push_back(
        cmd->add_option("--unet-config", o->unet_config, "diffusers UNet config.json instead of SD 1.5's shapes"));
    o->unet_only.push_back(
        cmd->add_option("--device", o->device, "cpu or cuda[:N] (random weights only)")->capture_default_str());
    o->unet_only.push_back(add_enum_option(*cmd, "--gemm", o->gemm, kernels::gemm_backend_table(),
                    "with -m: library of the linear layers and convolutions (kernels/onednn.h; bf16: bfloat16 operands "
                    "summed in float32)",
                    "unet::default_gemm_backend of the model's attention"));
    o->unet_only.push_back(add_enum_option(*cmd, "--weights-dtype", o->weights_dtype, unet::weights_dtype_table(),
                                           "with -m: how the Linear/Conv weights are kept (f16/bf16 halve them)"));
    cmd->add_flag("--no-t5", o->no_t5, "SD 3 / 3.5: leave text_encoder_3 (T5-XXL) unloaded (diffusers' zeros)");
    cmd->add_option("--shift", o->shift, "SD 3 / 3.5: the flow-matching timestep shift (default: the scheduler's)")
        ->check(CLI::PositiveNumber);
    cmd->add_option("-o,--output", o->output, "also write the table to this file and a JSON report to <file>.json");
    cmd->add_flag("--overwrite", o->overwrite, "replace existing --output files");
    runners.emplace_back(cmd, [o]() { return run_bench_cache(*o); });
}

} // namespace anchor::cli
