// Calibration of the text-diffusion cache's anchor profile: per-layer hidden-state change of uncached sampling
// runs, classed by cache::build_layer_profile (cache/calibration.h) into the profile `anchor:profile=FILE` reads.
#pragma once

#include "cache/anchor_profile.h"
#include "text/diffusion/mdlm_sampler.h"

#include <vector>

namespace anchor::text {

struct CalibrateOptions {
    std::vector<std::vector<int64_t>> prompts; // GPT-2-side ids
    SamplerOptions sampler;                    // prompt field ignored
    int64_t classes = 16;
    int64_t max_stale = 8;
    void validate() const; // ParamError naming the field
};

// Uncached sampling on every prompt; Delta[l][s] = mean over positions decoded at both steps s-1 and s (same token)
// of ||H_s - H_{s-1}|| after block l, averaged over prompts; then k-means classes (cache::build_layer_profile).
cache::AnchorProfile calibrate_mdlm(MdlmModel& model, const CalibrateOptions& opt,
                                    std::vector<std::vector<double>>* deltas_out = nullptr);

} // namespace anchor::text
