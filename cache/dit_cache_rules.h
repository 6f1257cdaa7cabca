// The decision rules of the diffusion-transformer cache modes (unet/cache/dit_cache.h), apart from the tensors: each
// reads the scalars a step measured and says whether the step computes the cached blocks ("full") or reuses them.
// Unit-tested on hand-computed numbers (tests/test_sd3_cache.cpp).
//
//   FirstBlockRule  fbcache    full when the first block's residual moved by >= thr (relative L1) since the last
//                              computed step (ParaAttention / cache-dit's First-Block Cache)
//   TeaCacheRule    teacache   full when the accumulated rescaled change of the first block's modulated input
//                              reaches thr (TeaCache, Liu et al. 2024)
//   TaylorSeerRule  taylorseer full every `interval` steps after `warmup`; the forecast weights of a Taylor series
//                              along the step index (TaylorSeer, Liu et al. 2025)
//   dit_skip_steps  freq       how many steps after a probed one run no block (skip=N)
#pragma once

#include "cache/anchor_policy.h"

#include <vector>

namespace anchor::cache {

// fbcache: step 0 and the first `warmup` steps are full ("first", "warmup"); then a step with relative change
// `change` = mean|r_k - r_full| / mean|r_full| (r the first block's residual, r_full that of the last full step) is a
// reuse when change < thr and fewer than max_reuse (-1: no bound) reuses precede it in a row, else full ("change",
// "count"). thr 0: every step full. A full step becomes the reference (the caller keeps its residual).
class FirstBlockRule {
public:
    FirstBlockRule(double thr, int max_reuse, int warmup);
    Decision decide(int step, double change);
    void reset() { reuses_ = 0; }

private:
    double thr_;
    int max_reuse_, warmup_;
    int reuses_ = 0;
};

// teacache: the rescaled change p(x) = max(0, sum_i c_i x^(n-i)) of the relative L1 change x of the modulated input
// between consecutive steps (coefficients highest degree first, numpy.poly1d's order; the clamp keeps the sum from
// falling where the fitted polynomial dips below 0, which TeaCache's does not guard) is accumulated; the step is a
// reuse while the sum stays below thr, else full and the sum restarts at 0 ("change"). The first and the last step
// are full ("first", "last"), as TeaCache computes them. thr 0: every step full.
class TeaCacheRule {
public:
    TeaCacheRule(double thr, std::vector<double> coefficients);
    Decision decide(int step, int num_steps, double change);
    double rescaled(double x) const;
    double accumulated() const { return acc_; }
    void reset() { acc_ = 0; }

private:
    double thr_;
    std::vector<double> coef_;
    double acc_ = 0;
};

// taylorseer: step k is full when k < warmup or (k - warmup) % interval == 0 ("warmup", "interval"), and the last step
// never forecasts past what the rule says. interval 1: every step full.
class TaylorSeerRule {
public:
    TaylorSeerRule(int interval, int warmup);
    Decision decide(int step) const;
    // The weights w_i = h^i / i! (i = 0..terms-1) of the Taylor series f(s + h) = sum_i f^(i)(s) h^i / i! at the last
    // full step s; the derivatives f^(i) are TaylorSeer's finite differences (taylor_update).
    static std::vector<double> weights(double h, int terms);

private:
    int interval_, warmup_;
};

// freq's skip steps on the transformer (skip=N, skipdrift=D; unet/cache/dit_cache.h). After step k ran the probe (a
// full or a reuse step), the steps k+1 ... k+j run no block at all, their output forecast linearly along the timestep
// from the last two outputs the transformer computed, for the largest j <= N such that
//   accumulated + j * rate < thr   the probe's change, carried on at its last rate (the change step k measured over
//                                  the steps since the probe before it, per step), keeps the accumulated change of the
//                                  full-step rule below thr: each skipped step is one the probe would have reused;
//   drift < D                      the probe's drift at step k (its energies against their forecast from the last two
//                                  full steps) is below D (D 0: no bound; a drift not measured, NaN, allows none);
//   reuse_run + j <= max_reuse     the reuses since the last full step, the skipped ones among them (-1: none);
//   step + j < num_steps - 1       the last step is always decided by its probe.
// The next probe measures its change against step k's energies, so the accumulated change stays the sum of the
// measured changes. Returns j (0: the next step runs the probe).
struct DitSkipSignals {
    int step = 0;
    int num_steps = 0;
    double accumulated = 0; // the full-step rule's accumulated change after step k (0 after a full step)
    double rate = 0;        // step k's measured change per step since the previous probe
    double drift = 0;
    int reuse_run = 0;
};
int dit_skip_steps(int max_skips, double thr, double skip_drift, int max_reuse, const DitSkipSignals& s);

// TeaCache's calibration: the least-squares polynomial of degree `degree` through the points (x_i, y_i) (x the
// relative L1 change of the modulated input between consecutive steps, y that of the model output), coefficients
// highest degree first as numpy.polyfit returns them; solved in float64 through the normal equations with partial
// pivoting. UsageError for fewer points than coefficients or a singular system.
std::vector<double> fit_polynomial(const std::vector<double>& x, const std::vector<double>& y, int degree);

} // namespace anchor::cache
