// The decision rules of the diffusion-transformer caches (see dit_cache_rules.h).
#include "cache/dit_cache_rules.h"

#include "cache/io/error.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

namespace anchor::cache {

namespace {
std::string rules_num(double v) {
    char b[32];
    std::snprintf(b, sizeof(b), "%g", v);
    return b;
}
} // namespace

FirstBlockRule::FirstBlockRule(double thr, int max_reuse, int warmup)
    : thr_(thr), max_reuse_(max_reuse), warmup_(warmup) {
    if (!(thr >= 0) || !std::isfinite(thr)) throw UsageError("fbcache threshold must be >= 0, got " + rules_num(thr));
}

Decision FirstBlockRule::decide(int step, double change) {
    auto full = [&](const char* why) {
        reuses_ = 0;
        return Decision{Action::Full, {}, why};
    };
    if (step == 0) return full("first");
    if (step < warmup_) return full("warmup");
    if (!(change < thr_)) return full("change"); // NaN (no reference) is full too
    if (max_reuse_ >= 0 && reuses_ >= max_reuse_) return full("count");
    ++reuses_;
    return {Action::Reuse, {}, ""};
}

TeaCacheRule::TeaCacheRule(double thr, std::vector<double> coefficients) : thr_(thr), coef_(std::move(coefficients)) {
    if (!(thr >= 0) || !std::isfinite(thr)) throw UsageError("teacache threshold must be >= 0, got " + rules_num(thr));
    if (coef_.empty()) throw UsageError("teacache needs at least one rescale coefficient");
}

double TeaCacheRule::rescaled(double x) const {
    double p = 0; // Horner, highest degree first
    for (double c : coef_) p = p * x + c;
    return std::max(0.0, p);
}

Decision TeaCacheRule::decide(int step, int num_steps, double change) {
    auto full = [&](const char* why) {
        acc_ = 0;
        return Decision{Action::Full, {}, why};
    };
    if (step == 0) return full("first");
    if (num_steps > 0 && step == num_steps - 1) return full("last");
    acc_ += rescaled(change);
    if (!(acc_ < thr_)) return full("change");
    return {Action::Reuse, {}, ""};
}

TaylorSeerRule::TaylorSeerRule(int interval, int warmup) : interval_(interval), warmup_(warmup) {
    if (interval < 1) throw UsageError("taylorseer interval must be >= 1, got " + std::to_string(interval));
    if (warmup < 0) throw UsageError("taylorseer warmup must be >= 0, got " + std::to_string(warmup));
}

Decision TaylorSeerRule::decide(int step) const {
    if (step == 0) return {Action::Full, {}, "first"};
    if (step < warmup_) return {Action::Full, {}, "warmup"};
    if ((step - warmup_) % interval_ == 0) return {Action::Full, {}, "interval"};
    return {Action::Reuse, {}, ""};
}

std::vector<double> TaylorSeerRule::weights(double h, int terms) {
    std::vector<double> w;
    double v = 1;
    for (int i = 0; i < terms; ++i) {
        w.push_back(v);
        v *= h / double(i + 1);
    }
    return w;
}

int dit_skip_steps(int max_skips, double thr, double skip_drift, int max_reuse, const DitSkipSignals& s) {
    if (max_skips <= 0 || !(thr > 0)) return 0;
    if (skip_drift > 0 && !(s.drift < skip_drift)) return 0; // NaN (not measured) allows none
    if (!std::isfinite(s.rate) || s.rate < 0) return 0;
    int j = 0;
    while (j < max_skips && s.accumulated + double(j + 1) * s.rate < thr &&
           (max_reuse < 0 || s.reuse_run + j + 1 <= max_reuse) && (s.num_steps <= 0 || s.step + j + 1 < s.num_steps - 1))
        ++j;
    return j;
}

std::vector<double> fit_polynomial(const std::vector<double>& x, const std::vector<double>& y, int degree) {
    const int n = degree + 1;
    if (degree < 0 || x.size() != y.size() || int(x.size()) < n)
        throw UsageError("polynomial fit: " + std::to_string(x.size()) + " points for degree " +
                         std::to_string(degree));
    // A^T A c = A^T y with A's columns x^degree ... x^0; the augmented matrix m is n x (n + 1).
    std::vector<std::vector<double>> m(static_cast<size_t>(n), std::vector<double>(static_cast<size_t>(n + 1), 0.0));
    for (size_t k = 0; k < x.size(); ++k) {
        std::vector<double> pw(static_cast<size_t>(n));
        for (int j = n - 1, e = 0; j >= 0; --j, ++e) pw[size_t(j)] = std::pow(x[k], e);
        for (int r = 0; r < n; ++r) {
            for (int c = 0; c < n; ++c) m[size_t(r)][size_t(c)] += pw[size_t(r)] * pw[size_t(c)];
            m[size_t(r)][size_t(n)] += pw[size_t(r)] * y[k];
        }
    }
    for (int c = 0; c < n; ++c) {
        int piv = c;
        for (int r = c + 1; r < n; ++r)
            if (std::abs(m[size_t(r)][size_t(c)]) > std::abs(m[size_t(piv)][size_t(c)])) piv = r;
        if (!(std::abs(m[size_t(piv)][size_t(c)]) > 0)) throw UsageError("polynomial fit: the points fix no unique polynomial");
        std::swap(m[size_t(c)], m[size_t(piv)]);
        for (int r = 0; r < n; ++r) {
            if (r == c) continue;
            const double f = m[size_t(r)][size_t(c)] / m[size_t(c)][size_t(c)];
            for (int k = c; k <= n; ++k) m[size_t(r)][size_t(k)] -= f * m[size_t(c)][size_t(k)];
        }
    }
    std::vector<double> out(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) out[size_t(r)] = m[size_t(r)][size_t(n)] / m[size_t(r)][size_t(r)];
    return out;
}

} // namespace anchor::cache
