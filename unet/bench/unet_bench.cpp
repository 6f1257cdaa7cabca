#include "unet/bench/unet_bench.h"

#include "unet/model/checkpoint.h"

#include "cache/io/error.h"
#include "cache/util/bench.h"
#include "cache/util/heap.h"
#include "cache/util/threads.h"
#include "kernels/cpu_features.h"
#include "kernels/op_timing.h"
#include "unet/model/unet_macs.h"

#include <torch/torch.h>

#if __has_include(<torch/csrc/autograd/profiler_legacy.h>)
#include <torch/csrc/autograd/profiler_legacy.h>
#define ANCHOR_HAVE_RECORD_PROFILE 1
#endif

#include <algorithm>
#include <cstdio>
#include <filesystem>

namespace anchor::unet {

// fp32 GEMM rate of this process' BLAS on the threads in effect: min time of `repeat` n x n x n products.
double gemm_gflops(int64_t n, int repeat, kernels::GemmBackend backend) {
    torch::NoGradGuard ng;
    auto a = torch::randn({n, n}), b = torch::randn({n, n}), c = torch::empty({n, n});
    const bool onednn = kernels::runs_on_onednn(backend);
    auto product = [&] {
        if (onednn)
            c = kernels::onednn_linear(a, b, {}, backend == kernels::GemmBackend::Bf16);
        else
            torch::mm_out(c, a, b);
    };
    product(); // warm-up (page faults, thread pool)
    double best = 1e30;
    for (int i = 0; i < repeat; ++i) {
        const double t0 = util::now_s();
        product();
        best = std::min(best, util::now_s() - t0);
    }
    return 2.0 * double(n) * double(n) * double(n) / best / 1e9;
}

void UNetBenchParams::validate() const {
    if (width <= 0 || height <= 0 || width % vae_factor || height % vae_factor)
        throw ParamError(width <= 0 || width % vae_factor ? "width" : "height",
                         "must be positive multiples of the VAE factor " + std::to_string(vae_factor) + ", got " +
                             std::to_string(width) + "x" + std::to_string(height));
    if (repeat < 1) throw ParamError("repeat", "must be >= 1");
    if (vae_repeat < 0) throw ParamError("vae_repeat", "must be >= 0");
    if (warmup < 0) throw ParamError("warmup", "must be >= 0");
    if (op_table < 0) throw ParamError("op_table", "must be >= 0 (0 = no table), got " + std::to_string(op_table));
    if (batch < 1) throw ParamError("batch", "must be >= 1");
    for (int n : deepcache)
        if (n < 1) throw ParamError("deepcache", "intervals must be >= 1");
#ifndef ANCHOR_HAVE_RECORD_PROFILE
    if (!profile.empty()) throw ParamError("profile", "needs LibTorch's legacy profiler header");
#endif
}

std::string sibling_profile_path(const std::string& profile, const std::string& suffix) {
    const std::filesystem::path p(profile);
    return (p.parent_path() / (p.stem().string() + suffix + p.extension().string())).string();
}

UNetConfig unet_config_of_family(SdFamily family) {
    if (family == SdFamily::SD1) return UNetConfig{};
    if (family != SdFamily::SDXL)
        throw ParamError("family", "the bench builds sd1 or sdxl shapes, not " + enum_name(sd_family_table(), family));
    UNetConfig c;
    c.sample_size = 128;
    c.block_out_channels = {320, 640, 1280};
    c.down_block_types = {"DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"};
    c.up_block_types = {"CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"};
    c.layers_per_block = {2, 2, 2};
    c.heads = {5, 10, 20};
    c.transformer_layers_per_block = {1, 2, 10};
    c.cross_attention_dim = 2048;
    c.use_linear_projection = true;
    c.addition_time_embed_dim = 256;
    c.projection_class_embeddings_input_dim = 2816;
    return c;
}

double unet_bench_macs(const UNetBenchParams& o) {
    return double(unet_mac_breakdown(o.unet, o.height / o.vae_factor, o.width / o.vae_factor, 77).full().total());
}

namespace {
// Seconds with four significant digits: a step of a small model (the embedded demo's UNet: ~3 ms, its shallow step
// ~0.5 ms) is not rounded to 0.003 or 0.000, and an SD 1.5 step keeps its milliseconds (1.168).
std::string secs(double x) {
    return util::fmt("%.4g", x);
}

std::string join_seconds(const std::vector<double>& t) {
    std::string s;
    for (double x : t) s += (s.empty() ? "" : " ") + secs(x);
    return s + " s";
}

// --op-table: the fast kernels' calls of `runs` more runs of `run`, and their wall time.
struct OpRecord {
    std::vector<kernels::OpTime> calls;
    double ms = 0;
    int runs = 0;
};

OpRecord record_ops(int runs, const std::function<void()>& run) {
    OpRecord r;
    r.runs = runs;
    kernels::op_timing_start();
    const double t0 = util::now_s();
    for (int i = 0; i < runs; ++i) run();
    r.ms = 1e3 * (util::now_s() - t0);
    r.calls = kernels::op_timing_stop();
    return r;
}

// The --op-table report of `what` (one run's mean): the slowest shapes, the totals per kind and what the timed kernels
// leave of the run.
void emit_op_table(const std::string& what, const OpRecord& r, double gemm_gflops, size_t rows,
                   const std::function<void(const std::string&)>& emit) {
    const double runs = std::max(r.runs, 1), run_ms = r.ms / runs;
    const auto groups = kernels::group_op_times(r.calls);
    double timed_ms = 0;
    for (const auto& g : groups) timed_ms += g.ms / runs;
    auto row = [&](const std::string& label, const kernels::OpTimeGroup& g) {
        const double ms = g.ms / runs, gf = g.ms > 0 ? 2.0 * g.macs / g.ms / 1e6 : 0.0;
        char buf[96];
        std::snprintf(buf, sizeof buf, "  %8.1f ms %5.1f %% %5dx", ms, 100.0 * ms / run_ms, int(g.calls / runs));
        std::string line = buf;
        if (g.macs > 0) {
            std::snprintf(buf, sizeof buf, " %7.1f GFLOP/s %5.1f %%  ", gf, 100.0 * gf / gemm_gflops);
            line += buf;
        } else {
            line += std::string(28, ' ');
        }
        return line + label;
    };
    emit(what + ", per-shape table" +
         (r.runs > 1 ? " (the mean of " + std::to_string(r.runs) + " more runs)" : " (one more run)") + ": " +
         std::to_string(size_t(r.calls.size() / runs)) + " timed kernel calls, " + util::fmt("%.1f", timed_ms) +
         " of " + util::fmt("%.1f", run_ms) +
         " ms; GFLOP/s = 2 x MACs / time, Winograd and the resize-convolution counted as the direct convolution; % "
         "of the GEMM rate above");
    emit("        time  share   calls    rate    of GEMM  kind: shape");
    for (size_t i = 0; i < groups.size() && i < rows; ++i)
        emit(row(groups[i].kind + ": " + groups[i].shape, groups[i]));
    emit("  per kind:");
    auto kinds = kernels::group_op_times(r.calls, false);
    std::sort(kinds.begin(), kinds.end(), [](const auto& a, const auto& b) { return a.kind < b.kind; });
    for (const auto& k : kinds) emit(row(k.kind, k));
    kernels::OpTimeGroup rest;
    rest.ms = r.ms - timed_ms * runs;
    emit(row("the rest (norms, activations, copies, adds, layers on LibTorch)", rest));
}
} // namespace

void run_unet_bench(const UNetBenchParams& o, const std::function<void(const std::string&)>& emit) {
    o.validate();
    const UNetConfig& cfg = o.unet;
    const int64_t lh = o.height / o.vae_factor, lw = o.width / o.vae_factor;
    const int64_t tokens = 77;
    const auto macs = unet_mac_breakdown(cfg, lh, lw, tokens);
    const auto full = macs.full();
    if (o.branch < 0 || o.branch >= macs.num_skips())
        throw ParamError("branch", "must be in [0, " + std::to_string(macs.num_skips()) + ")");

    emit("anchor-sd bench: " + o.unet_name + " (random weights), " + std::to_string(o.width) + "x" +
         std::to_string(o.height) + " (latent " + std::to_string(lw) + "x" + std::to_string(lh) + "), batch " +
         std::to_string(o.batch) + (o.batch == 2 ? " (one CFG step)" : "") + ", float32, " +
         std::to_string(torch::get_num_threads()) + " threads");
    emit("  " + cfg.describe());
    emit("  load average at start: " + util::load_average());
    emit(util::build_description(kernels::cpu_features_string()));
    emit("MACs per UNet forward, one sample (conv + linear layers, DeepCache's definition): " +
         format_gmacs(double(full.total())) + " GMACs");
    emit("  conv " + format_gmacs(double(full.conv), 3) + " G + linear " + format_gmacs(double(full.linear), 3) +
         " G = " + format_gmacs(double(full.total()), 3) + " G; attention matmuls (q k^T, p v; not counted above) " +
         format_gmacs(double(full.attention), 3) + " G");
    const double sd15_512 = double(unet_macs(UNetConfig{}, 64, 64).total());
    emit("  reference: SD 1.5 at 512x512 = " + format_gmacs(sd15_512, 2) +
         " G here vs 338.83 G in DeepCache (Ma et al. 2023), whose extra 0.22 G match conv-bias adds + 2 ops per "
         "GroupNorm/LayerNorm element");
    for (int n : o.deepcache) {
        const double per = deepcache_macs_per_step(macs, n, o.branch);
        emit("  deepcache:" + std::to_string(n) + " (branch " + std::to_string(o.branch) +
             ", uniform): " + format_gmacs(per, 2) + " G per step (full " + format_gmacs(double(full.total()), 2) +
             " G, cached step " + format_gmacs(double(macs.shallow(o.branch).total()), 2) + " G, " +
             util::fmt("%.2fx fewer", double(full.total()) / per) + ")");
    }
    emit("  published (DeepCache, SD 1.5 512x512): 338.83 G -> 130.45 G per step for deepcache:5");

    emit(std::string("  forward: ") +
         (o.baseline ? "plain module forwards (--baseline)" : "fast paths (unet/model/unet_perf.h)"));
    torch::manual_seed(uint64_t(o.seed));
    double t0 = util::now_s();
    UNet2DConditionModel model(cfg);
    model->eval();
    const kernels::AttentionKernel attention = o.attention.value_or(default_attention_kernel(cfg));
    model->set_attention_kernel(attention);
    model->set_fast_paths(!o.baseline);
    const kernels::GemmBackend backend = o.gemm.value_or(default_gemm_backend(attention));
    if (const auto why = kernels::gemm_backend_unavailable(backend); !why.empty()) throw ParamError("gemm", why);
    perf::set_gemm_backend(*model, backend);
    emit("  attention: " + enum_name(kernels::attention_kernel_table(), attention) +
         (o.attention ? "" : " (the default for these shapes)") +
         "; tiled kernel: " + enum_name(kernels::flash_isa_table(), kernels::flash_best_isa()));
    emit("  linear layers and convolutions: " + enum_name(kernels::gemm_backend_table(), backend) +
         (o.gemm ? "" : " (follows attention)") + "; " + kernels::onednn_description());
    for (auto& p : model->parameters()) p.set_requires_grad(false);
    store_weights_as(*model, o.weights_dtype);
    model->set_fused_qkv(o.fused_qkv);
    if (o.fused_qkv) emit("  self-attention: fused QKV (one GEMM for the three projections)");
    int64_t nparams = 0;
    for (const auto& p : model->parameters()) nparams += p.numel();
    emit("model: " + util::fmt("%.1f", double(nparams) / 1e6) + " M parameters (" +
         util::fmt("%.0f", double(parameter_bytes(*model)) / 1048576.0) + " MiB, weights " +
         enum_name(weights_dtype_table(), o.weights_dtype) + "), built in " + util::fmt("%.1f", util::now_s() - t0) +
         " s");
    // SD's VAE (the shapes of every SD 1.x/2.x/XL VAE), built now so that the run's peak RSS below counts both
    // models' weights and nothing of their random initialisation (built in float32, then converted).
    AutoencoderKL vae{nullptr};
    if (o.vae_repeat > 0) {
        torch::manual_seed(uint64_t(o.seed) + 1);
        vae = AutoencoderKL(VaeConfig{});
        vae->eval();
        vae->set_attention_kernel(attention);
        vae->set_fast_paths(!o.baseline);
        perf::set_gemm_backend(*vae, backend);
        for (auto& p : vae->parameters()) p.set_requires_grad(false);
        store_weights_as(*vae, o.weights_dtype);
    }
    const double build_peak = util::peak_rss_mib();
    const bool peak_reset = util::reset_peak_rss();

    auto sample = torch::randn({o.batch, cfg.in_channels, lh, lw});
    UNetCond context{torch::randn({o.batch, tokens, cfg.cross_attention_dim})};
    if (cfg.text_time()) { // SDXL: a pooled embedding and the default time ids (the output size, no crop)
        const int64_t pooled = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim;
        context.text_embeds = torch::randn({o.batch, pooled});
        context.time_ids = torch::tensor({float(o.height), float(o.width), 0.f, 0.f, float(o.height), float(o.width)})
                               .repeat({o.batch, 1});
    }
    auto timestep = torch::tensor(int64_t(999));

    // The steps and decodes as a txt2img run makes them: inside one heap scope (Txt2ImgPipeline::run), so a step's
    // freed blocks serve the next step (cache/util/heap.h).
    util::HeapScope heap;
    SkipFeatureCapture feats(o.branch);
    for (int i = 0; i < o.warmup; ++i) model->forward(sample, timestep, context, &feats);
    std::vector<double> times;
    torch::Tensor y;
    for (int i = 0; i < o.repeat; ++i) {
        t0 = util::now_s();
        y = model->forward(sample, timestep, context);
        times.push_back(util::now_s() - t0);
    }
    if (!torch::isfinite(y).all().item<bool>()) throw Error("bench: the UNet output is not finite");
    if (o.ab) {
        // Interleaved plain / fast steps: on a loaded machine both see the same load.
        std::vector<double> tp, tf;
        torch::Tensor yp, yf;
        for (int i = 0; i < o.repeat; ++i) {
            model->set_fast_paths(false);
            t0 = util::now_s();
            yp = model->forward(sample, timestep, context);
            tp.push_back(util::now_s() - t0);
            model->set_fast_paths(true);
            t0 = util::now_s();
            yf = model->forward(sample, timestep, context);
            tf.push_back(util::now_s() - t0);
        }
        model->set_fast_paths(!o.baseline);
        const util::Stats sp = util::stats_of(tp), sf = util::stats_of(tf);
        const double rel = (yf - yp).abs().max().item<double>() / yp.abs().max().item<double>();
        emit("A/B interleaved: plain min " + secs(sp.min) + " s / median " + secs(sp.median) + " s, fast min " +
             secs(sf.min) + " s / median " + secs(sf.median) + " s, speed-up " + util::fmt("%.3fx", sp.min / sf.min) +
             " (min), " + util::fmt("%.3fx", sp.median / sf.median) +
             " (median); max |fast - plain| / max |plain| = " + util::fmt("%.2e", rel));
    }
    const util::Stats st = util::stats_of(times);
    emit("UNet step (batch " + std::to_string(o.batch) + "): min " + secs(st.min) + " s, median " + secs(st.median) +
         " s, max " + secs(st.max) + " s over " + std::to_string(o.repeat) + " runs after " + std::to_string(o.warmup) +
         " warm-up");
    emit("  runs: " + join_seconds(times));

    util::Stats sh{};
    if (o.time_shallow && !o.deepcache.empty()) {
        if (!feats.feature.defined()) model->forward(sample, timestep, context, &feats);
        std::vector<double> ts;
        for (int i = 0; i < o.repeat + 1; ++i) { // first one warms the shallow shapes
            t0 = util::now_s();
            model->forward_shallow(sample, timestep, context, o.branch, feats.feature);
            if (i > 0) ts.push_back(util::now_s() - t0);
        }
        sh = util::stats_of(ts);
        emit("  cached (shallow, branch " + std::to_string(o.branch) + ") step: min " + secs(sh.min) + " s, median " +
             secs(sh.median) + " s");
        for (int n : o.deepcache)
            emit("  deepcache:" + std::to_string(n) + " -> " + secs((st.min + (n - 1) * sh.min) / n) + " s per step (" +
                 util::fmt("%.2fx", st.min * n / (st.min + (n - 1) * sh.min)) + ")");
    }

    OpRecord vae_ops;
    if (o.vae_repeat > 0) {
        // The decoder on one latent, with the UNet's attention choice: the mid-block attends over all latent positions
        // with one head of 512 channels.
        const auto z = torch::randn({1, 4, lh, lw});
        torch::Tensor img = vae->decode(z); // warm-up
        AutoencoderTiny taesd{nullptr};
        if (o.taesd) {
            taesd = AutoencoderTiny(TaesdConfig{}, false, true);
            taesd->eval();
            taesd->set_fast_paths(!o.baseline, backend); // the VAE's paths
            taesd->decode_latents(z);                    // warm-up
        }
        std::vector<double> tv, tt;
        for (int i = 0; i < o.vae_repeat; ++i) {
            t0 = util::now_s();
            img = vae->decode(z);
            tv.push_back(util::now_s() - t0);
            if (!taesd) continue;
            t0 = util::now_s();
            const auto small = taesd->decode_latents(z);
            tt.push_back(util::now_s() - t0);
            if (small.sizes() != img.sizes()) throw Error("bench: TAESD's image has another size than the VAE's");
        }
        if (!torch::isfinite(img).all().item<bool>()) throw Error("bench: the VAE output is not finite");
#ifdef ANCHOR_HAVE_RECORD_PROFILE
        if (!o.profile.empty()) { // --profile: one more decode under the profiler, next to the UNet step's trace
            torch::autograd::profiler::RecordProfile prof(sibling_profile_path(o.profile, "_vae"));
            vae->decode(z);
        }
#endif
        if (o.op_table > 0) vae_ops = record_ops(1, [&] { vae->decode(z); }); // --op-table: the decode's too
        const util::Stats sv = util::stats_of(tv);
        emit("VAE decode (batch 1, " + std::to_string(o.width) + "x" + std::to_string(o.height) + "): min " +
             secs(sv.min) + " s, median " + secs(sv.median) + " s, max " + secs(sv.max) + " s over " +
             std::to_string(o.vae_repeat) + " runs after 1 warm-up");
        emit("  runs: " + join_seconds(tv));
        if (!tt.empty()) {
            const util::Stats st_t = util::stats_of(tt);
            emit("TAESD decode (batch 1, " + std::to_string(o.width) + "x" + std::to_string(o.height) +
                 ", interleaved with the VAE's): min " + secs(st_t.min) + " s, median " + secs(st_t.median) +
                 " s, max " + secs(st_t.max) + " s; VAE / TAESD median " +
                 util::fmt("%.1fx", sv.median / st_t.median) + ", min " + util::fmt("%.1fx", sv.min / st_t.min));
            emit("  runs: " + join_seconds(tt));
        }
    }

    if (!o.profile.empty()) {
#ifdef ANCHOR_HAVE_RECORD_PROFILE
        // One more step under LibTorch's profiler: a chrome://tracing file with every aten op (per-op costs).
        {
            torch::autograd::profiler::RecordProfile prof(o.profile);
            model->forward(sample, timestep, context);
        }
        if (!o.profile_shallow.empty()) { // and one shallow (DeepCache) step next to it
            torch::autograd::profiler::RecordProfile prof(o.profile_shallow);
            model->forward_shallow(sample, timestep, context, o.branch, feats.feature);
        }
#endif
    }

    // --op-table: as many more steps as were timed, their kernel calls timed (printed once the GEMM rate is known).
    OpRecord step_ops;
    if (o.op_table > 0) step_ops = record_ops(o.repeat, [&] { model->forward(sample, timestep, context); });

    const double flops = 2.0 * double(full.total()) * double(o.batch);
    const double flops_attn = 2.0 * double(full.total() + full.attention) * double(o.batch);
    const double achieved = flops / st.min / 1e9, achieved_med = flops / st.median / 1e9;
    // The rate of the backend the layers ran on (oneDNN's matmul beside LibTorch's BLAS when it is oneDNN).
    const double gemm_torch = gemm_gflops(o.gemm_n, o.gemm_repeat, kernels::GemmBackend::Torch);
    const double gemm = kernels::runs_on_onednn(backend) ? gemm_gflops(o.gemm_n, o.gemm_repeat, backend) : gemm_torch;
    emit("achieved: " + util::fmt("%.1f", achieved) + " GFLOP/s (2 x MACs x batch / min time; median " +
         util::fmt("%.1f", achieved_med) + "), with attention matmuls " + util::fmt("%.1f", flops_attn / st.min / 1e9) +
         " GFLOP/s");
    emit("GEMM " + std::to_string(o.gemm_n) + "x" + std::to_string(o.gemm_n) + " fp32 (torch::mm, min of " +
         std::to_string(o.gemm_repeat) + "): " + util::fmt("%.1f", gemm_torch) + " GFLOP/s" +
         (gemm != gemm_torch ? "; oneDNN matmul (the layers' backend" +
                                   std::string(backend == kernels::GemmBackend::Bf16 ? ", bf16 operands" : "") +
                                   "): " + util::fmt("%.1f", gemm) + " GFLOP/s"
                             : ""));
    emit("ratio: " + util::fmt("%.1f", 100.0 * achieved / gemm) + " % of the GEMM rate (median " +
         util::fmt("%.1f", 100.0 * achieved_med / gemm) + " %; with attention matmuls " +
         util::fmt("%.1f", 100.0 * flops_attn / st.min / 1e9 / gemm) + " %)");
    if (o.op_table > 0) {
        emit_op_table("UNet step", step_ops, gemm, size_t(o.op_table), emit);
        if (vae_ops.runs > 0) emit_op_table("VAE decode", vae_ops, gemm, size_t(o.op_table), emit);
    }
    if (peak_reset)
        emit("peak RSS (VmHWM) of the run: " + util::fmt("%.0f", util::peak_rss_mib()) + " MiB (weights " +
             util::fmt("%.0f", double(parameter_bytes(*model) + (vae ? parameter_bytes(*vae) : 0)) / 1048576.0) +
             " MiB, steps" + (o.vae_repeat > 0 ? " and decodes" : "") +
             "); while building the random models: " + util::fmt("%.0f", build_peak) + " MiB");
    else
        emit("peak RSS (VmHWM): " + util::fmt("%.0f", util::peak_rss_mib()) +
             " MiB (building the random models included)");
    emit("load average at end: " + util::load_average());
}

} // namespace anchor::unet
