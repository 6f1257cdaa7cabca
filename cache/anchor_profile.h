// Anchor profiles: calibrated per-step and per-layer settings of an anchor cache, one type and one JSON format for
// both paths (cache/calibration.h builds them from measurements of uncached runs).
//
// * Step ranges (Stable Diffusion freq, unet/cache/freq_cache.h): the loop is split into ranges [begin, end) of its length
//   (fractions, so one profile serves any step count); each range has the full-step threshold on the accumulated
//   spectral change. The change per step falls ~10x along a trajectory, so one fixed threshold reuses little early
//   and too much late.
// * Layer classes (text diffusion, text/diffusion/mdlm_cache.h): per (layer, time bin) a stability class (k-means of the
//   measured hidden-state change), each class with a staleness: how many steps an anchored entry may serve.
//
// Format "anchorcache-profile-1": {"format", "step_ranges": [{begin, end, threshold, mean_change}], "layers":
// {n_layers, time_bins, classes: [{centroid, staleness}], class_of: [[...]]}, "meta"}; either section may be absent.
// The two formats it replaces are read too: "anchorcache-mdlm-profile-1" (layers only) and {"kind": "anchor-sd freq
// profile", "ranges": [...]} (step ranges only).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace anchor::cache {

struct StepRange {
    double begin = 0, end = 1; // fractions of the loop
    double threshold = 0;      // full-step threshold of the range
    double mean_change = 0;    // the measurement it came from (informational)
};

struct AnchorProfile {
    std::vector<StepRange> step_ranges;

    int64_t n_layers = 0;
    int64_t time_bins = 0;                      // class_of[l] has one entry per time bin over t in (1, 0]
    std::vector<double> centroids;              // per class: mean change
    std::vector<int64_t> class_stale;           // per class: staleness
    std::vector<std::vector<int64_t>> class_of; // [layer][bin]

    nlohmann::json meta = nlohmann::json::object(); // calibration facts (model, prompts, steps, ...)

    bool has_step_ranges() const { return !step_ranges.empty(); }
    bool has_layer_classes() const { return n_layers > 0; }

    // Threshold of each step of a loop of `num_steps` steps: the range holding the step's centre (k + 0.5) / n, else
    // `fallback`.
    std::vector<double> step_thresholds(int num_steps, double fallback) const;
    // Staleness of `layer` at `step` of `total_steps` (time bin step * time_bins / total_steps). Throws anchor::Error
    // for a layer out of range or a profile without layer classes.
    int64_t staleness(int64_t layer, int64_t step, int64_t total_steps) const;

    nlohmann::json to_json() const;
    // Throws anchor::Error naming `source` and the field for malformed input.
    static AnchorProfile from_json(const nlohmann::json& j, const std::string& source = "anchor profile");
    static AnchorProfile load(const std::string& path);
    void save(const std::string& path, bool overwrite) const; // atomic, never replaces a file unless `overwrite`
};

} // namespace anchor::cache
