#include "unet/bench/cache_bench_sd3.h"

#include "cache/io/error.h"
#include "cache/metrics.h"
#include "cache/util/bench.h"
#include "unet/cache/dit_cache_config.h"

namespace anchor::unet {

void Sd3CacheBenchParams::validate() const {
    if (modes.empty()) throw ParamError("modes", "no cache mode");
    for (const auto& m : modes) check_dit_cache_config(m, "modes");
    if (prompts.empty()) throw ParamError("prompts", "no prompt");
    if (repeat < 1) throw ParamError("repeat", "must be >= 1, got " + std::to_string(repeat));
    if (seeds < 1) throw ParamError("seeds", "must be >= 1, got " + std::to_string(seeds));
}

CacheBenchReport run_sd3_cache_bench(SD3Models& m, const Sd3CacheBenchParams& p,
                                     const std::function<void(const std::string&)>& log) {
    p.validate();
    SD3Txt2ImgParams run = p.base;
    run.prompts = {p.prompts.front()};
    run.cache = CacheConfig{};
    const SD3RunShape shape = sd3_check_params(m, run);
    CacheBenchReport rep;
    rep.images = true;
    for (const auto& c : p.modes) rep.modes.push_back({c.label});
    rep.setup = std::to_string(shape.width) + "x" + std::to_string(shape.height) + ", " + std::to_string(run.steps) +
                " flow_match_euler steps, CFG " + util::fmt("%.1f", run.guidance_scale) + ", " +
                std::to_string(p.prompts.size()) + " prompt(s) x " + std::to_string(p.seeds) + " seed(s) x " +
                std::to_string(p.repeat) + " interleaved repeat(s), on cpu; SD 3 / 3.5 (" +
                std::to_string(m.transformer->config().num_layers) + " joint blocks, " +
                (m.text_encoder_3 ? "T5" : "no T5") + ")";
    { // warm-up: weights paged in, kernels chosen, at the benchmark's shape
        auto warm = run;
        warm.steps = 1;
        (void)sd3_txt2img(m, warm);
    }
    for (const auto& prompt : p.prompts)
        for (int s = 0; s < p.seeds; ++s) {
            run.prompts = {prompt};
            run.seed = p.base.seed + s;
            for (int r = 0; r < p.repeat; ++r) {
                torch::Tensor ref;
                for (size_t k = 0; k < p.modes.size(); ++k) { // interleaved: every mode sees the same machine state
                    run.cache = p.modes[k];
                    const double t0 = util::now_s();
                    const auto res = sd3_txt2img(m, run);
                    const double image_s = util::now_s() - t0;
                    auto& e = rep.modes[k];
                    e.wall_s.push_back(res.denoise_s);
                    e.image_s.push_back(image_s);
                    e.full_steps = res.cache_log.value("full_steps", 0);
                    e.total_steps = int(res.cache_steps.size());
                    const auto img = res.image[0].permute({1, 2, 0}).contiguous();
                    if (k == 0) ref = img;
                    e.psnr.push_back(cache::psnr(img, ref, 1.0));
                    e.ssim.push_back(cache::ssim(img, ref, 1.0));
                    if (log)
                        log(e.mode + ": " + util::fmt("%.3f s loop, ", res.denoise_s) +
                            util::fmt("%.3f s image, ", image_s) + std::to_string(e.full_steps) + "/" +
                            std::to_string(e.total_steps) + " full");
                }
            }
        }
    return rep;
}

} // namespace anchor::unet
