// Calibration of the freq cache (`anchor-sd calibrate`): uncached generations over a set of prompts; the mean
// per-step low-band energy change r_k of the shallow probe (freq_cache.h, rule 1); thresholds per range of steps =
// target x the mean r_k in the range (cache::build_step_profile), i.e. a full step after about `target` steps of
// typical change for that part of the trajectory. r_k falls by ~10x from the first to the last steps, so one fixed
// threshold reuses little early and too much late; the profile evens that out.
#pragma once

#include "cache/anchor_policy.h"
#include "cache/anchor_profile.h"
#include "unet/pipeline/pipeline.h"

#include <functional>
#include <string>
#include <vector>

namespace anchor::unet {

struct FreqCalibrationParams {
    Txt2ImgParams base;               // sampler, steps, guidance, size; the seed of the first prompt
    std::vector<std::string> prompts; // one uncached run each, seed base.seed + i
    int ranges = 4;                   // equal ranges of the loop
    double target = 3.0;              // steps of typical change per full step
    void validate() const;            // ParamError naming the field
};

// The calibration of freq:target=T (cache::target_threshold_scale): the 5th-percentile image's PSNR at the given
// thresholds and its change per halving of them, measured on the tuning seeds (docs/caching.md, "freq: the quality
// target", cites the results).
cache::QualityTargetCalibration freq_target_calibration();

// The profile (step ranges; its meta records the parameters and the measured mean change per step). `on_prompt`
// hears each prompt when its run is done.
cache::AnchorProfile calibrate_freq_profile(Txt2ImgPipeline& pipe, const FreqCalibrationParams& p,
                                            const std::function<void(size_t, const std::string&)>& on_prompt = {});

} // namespace anchor::unet
