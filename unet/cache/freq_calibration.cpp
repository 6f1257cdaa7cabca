#include "unet/cache/freq_calibration.h"

#include "cache/calibration.h"
#include "cache/io/error.h"
#include "unet/cache/freq_cache.h"

namespace anchor::unet {

void FreqCalibrationParams::validate() const {
    if (prompts.empty()) throw ParamError("prompts", "no prompt");
    if (ranges < 1) throw ParamError("ranges", "must be >= 1, got " + std::to_string(ranges));
    if (base.steps < 2) throw ParamError("steps", "must be >= 2, got " + std::to_string(base.steps));
    if (!(target > 0)) throw ParamError("target", "must be > 0");
}

cache::QualityTargetCalibration freq_target_calibration() {
    cache::QualityTargetCalibration c;
    c.ref_db = 30.0;
    c.db_per_halving = 6.0;
    return c;
}

cache::AnchorProfile calibrate_freq_profile(Txt2ImgPipeline& pipe, const FreqCalibrationParams& p,
                                            const std::function<void(size_t, const std::string&)>& on_prompt) {
    p.validate();
    Txt2ImgParams run = pipe.resolved(p.base);
    std::vector<double> mean;
    for (size_t i = 0; i < p.prompts.size(); ++i) {
        run.prompts = {p.prompts[i]};
        run.seed = p.base.seed + int64_t(i);
        auto ctl = make_cache_controller(CacheConfig{}); // off: every step full
        pipe.run(run, ctl.get());
        const auto& log = ctl->log();
        mean.resize(log.size(), 0.0);
        for (size_t k = 0; k < log.size(); ++k) mean[k] += log[k].energy_change / double(p.prompts.size());
        if (on_prompt) on_prompt(i, p.prompts[i]);
    }
    auto profile = cache::build_step_profile(mean, p.ranges, p.target);
    profile.meta = {{"written_by", "anchor-sd calibrate"},  {"steps", run.steps},
                    {"sampler", sampler_name(run.sampler)}, {"cfg_scale", run.guidance_scale},
                    {"prompts", p.prompts.size()},          {"target_steps_of_change", p.target},
                    {"mean_energy_change_per_step", mean}};
    return profile;
}

} // namespace anchor::unet
