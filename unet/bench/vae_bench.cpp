#include "unet/bench/vae_bench.h"

#include "cache/io/error.h"
#include "cache/io/safetensors.h"
#include "cache/util/bench.h"
#include "cache/util/heap.h"
#include "kernels/onednn.h"
#include "unet/bench/unet_bench.h"
#include "unet/model/checkpoint.h"
#include "unet/model/taesd.h"
#include "unet/model/unet_perf.h"

#include <torch/torch.h>

#include <sys/resource.h>

#include <filesystem>

#include <string>
#include <vector>

namespace anchor::unet {

namespace {
double cpu_seconds() {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + 1e-6 * double(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}
} // namespace

void VaeBenchParams::validate() const {
    if (width <= 0 || height <= 0 || width % 8 || height % 8)
        throw ParamError(width <= 0 || width % 8 ? "width" : "height",
                         "must be positive multiples of the VAE factor 8, got " + std::to_string(width) + "x" +
                             std::to_string(height));
    if (repeat < 1) throw ParamError("repeat", "must be >= 1, got " + std::to_string(repeat));
    if (warmup < 0) throw ParamError("warmup", "must be >= 0, got " + std::to_string(warmup));
    if (tiling.enabled) tiling.validate(8);
}

void run_vae_bench(const VaeBenchParams& p, const std::function<void(const std::string&)>& emit) {
    p.validate();
    if (p.taesd_only && !p.taesd) throw ParamError("taesd_only", "needs a TAESD (--taesd or --taesd-file)");
    torch::NoGradGuard no_grad;
    const auto mib = [](double b) { return util::fmt("%.0f", b / 1048576.0) + " MiB"; };
    const auto secs = [](double s) { return util::fmt("%.2f", s); };
    emit("load average at start: " + util::load_average());
    torch::manual_seed(uint64_t(p.seed));
    VaeConfig vc; // SDXL's VAE: the SD shapes, scaling_factor 0.13025, force_upcast (float32 here either way)
    vc.scaling_factor = 0.13025;
    vc.force_upcast = true;
    AutoencoderKL vae(vc);
    vae->eval();
    for (auto& w : vae->parameters()) w.set_requires_grad(false);
    const auto attention = p.attention.value_or(default_attention_kernel(unet_config_of_family(SdFamily::SDXL)));
    const auto gemm = p.gemm.value_or(default_gemm_backend(attention));
    if (const auto why = kernels::gemm_backend_unavailable(gemm); !why.empty()) throw ParamError("gemm", why);
    vae->set_attention_kernel(attention);
    vae->set_fast_paths(true);
    perf::set_gemm_backend(*vae, gemm);
    const std::string how = p.tiling.enabled ? "tiled: tile " + std::to_string(p.tiling.tile_sample_size) + " px (" +
                                                   std::to_string(p.tiling.tile_sample_size / 8) +
                                                   " latents), overlap " + util::fmt("%g", p.tiling.overlap)
                                             : "plain (untiled)";
    emit("VAE decode " + std::to_string(p.width) + "x" + std::to_string(p.height) +
         ", SDXL VAE shapes (random weights, float32, batch 1), " + how + "; attention " +
         enum_name(kernels::attention_kernel_table(), attention) + ", gemm " +
         enum_name(kernels::gemm_backend_table(), gemm) + ", " + std::to_string(at::get_num_threads()) + " threads");
    emit("weights: " + mib(double(parameter_bytes(*vae))));
    AutoencoderTiny taesd{nullptr};
    if (p.taesd) {
        taesd = p.taesd_file.empty() ? AutoencoderTiny(TaesdConfig{}, false, true) : load_taesd(p.taesd_file);
        if (!taesd->has_decoder()) throw Error("bench-vae: the TAESD '" + p.taesd_file + "' has no decoder");
        if (taesd->config().decoder_factor() != 8 || taesd->config().latent_channels != vc.latent_channels)
            throw Error("bench-vae: the TAESD does not decode the VAE's latents (factor " +
                        std::to_string(taesd->config().decoder_factor()) + ", " +
                        std::to_string(taesd->config().latent_channels) + " channels)");
        taesd->eval();
        for (auto& w : taesd->parameters()) w.set_requires_grad(false);
        taesd->set_fast_paths(true, gemm);
        emit("TAESD decoder: " + (p.taesd_file.empty() ? std::string("the published shapes, random weights")
                                                       : taesd->source) +
             ", " + mib(double(parameter_bytes(*taesd))) + ", decoded after each VAE decode (interleaved)");
    }
    const auto z = torch::randn({1, vc.latent_channels, p.height / 8, p.width / 8});
    const int64_t rss_before = util::rss_now_bytes();
    const bool reset = util::reset_peak_rss();
    std::vector<double> times, cpu, taesd_times;
    torch::Tensor img, small;
    for (int i = 0; i < p.warmup + p.repeat; ++i) {
        img = torch::Tensor(); // the previous image is not part of this decode's memory
        const double t0 = util::now_s(), c0 = cpu_seconds();
        img = p.taesd_only ? torch::zeros({1, 3, p.height, p.width}) : vae_decode(*vae, vc.unscale_latents(z), p.tiling);
        if (i >= p.warmup) times.push_back(util::now_s() - t0), cpu.push_back(cpu_seconds() - c0);
        if (taesd) {
            small = torch::Tensor();
            const double t1 = util::now_s();
            small = taesd->decode_latents(z); // the pipeline's latents / scaling_factor 1
            if (i >= p.warmup) taesd_times.push_back(util::now_s() - t1);
        }
    }
    const int64_t peak = util::peak_rss_bytes();
    if (!torch::isfinite(img).all().item<bool>()) throw Error("bench-vae: the decoded image is not finite");
    if (img.size(2) != p.height || img.size(3) != p.width)
        throw Error("bench-vae: decoded " + std::to_string(img.size(3)) + "x" + std::to_string(img.size(2)));
    std::string runs, cpu_runs;
    for (double t : times) runs += (runs.empty() ? "" : " ") + secs(t);
    for (double t : cpu) cpu_runs += (cpu_runs.empty() ? "" : " ") + secs(t);
    const auto sc = util::stats_of(cpu);
    const auto st = util::stats_of(times);
    if (!p.taesd_only) {
        emit("decode: min " + secs(st.min) + " s, median " + secs(st.median) + " s, max " + secs(st.max) + " s over " +
             std::to_string(p.repeat) + " runs after " + std::to_string(p.warmup) + " warm-up; runs: " + runs);
        // On a shared machine the process's CPU time (all threads) says more about the work than the wall time.
        emit("decode CPU time (user + system, all threads): min " + secs(sc.min) + " s, median " + secs(sc.median) +
             " s; runs: " + cpu_runs);
    }
    if (taesd) {
        if (!torch::isfinite(small).all().item<bool>() || small.size(2) != p.height || small.size(3) != p.width)
            throw Error("bench-vae: the TAESD image is not finite or not " + std::to_string(p.width) + "x" +
                        std::to_string(p.height));
        std::string truns;
        for (double t : taesd_times) truns += (truns.empty() ? "" : " ") + util::fmt("%.3f", t);
        const auto tt = util::stats_of(taesd_times);
        emit("TAESD decode: min " + util::fmt("%.3f", tt.min) + " s, median " + util::fmt("%.3f", tt.median) +
             " s, max " + util::fmt("%.3f", tt.max) + " s; runs: " + truns);
        if (!p.taesd_only)
            emit("VAE / TAESD: median " + util::fmt("%.1f", st.median / tt.median) + "x, min " +
                 util::fmt("%.1f", st.min / tt.min) + "x");
    }
    emit("RSS before the decodes: " + mib(double(rss_before)) + "; peak RSS (VmHWM" +
         (reset ? ", reset after the build" : ", since the start") + "): " + mib(double(peak)) +
         "; decode working memory (peak - before): " + mib(double(peak - rss_before)));
    emit("load average at end: " + util::load_average());
}

int64_t write_random_taesd(const std::string& path, int64_t seed, torch::ScalarType dtype, bool overwrite) {
    if (!overwrite && std::filesystem::exists(path))
        throw Error("'" + path + "' exists (give --overwrite to replace it)");
    torch::manual_seed(uint64_t(seed));
    AutoencoderTiny t(TaesdConfig{}, true, true);
    NamedTensors tensors;
    int64_t bytes = 0;
    for (const auto& p : t->named_parameters()) {
        tensors.emplace_back(p.key(), p.value().detach().to(dtype).contiguous());
        bytes += tensors.back().second.numel() * int64_t(tensors.back().second.element_size());
    }
    save_safetensors(path, tensors, {}, overwrite);
    return bytes;
}

} // namespace anchor::unet
