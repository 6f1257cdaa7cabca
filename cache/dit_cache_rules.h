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

// TeaCache's calibration: the least-squares polynomial of degree `degree` through the points (x_i, y_i) (x the
// relative L1 change of the modulated input between consecutive steps, y that of the model output), coefficients
// highest degree first as numpy.polyfit returns them; solved in float64 through the normal equations with partial
// pivoting. UsageError for fewer points than coefficients or a singular system.
std::vector<double> fit_polynomial(const std::vector<double>& x, const std::vector<double>& y, int degree);

} // namespace anchor::cache
