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

} // namespace anchor::cache
