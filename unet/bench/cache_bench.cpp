#include "unet/bench/cache_bench.h"

#include "cache/io/error.h"
#include "cache/metrics.h"
#include "cache/util/bench.h"
#include "unet/cache/freq_cache.h"

#include <cmath>

namespace anchor::unet {

void CacheBenchParams::validate() const {
    if (modes.empty()) throw ParamError("modes", "no cache mode");
    if (repeat < 1) throw ParamError("repeat", "must be >= 1, got " + std::to_string(repeat));
    if (seeds < 1) throw ParamError("seeds", "must be >= 1, got " + std::to_string(seeds));
}

SDModels random_unet_models(const UNetConfig& cfg, uint64_t seed, torch::Device device) {
    torch::manual_seed(seed);
    SDModels m;
    m.layout = "random-weights";
    m.unet = UNet2DConditionModel(cfg);
    m.unet->eval();
    for (auto& p : m.unet->parameters()) p.set_requires_grad(false);
    m.unet->to(device);
    return m;
}

namespace {

double mean_finite(const std::vector<double>& v) {
    if (v.empty()) return NAN;
    double s = 0;
    size_t n = 0;
    for (double x : v)
        if (!std::isinf(x)) s += x, ++n;
    return n ? s / double(n) : INFINITY; // all identical -> inf
}

void take_log(const CacheController& c, CacheBenchMode& m) {
    double macs = 0;
    int full = 0;
    for (const auto& s : c.log()) macs += s.macs, full += s.full ? 1 : 0;
    m.full_steps = full;
    m.total_steps = int(c.log().size());
    m.macs_per_step = c.log().empty() ? 0 : macs / double(c.log().size());
    for (const auto& s : c.log()) m.d2h_scalars_per_step = std::max(m.d2h_scalars_per_step, s.d2h_scalars);
}

double latent_psnr(const torch::Tensor& x, const torch::Tensor& ref) {
    const double range = (ref.max() - ref.min()).item<double>();
    const double mse = (x - ref).pow(2).mean().item<double>();
    return mse == 0 ? INFINITY : 10 * std::log10(range * range / mse);
}

std::string fmt_db(double db) {
    return std::isinf(db) ? "inf" : util::fmt("%.2f dB", db);
}

} // namespace

CacheBenchReport run_cache_bench(Txt2ImgPipeline& pipe, const CacheBenchParams& p,
                                 const std::function<void(const std::string&)>& log) {
    p.validate();
    CacheBenchReport rep;
    auto& models = pipe.models();
    rep.images = models.vae && models.text_encoder;
    Txt2ImgParams run = pipe.resolved(p.base);
    run.decode = rep.images;
    if (!models.text_encoder) { // random weights: random text conditioning, one "prompt"
        const bool cfg = run.guidance_scale > 1.0;
        auto gen = at::detail::createCPUGenerator(uint64_t(run.seed) + 1);
        run.prompt_embeds = torch::randn({cfg ? 2 : 1, 77, models.unet->config().cross_attention_dim}, gen);
        run.prompts = {""};
    }
    const auto prompts = models.text_encoder ? p.prompts : std::vector<std::string>{""};
    if (prompts.empty()) throw ParamError("prompts", "no prompt");
    for (const auto& m : p.modes) {
        check_cache_config(m, *models.unet, "modes");
        rep.modes.push_back({m.label});
    }
    rep.setup = std::to_string(run.width) + "x" + std::to_string(run.height) + ", " + std::to_string(run.steps) + " " +
                sampler_name(run.sampler) + " steps, CFG " + util::fmt("%.1f", run.guidance_scale) + ", " +
                std::to_string(prompts.size()) + " prompt(s) x " + std::to_string(p.seeds) + " seed(s) x " +
                std::to_string(p.repeat) + " interleaved repeat(s), on " + run.device.str();
    { // warm-up: weights paged in, kernels loaded, the shallow shapes too
        auto warm = run;
        warm.steps = std::min(run.steps, 3);
        CacheConfig dc;
        dc.params = DeepCacheParams{2, 0};
        auto c = make_cache_controller(dc);
        pipe.run(warm, c.get());
    }
    for (const auto& prompt : prompts)
        for (int s = 0; s < p.seeds; ++s) {
            if (models.text_encoder) run.prompts = {prompt};
            run.seed = p.base.seed + s;
            for (int r = 0; r < p.repeat; ++r) {
                torch::Tensor ref;
                for (size_t k = 0; k < p.modes.size(); ++k) { // interleaved: every mode sees the same machine state
                    auto c = make_cache_controller(p.modes[k]);
                    const double t0 = util::now_s();
                    auto res = pipe.run(run, c.get());
                    const double image_s = util::now_s() - t0;
                    auto& m = rep.modes[k];
                    m.wall_s.push_back(res.denoise_s);
                    m.image_s.push_back(image_s);
                    take_log(*c, m);
                    if (rep.images) {
                        const auto img = res.image[0].permute({1, 2, 0}).contiguous();
                        if (k == 0) ref = img;
                        m.psnr.push_back(cache::psnr(img, ref, 1.0));
                        m.ssim.push_back(cache::ssim(img, ref, 1.0));
                    } else {
                        if (k == 0) ref = res.final_latents;
                        m.psnr.push_back(latent_psnr(res.final_latents, ref));
                    }
                    if (log) log(m.mode + ": " + util::fmt("%.3f s loop, ", res.denoise_s) + util::fmt("%.3f s image", image_s));
                }
            }
        }
    return rep;
}

nlohmann::json CacheBenchReport::to_json() const {
    nlohmann::json j = {{"benchmark", "anchor-sd bench-cache"}, {"setup", setup}, {"modes", nlohmann::json::array()}};
    const double base = util::stats_of(modes.at(0).wall_s).median;
    const double image_base = util::stats_of(modes.at(0).image_s).median;
    for (const auto& m : modes) {
        const double psnr = mean_finite(m.psnr), med = util::stats_of(m.wall_s).median;
        const double image_med = util::stats_of(m.image_s).median;
        j["modes"].push_back(
            {{"mode", m.mode},
             {"full_steps", m.full_steps},
             {"total_steps", m.total_steps},
             {"gmacs_per_step", m.macs_per_step / 1e9},
             {"d2h_scalars_per_step", m.d2h_scalars_per_step},
             {"wall_s", m.wall_s},
             {"wall_s_median", med},
             {"speedup_vs_first_median", base / med},
             {"image_s", m.image_s},
             {"image_s_median", image_med},
             {"image_speedup_vs_first_median", image_base / image_med},
             {images ? "psnr_db" : "latent_psnr_db", std::isinf(psnr) ? nlohmann::json("inf") : nlohmann::json(psnr)},
             {"ssim", images ? nlohmann::json(mean_finite(m.ssim)) : nlohmann::json(nullptr)}});
    }
    return j;
}

std::string CacheBenchReport::table() const {
    size_t w = 4;
    for (const auto& m : modes) w = std::max(w, m.mode.size());
    char line[512];
    std::string out;
    std::snprintf(line, sizeof line, "%-*s %6s %10s %8s %24s %9s %24s %9s %10s %7s\n", int(w), "mode", "full",
                  "GMACs/step", "MAC red.", "loop s min/median/max", "speed-up", "image s min/median/max", "speed-up",
                  images ? "PSNR" : "latentPSNR", images ? "SSIM" : "");
    out += line;
    const double base = util::stats_of(modes.at(0).wall_s).median, macs0 = modes.at(0).macs_per_step;
    const double image_base = util::stats_of(modes.at(0).image_s).median;
    const auto min_med_max = [](const util::Stats& s) {
        return util::fmt("%.3f", s.min) + "/" + util::fmt("%.3f", s.median) + "/" + util::fmt("%.3f", s.max);
    };
    for (const auto& m : modes) {
        const auto s = util::stats_of(m.wall_s), si = util::stats_of(m.image_s);
        const std::string full = std::to_string(m.full_steps) + "/" + std::to_string(m.total_steps);
        // No MAC model (the SD 3 transformer's runs): the MAC columns stay empty.
        const bool macs = m.macs_per_step > 0 && macs0 > 0;
        const std::string gmacs = macs ? util::fmt("%.2f", m.macs_per_step / 1e9) : "-";
        const std::string mac_red = macs ? util::fmt("%.2fx", macs0 / m.macs_per_step) : "-";
        std::snprintf(line, sizeof line, "%-*s %6s %10s %8s %24s %8.2fx %24s %8.2fx %10s %7s\n", int(w),
                      m.mode.c_str(), full.c_str(), gmacs.c_str(), mac_red.c_str(),
                      min_med_max(s).c_str(), base / s.median, min_med_max(si).c_str(), image_base / si.median,
                      fmt_db(mean_finite(m.psnr)).c_str(),
                      images ? util::fmt("%.4f", mean_finite(m.ssim)).c_str() : "");
        out += line;
    }
    return out;
}

} // namespace anchor::unet
