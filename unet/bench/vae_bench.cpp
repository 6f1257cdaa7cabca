#include "unet/bench/vae_bench.h"

#include "cache/io/error.h"
#include "cache/util/bench.h"
#include "cache/util/heap.h"
#include "kernels/onednn.h"
#include "unet/bench/unet_bench.h"
#include "unet/model/checkpoint.h"
#include "unet/model/unet_perf.h"

#include <torch/torch.h>

#include <sys/resource.h>

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
    const auto z = torch::randn({1, vc.latent_channels, p.height / 8, p.width / 8});
    const int64_t rss_before = util::rss_now_bytes();
    const bool reset = util::reset_peak_rss();
    std::vector<double> times, cpu;
    torch::Tensor img;
    for (int i = 0; i < p.warmup + p.repeat; ++i) {
        img = torch::Tensor(); // the previous image is not part of this decode's memory
        const double t0 = util::now_s(), c0 = cpu_seconds();
        img = vae_decode(*vae, vc.unscale_latents(z), p.tiling);
        if (i >= p.warmup) times.push_back(util::now_s() - t0), cpu.push_back(cpu_seconds() - c0);
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
    emit("decode: min " + secs(st.min) + " s, median " + secs(st.median) + " s, max " + secs(st.max) + " s over " +
         std::to_string(p.repeat) + " runs after " + std::to_string(p.warmup) + " warm-up; runs: " + runs);
    // On a shared machine the process's CPU time (all threads) says more about the work than the wall time.
    emit("decode CPU time (user + system, all threads): min " + secs(sc.min) + " s, median " + secs(sc.median) +
         " s; runs: " + cpu_runs);
    emit("RSS before the decodes: " + mib(double(rss_before)) + "; peak RSS (VmHWM" +
         (reset ? ", reset after the build" : ", since the start") + "): " + mib(double(peak)) +
         "; decode working memory (peak - before): " + mib(double(peak - rss_before)));
    emit("load average at end: " + util::load_average());
}

} // namespace anchor::unet
