#include "cache/calibration.h"

#include "cache/io/error.h"

#include <algorithm>
#include <cmath>

namespace anchor::cache {

void kmeans_1d(const std::vector<double>& values, int64_t k, std::vector<double>& centroids,
               std::vector<int64_t>& assignment, int iterations) {
    if (values.empty()) throw Error("k-means: no values");
    std::vector<double> uniq = values;
    std::sort(uniq.begin(), uniq.end());
    uniq.erase(std::unique(uniq.begin(), uniq.end()), uniq.end());
    k = std::max<int64_t>(1, std::min<int64_t>(k, int64_t(uniq.size())));
    centroids.assign(size_t(k), 0.0);
    for (int64_t i = 0; i < k; ++i) // quantile initialisation over the distinct values: deterministic
        centroids[size_t(i)] = uniq[size_t((i * 2 + 1) * int64_t(uniq.size()) / (2 * k))];
    assignment.assign(values.size(), 0);
    auto assign = [&] {
        bool changed = false;
        for (size_t i = 0; i < values.size(); ++i) {
            int64_t best = 0;
            for (int64_t c = 1; c < k; ++c)
                if (std::abs(values[i] - centroids[size_t(c)]) < std::abs(values[i] - centroids[size_t(best)]))
                    best = c;
            changed |= assignment[i] != best;
            assignment[i] = best;
        }
        return changed;
    };
    assign();
    for (int it = 0; it < iterations; ++it) {
        std::vector<double> sum(size_t(k), 0.0);
        std::vector<int64_t> cnt(size_t(k), 0);
        for (size_t i = 0; i < values.size(); ++i)
            sum[size_t(assignment[i])] += values[i], cnt[size_t(assignment[i])]++;
        for (int64_t c = 0; c < k; ++c)
            if (cnt[size_t(c)]) centroids[size_t(c)] = sum[size_t(c)] / double(cnt[size_t(c)]);
        if (!assign()) break;
    }
    // Sort classes by centroid and drop empty ones.
    std::vector<int64_t> cnt(size_t(k), 0);
    for (auto a : assignment) cnt[size_t(a)]++;
    std::vector<int64_t> order;
    for (int64_t c = 0; c < k; ++c)
        if (cnt[size_t(c)]) order.push_back(c);
    std::sort(order.begin(), order.end(),
              [&](int64_t a, int64_t b) { return centroids[size_t(a)] < centroids[size_t(b)]; });
    std::vector<int64_t> remap(size_t(k), -1);
    std::vector<double> sorted;
    for (size_t r = 0; r < order.size(); ++r)
        remap[size_t(order[r])] = int64_t(r), sorted.push_back(centroids[size_t(order[r])]);
    for (auto& a : assignment) a = remap[size_t(a)];
    centroids = sorted;
}

AnchorProfile build_layer_profile(const std::vector<std::vector<double>>& deltas, int64_t k, int64_t max_stale) {
    if (deltas.empty() || deltas[0].empty()) throw Error("layer profile: no deltas");
    std::vector<double> flat;
    for (const auto& row : deltas) {
        if (row.size() != deltas[0].size()) throw Error("layer profile: ragged deltas");
        flat.insert(flat.end(), row.begin(), row.end());
    }
    AnchorProfile p;
    std::vector<int64_t> assign;
    kmeans_1d(flat, k, p.centroids, assign);
    p.n_layers = int64_t(deltas.size());
    p.time_bins = int64_t(deltas[0].size());
    const int64_t K = int64_t(p.centroids.size());
    // Rank-based staleness: the most stable class (smallest change) may be reused for max_stale steps, the least
    // stable one only for 1 (dLLM-Cache uses one interval per token group; here each class gets its own).
    for (int64_t c = 0; c < K; ++c) {
        const double frac = K > 1 ? double(c) / double(K - 1) : 0.0;
        p.class_stale.push_back(std::max<int64_t>(1, std::llround(double(max_stale) - double(max_stale - 1) * frac)));
    }
    p.class_of.assign(size_t(p.n_layers), std::vector<int64_t>(size_t(p.time_bins)));
    for (int64_t l = 0; l < p.n_layers; ++l)
        for (int64_t s = 0; s < p.time_bins; ++s)
            p.class_of[size_t(l)][size_t(s)] = assign[size_t(l * p.time_bins + s)];
    return p;
}

AnchorProfile build_step_profile(const std::vector<double>& mean_change, int n_ranges, double target) {
    if (n_ranges < 1) throw Error("step profile: ranges must be >= 1, got " + std::to_string(n_ranges));
    if (!(target > 0)) throw Error("step profile: target must be > 0");
    if (mean_change.size() < 2) throw Error("step profile: needs at least 2 steps of measurements");
    AnchorProfile p;
    const int n = int(mean_change.size());
    for (int r = 0; r < n_ranges; ++r) {
        StepRange range;
        range.begin = double(r) / n_ranges;
        range.end = double(r + 1) / n_ranges;
        double sum = 0;
        int cnt = 0;
        for (int k = 1; k < n; ++k) { // step 0 has no change (always full)
            const double x = (k + 0.5) / n;
            if (x >= range.begin && x < range.end) sum += mean_change[size_t(k)], ++cnt;
        }
        range.mean_change = cnt ? sum / cnt : 0.0;
        range.threshold = std::max(1e-6, target * range.mean_change);
        p.step_ranges.push_back(range);
    }
    return p;
}

} // namespace anchor::cache
