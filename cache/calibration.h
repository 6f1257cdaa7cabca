// Calibration of anchor profiles (cache/anchor_profile.h) from measurements of uncached runs. Model-free: the callers
// measure (the SD shallow probe's per-step spectral change, the text diffusion LM's per-layer hidden-state change)
// and hand the numbers over.
#pragma once

#include "cache/anchor_profile.h"

#include <cstdint>
#include <vector>

namespace anchor::cache {

// k-means (1-D, deterministic initialisation at quantiles of the distinct values) of `values` into at most k
// classes; centroids sorted ascending, empty classes dropped, assignment[i] the class of values[i].
void kmeans_1d(const std::vector<double>& values, int64_t k, std::vector<double>& centroids,
               std::vector<int64_t>& assignment, int iterations = 100);

// Layer classes from deltas[layer][time bin] (mean hidden-state change): k-means into at most k classes, rank-based
// staleness from max_stale (the most stable class) down to 1 (the least stable one).
AnchorProfile build_layer_profile(const std::vector<std::vector<double>>& deltas, int64_t k, int64_t max_stale);

// Step ranges from the mean change per loop step (mean_change[k], step 0 ignored: it is always full): `n_ranges`
// equal ranges of the loop, threshold = target x the range's mean change, i.e. a full step after about `target`
// steps of typical change for that part of the trajectory.
AnchorProfile build_step_profile(const std::vector<double>& mean_change, int n_ranges, double target);

} // namespace anchor::cache
