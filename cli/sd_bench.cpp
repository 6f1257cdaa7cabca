// `anchor-sd bench`: times classifier-free-guidance UNet steps of an SD 1.5-shaped UNet with random weights (no
// download), and relates them to the analytic MAC count (unet/unet_macs.h) and to the GEMM rate this machine reaches
// in the same process, so the number says how close the UNet step is to what the BLAS can do.
#include "cli/sd_bench.h"
#include "cli/sd_bench_cache.h"
#include "cli/sd_train.h"

#include "cache/io/atomic_file.h"
#include "cache/io/error.h"
#include "cache/util/bench.h"
#include "cli/enum_option.h"
#include "cli/common.h"
#include "unet/unet_macs.h"
#include "unet/unet_model.h"
#include "unet/unet_perf.h"

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#if __has_include(<torch/csrc/autograd/profiler_legacy.h>)
#include <torch/csrc/autograd/profiler_legacy.h>
#define ANCHOR_HAVE_RECORD_PROFILE 1
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

namespace anchor::cli {

namespace {

// trace.json -> trace_shallow.json (only the file name's extension counts, not a dot in a folder name).
std::string shallow_profile_path(const std::string& profile) {
    const std::filesystem::path p(profile);
    return (p.parent_path() / (p.stem().string() + "_shallow" + p.extension().string())).string();
}

using unet::UNetConfig;
using namespace util;

struct BenchOptions {
    int width = 256, height = 256;
    int vae_factor = 8;
    int repeat = 3, warmup = 1, batch = 2;
    bool macs_only = false;
    bool baseline = false, ab = false;
    kernels::AttentionKernel attention = kernels::AttentionKernel::Exact;
    std::vector<int> deepcache{2, 3, 5, 10};
    int branch = 0;
    bool time_shallow = true;
    int gemm_n = 2048, gemm_repeat = 5;
    std::string unet_config, output, profile;
    bool overwrite = false;
    int64_t seed = 0;
};

// fp32 GEMM rate of this process' BLAS on the threads in effect: min time of `repeat` n x n x n products.
double gemm_gflops(int64_t n, int repeat) {
    torch::NoGradGuard ng;
    auto a = torch::randn({n, n}), b = torch::randn({n, n}), c = torch::empty({n, n});
    torch::mm_out(c, a, b); // warm-up (page faults, thread pool)
    double best = 1e30;
    for (int i = 0; i < repeat; ++i) {
        const double t0 = now_s();
        torch::mm_out(c, a, b);
        best = std::min(best, now_s() - t0);
    }
    return 2.0 * double(n) * double(n) * double(n) / best / 1e9;
}

int run_bench(const BenchOptions& o) {
    if (o.width <= 0 || o.height <= 0 || o.width % o.vae_factor || o.height % o.vae_factor)
        throw UsageError("bench: -W/-H must be positive multiples of the VAE factor " + std::to_string(o.vae_factor) +
                         ", got " + std::to_string(o.width) + "x" + std::to_string(o.height));
    if (o.repeat < 1 || o.warmup < 0 || o.batch < 1) throw UsageError("bench: --repeat and --batch must be >= 1");
    for (int n : o.deepcache)
        if (n < 1) throw UsageError("bench: --deepcache intervals must be >= 1");
    if (!o.output.empty()) check_output_path(o.output, o.overwrite);
    // --profile writes a second trace, of one shallow step, when --deepcache gives it a cached feature.
    const bool profile_shallow = !o.profile.empty() && o.time_shallow && !o.deepcache.empty();
    const std::string shallow_profile = profile_shallow ? shallow_profile_path(o.profile) : std::string();
    if (!o.profile.empty()) check_output_path(o.profile, o.overwrite);
    if (profile_shallow) check_output_path(shallow_profile, o.overwrite);

    const UNetConfig cfg = o.unet_config.empty() ? UNetConfig{} : UNetConfig::from_json_file(o.unet_config);
    const int64_t lh = o.height / o.vae_factor, lw = o.width / o.vae_factor;
    const int64_t tokens = 77;
    const auto macs = unet::unet_mac_breakdown(cfg, lh, lw, tokens);
    const auto full = macs.full();
    if (o.macs_only) {
        std::cout << unet::format_gmacs(double(full.total())) << " GMACs" << std::endl;
        return 0;
    }
    if (o.branch < 0 || o.branch >= macs.num_skips())
        throw UsageError("bench: --deepcache-branch must be in [0, " + std::to_string(macs.num_skips()) + ")");

    std::ostringstream out;
    auto emit = [&](const std::string& line) {
        std::cout << line << std::endl;
        out << line << "\n";
    };
    emit("anchor-sd bench: " + std::string(o.unet_config.empty() ? "SD 1.5 UNet" : o.unet_config) +
         " (random weights), " + std::to_string(o.width) + "x" + std::to_string(o.height) + " (latent " +
         std::to_string(lw) + "x" + std::to_string(lh) + "), batch " + std::to_string(o.batch) +
         (o.batch == 2 ? " (one CFG step)" : "") + ", float32, " + std::to_string(torch::get_num_threads()) +
         " threads");
    emit("  " + cfg.describe());
    emit("  load average at start: " + load_average());
    emit("MACs per UNet forward, one sample (conv + linear layers, DeepCache's definition): " +
         unet::format_gmacs(double(full.total())) + " GMACs");
    emit("  conv " + unet::format_gmacs(double(full.conv), 3) + " G + linear " +
         unet::format_gmacs(double(full.linear), 3) + " G = " + unet::format_gmacs(double(full.total()), 3) +
         " G; attention matmuls (q k^T, p v; not counted above) " + unet::format_gmacs(double(full.attention), 3) +
         " G");
    const double sd15_512 = double(unet::unet_macs(UNetConfig{}, 64, 64).total());
    emit("  reference: SD 1.5 at 512x512 = " + unet::format_gmacs(sd15_512, 2) +
         " G here vs 338.83 G in DeepCache (Ma et al. 2023), whose extra 0.22 G match conv-bias adds + 2 ops per "
         "GroupNorm/LayerNorm element");
    for (int n : o.deepcache) {
        const double per = unet::deepcache_macs_per_step(macs, n, o.branch);
        emit("  deepcache:" + std::to_string(n) + " (branch " + std::to_string(o.branch) + ", uniform): " +
             unet::format_gmacs(per, 2) + " G per step (full " + unet::format_gmacs(double(full.total()), 2) +
             " G, cached step " + unet::format_gmacs(double(macs.shallow(o.branch).total()), 2) + " G, " +
             fmt("%.2fx fewer", double(full.total()) / per) + ")");
    }
    emit("  published (DeepCache, SD 1.5 512x512): 338.83 G -> 130.45 G per step for deepcache:5");

    unet::perf::set_fast(!o.baseline);
    emit(std::string("  forward: ") +
         (o.baseline ? "plain module forwards (--baseline)" : "fast paths (unet/unet_perf.h)"));
    torch::manual_seed(uint64_t(o.seed));
    double t0 = now_s();
    unet::UNet2DConditionModel model(cfg);
    model->eval();
    model->set_attention_kernel(o.attention);
    emit("  attention: " + enum_name(kernels::attention_kernel_table(), o.attention));
    for (auto& p : model->parameters()) p.set_requires_grad(false);
    int64_t nparams = 0;
    for (const auto& p : model->parameters()) nparams += p.numel();
    emit("model: " + fmt("%.1f", double(nparams) / 1e6) + " M parameters, built in " + fmt("%.1f", now_s() - t0) +
         " s");

    auto sample = torch::randn({o.batch, cfg.in_channels, lh, lw});
    auto context = torch::randn({o.batch, tokens, cfg.cross_attention_dim});
    auto timestep = torch::tensor(int64_t(999));

    unet::UNetFeatures feats;
    feats.cache_branch = o.branch;
    for (int i = 0; i < o.warmup; ++i) model->forward(sample, timestep, context, &feats);
    std::vector<double> times;
    torch::Tensor y;
    for (int i = 0; i < o.repeat; ++i) {
        t0 = now_s();
        y = model->forward(sample, timestep, context);
        times.push_back(now_s() - t0);
    }
    if (!torch::isfinite(y).all().item<bool>()) throw Error("bench: the UNet output is not finite");
    if (o.ab) {
        // Interleaved plain / fast steps: on a loaded machine both see the same load.
        std::vector<double> tp, tf;
        torch::Tensor yp, yf;
        for (int i = 0; i < o.repeat; ++i) {
            unet::perf::set_fast(false);
            t0 = now_s();
            yp = model->forward(sample, timestep, context);
            tp.push_back(now_s() - t0);
            unet::perf::set_fast(true);
            t0 = now_s();
            yf = model->forward(sample, timestep, context);
            tf.push_back(now_s() - t0);
        }
        unet::perf::set_fast(!o.baseline);
        const Stats sp = stats_of(tp), sf = stats_of(tf);
        const double rel = (yf - yp).abs().max().item<double>() / yp.abs().max().item<double>();
        emit("A/B interleaved: plain min " + fmt("%.3f", sp.min) + " s / median " + fmt("%.3f", sp.median) +
             " s, fast min " + fmt("%.3f", sf.min) + " s / median " + fmt("%.3f", sf.median) + " s, speed-up " +
             fmt("%.3fx", sp.min / sf.min) + " (min), " + fmt("%.3fx", sp.median / sf.median) +
             " (median); max |fast - plain| / max |plain| = " + fmt("%.2e", rel));
    }
    const Stats st = stats_of(times);
    emit("UNet step (batch " + std::to_string(o.batch) + "): min " + fmt("%.3f", st.min) + " s, median " +
         fmt("%.3f", st.median) + " s, max " + fmt("%.3f", st.max) + " s over " + std::to_string(o.repeat) +
         " runs after " + std::to_string(o.warmup) + " warm-up");

    Stats sh{};
    if (o.time_shallow && !o.deepcache.empty()) {
        if (!feats.cache_feature.defined()) model->forward(sample, timestep, context, &feats);
        std::vector<double> ts;
        for (int i = 0; i < o.repeat + 1; ++i) { // first one warms the shallow shapes
            t0 = now_s();
            model->forward_shallow(sample, timestep, context, o.branch, feats.cache_feature);
            if (i > 0) ts.push_back(now_s() - t0);
        }
        sh = stats_of(ts);
        emit("  cached (shallow, branch " + std::to_string(o.branch) + ") step: min " + fmt("%.3f", sh.min) +
             " s, median " + fmt("%.3f", sh.median) + " s");
        for (int n : o.deepcache)
            emit("  deepcache:" + std::to_string(n) + " -> " + fmt("%.3f", (st.min + (n - 1) * sh.min) / n) +
                 " s per step (" + fmt("%.2fx", st.min * n / (st.min + (n - 1) * sh.min)) + ")");
    }

    if (!o.profile.empty()) {
#ifdef ANCHOR_HAVE_RECORD_PROFILE
        // One more step under LibTorch's profiler: a chrome://tracing file with every aten op (per-op costs).
        {
            torch::autograd::profiler::RecordProfile prof(o.profile);
            model->forward(sample, timestep, context);
        }
        if (profile_shallow) { // and one shallow (DeepCache) step next to it
            torch::autograd::profiler::RecordProfile prof(shallow_profile);
            model->forward_shallow(sample, timestep, context, o.branch, feats.cache_feature);
        }
#else
        throw UsageError("bench: --profile needs LibTorch's legacy profiler header");
#endif
    }

    const double flops = 2.0 * double(full.total()) * double(o.batch);
    const double flops_attn = 2.0 * double(full.total() + full.attention) * double(o.batch);
    const double achieved = flops / st.min / 1e9, achieved_med = flops / st.median / 1e9;
    const double gemm = gemm_gflops(o.gemm_n, o.gemm_repeat);
    emit("achieved: " + fmt("%.1f", achieved) + " GFLOP/s (2 x MACs x batch / min time; median " +
         fmt("%.1f", achieved_med) + "), with attention matmuls " + fmt("%.1f", flops_attn / st.min / 1e9) +
         " GFLOP/s");
    emit("GEMM " + std::to_string(o.gemm_n) + "x" + std::to_string(o.gemm_n) + " fp32 (torch::mm, min of " +
         std::to_string(o.gemm_repeat) + "): " + fmt("%.1f", gemm) + " GFLOP/s");
    emit("ratio: " + fmt("%.1f", 100.0 * achieved / gemm) + " % of the GEMM rate (median " +
         fmt("%.1f", 100.0 * achieved_med / gemm) + " %; with attention matmuls " +
         fmt("%.1f", 100.0 * flops_attn / st.min / 1e9 / gemm) + " %)");
    emit("peak RSS (VmHWM): " + fmt("%.0f", peak_rss_mib()) + " MiB");
    emit("load average at end: " + load_average());
    if (!o.output.empty()) write_file_atomic(o.output, out.str(), o.overwrite);
    return 0;
}

void add_options(CLI::App& cmd, BenchOptions& o) {
    cmd.add_option("-W,--width", o.width, "image width in pixels (latent = width / 8)")->capture_default_str();
    cmd.add_option("-H,--height", o.height, "image height in pixels")->capture_default_str();
    cmd.add_option("--repeat", o.repeat, "timed UNet steps (min/median/max are reported)")->capture_default_str();
    cmd.add_option("--warmup", o.warmup, "untimed UNet steps first")->capture_default_str();
    cmd.add_option("--batch", o.batch, "UNet batch (2 = one classifier-free-guidance step)")->capture_default_str();
    cmd.add_flag("--baseline", o.baseline, "time the plain module forwards instead of the fast paths");
    cmd.add_flag("--ab", o.ab, "also time plain and fast forwards interleaved and report the speed-up");
    add_enum_option(cmd, "--attention", o.attention, kernels::attention_kernel_table(),
                    "attention arithmetic of the fast paths (kernels/attention.h)");
    cmd.add_flag("--macs-only", o.macs_only, "print only the analytic MAC count per sample (e.g. '338.6 GMACs')");
    cmd.add_option("--deepcache", o.deepcache, "DeepCache intervals N whose MACs (and cached-step times) are shown")
        ->capture_default_str();
    cmd.add_option("--deepcache-branch", o.branch, "DeepCache skip branch (0 = shallowest)")->capture_default_str();
    cmd.add_option("--unet-config", o.unet_config, "diffusers UNet config.json instead of SD 1.5's shapes");
    cmd.add_option("--gemm-size", o.gemm_n, "n of the n x n x n reference GEMM")->capture_default_str();
    cmd.add_option("--seed", o.seed, "seed for weights and inputs")->capture_default_str();
    cmd.add_option("-o,--output", o.output, "also write the report to this file");
    cmd.add_option("--profile", o.profile,
                   "write a chrome trace of one extra UNet step (aten ops) to this file; with --deepcache also one "
                   "shallow step to <stem>_shallow<ext>");
    cmd.add_flag("--overwrite", o.overwrite, "replace an existing --output file");
}

} // namespace

void add_sd_bench_command(CLI::App& app, std::vector<std::pair<CLI::App*, std::function<int()>>>& runners) {
    auto* cmd = app.add_subcommand("bench", "UNet step speed (random SD 1.5 weights) vs analytic MACs and GEMM rate");
    cmd->fallthrough(); // --threads of the parent app may follow `bench`
    auto o = std::make_shared<BenchOptions>();
    add_options(*cmd, *o);
    runners.emplace_back(cmd, [o]() { return run_bench(*o); });
}

} // namespace anchor::cli
