#include "cache/anchor_policy.h"

#include "cache/io/error.h"

#include <algorithm>
#include <cmath>
#include <sstream>

namespace anchor::cache {

const char* action_name(Action a) {
    return a == Action::Full ? "full" : "reuse";
}

namespace {

bool is_last(const StepSignals& s) {
    return s.num_steps > 0 && s.step == s.num_steps - 1;
}

std::string fmt(double v) {
    std::ostringstream os;
    os << v;
    return os.str();
}

} // namespace

// ---- quality target ---------------------------------------------------------------------------------------------

double target_threshold_scale(double target_db, const QualityTargetCalibration& cal) {
    if (!(target_db > 0) || !std::isfinite(target_db))
        throw UsageError("quality target must be a positive number of dB, got " + fmt(target_db));
    if (!(cal.db_per_halving > 0) || !std::isfinite(cal.ref_db) || !(cal.min_scale > 0) ||
        !(cal.max_scale >= cal.min_scale))
        throw UsageError("quality target calibration: ref " + fmt(cal.ref_db) + " dB, " + fmt(cal.db_per_halving) +
                         " dB per halving, scale range [" + fmt(cal.min_scale) + ", " + fmt(cal.max_scale) + "]");
    const double s = std::exp2((cal.ref_db - target_db) / cal.db_per_halving);
    return std::clamp(s, cal.min_scale, cal.max_scale);
}

// ---- fixed interval -------------------------------------------------------------------------------------------

FixedIntervalPolicy::FixedIntervalPolicy(int interval) : interval_(interval) {
    if (interval < 1) throw UsageError("anchor policy interval must be >= 1, got " + std::to_string(interval));
}

Decision FixedIntervalPolicy::decide(const StepSignals& s) {
    const bool full = s.step % interval_ == 0;
    return {full ? Action::Full : Action::Reuse, {}, full ? "interval" : ""};
}

std::string FixedIntervalPolicy::describe() const {
    return "interval:" + std::to_string(interval_);
}

// ---- time gate --------------------------------------------------------------------------------------------------

TimeGatePolicy::TimeGatePolicy(double tau, GateDirection direction) : tau_(tau), direction_(direction) {
    if (!std::isfinite(tau)) throw Error("tau must be a finite number, got " + fmt(tau));
    if (direction == GateDirection::HighRecomputes && !(tau >= 0.0 && tau <= 1.0))
        throw Error("tau must be in [0, 1], got " + fmt(tau));
}

Decision TimeGatePolicy::decide(const StepSignals& s) {
    if (s.layer_gates.empty()) throw Error("TimeGatePolicy: step " + std::to_string(s.step) + " has no layer gates");
    Decision d;
    d.action = Action::Reuse;
    d.layers.reserve(s.layer_gates.size());
    const bool high_reuses = direction_ == GateDirection::HighReuses;
    for (double g : s.layer_gates) {
        const bool high = g > tau_;
        const Action a = high_reuses ? (high ? Action::Reuse : Action::Full)
                                     : ((s.step == 0 || high) ? Action::Full : Action::Reuse);
        if (a == Action::Full) d.action = Action::Full;
        d.layers.push_back(a);
    }
    return d;
}

std::string TimeGatePolicy::describe() const {
    return "gate:" + fmt(tau_) + (direction_ == GateDirection::HighReuses ? ":high-reuses" : "");
}

std::vector<double> TimeGatePolicy::gate_means(const torch::Tensor& W, const torch::Tensor& b,
                                               const torch::Tensor& emb) {
    if (emb.dim() != 1) throw Error("gate_means: time embedding must be 1-D, got " + shape_str(emb.sizes().vec()));
    const int64_t D = emb.size(0);
    const bool grouped = W.dim() == 3;
    if (!(W.dim() == 2 || grouped) || W.size(-1) != D || b.dim() != W.dim() - 1 ||
        b.sizes() != W.sizes().slice(0, W.dim() - 1))
        throw Error("gate_means: expected W [L, D] + b [L] or W [L, G, D] + b [L, G] with D = " + std::to_string(D) +
                    ", got W " + shape_str(W.sizes().vec()) + ", b " + shape_str(b.sizes().vec()));
    auto e = emb.to(torch::kFloat64);
    auto logits = torch::matmul(W.to(torch::kFloat64), e) + b.to(torch::kFloat64); // [L] or [L, G]
    auto g = torch::sigmoid(logits);
    if (grouped) g = g.mean(1);
    g = g.contiguous();
    return std::vector<double>(g.data_ptr<double>(), g.data_ptr<double>() + g.numel());
}

// ---- DCT-energy change ------------------------------------------------------------------------------------------

DctChangePolicy::DctChangePolicy(double threshold, int max_reuse) : threshold_(threshold), max_reuse_(max_reuse) {
    if (!(threshold > 0.0)) throw UsageError("dct policy threshold must be > 0, got " + fmt(threshold));
    if (max_reuse < 0) throw UsageError("dct policy max reuse must be >= 0, got " + std::to_string(max_reuse));
}

void DctChangePolicy::reset() {
    acc_ = 0.0;
    reuses_ = 0;
}

Decision DctChangePolicy::decide(const StepSignals& s) {
    if (!std::isfinite(s.energy_change) || s.energy_change < 0)
        throw Error("DctChangePolicy: step " + std::to_string(s.step) + " has an invalid energy change " +
                    fmt(s.energy_change));
    auto full = [&](const char* why) {
        mark_full(s.step);
        return Decision{Action::Full, {}, why};
    };
    if (s.step == 0) return full("first");
    if (last_ == LastStep::Full && is_last(s)) return full("last");
    acc_ += s.energy_change;
    if (last_ == LastStep::Reuse && is_last(s)) {
        ++reuses_;
        return {Action::Reuse, {}, ""};
    }
    const double thr =
        step_thresholds_.empty() ? threshold_ : step_thresholds_[std::min(size_t(s.step), step_thresholds_.size() - 1)];
    if (acc_ >= thr) return full("change");
    if (reuses_ >= max_reuse_) return full("count");
    if (max_span_ > 0 && size_t(s.step) < log_sigma_.size()) {
        const double range = log_sigma_.front() - log_sigma_.back();
        if (full_log_sigma_ - log_sigma_[size_t(s.step)] > max_span_ * range) return full("span");
    }
    ++reuses_;
    return {Action::Reuse, {}, ""};
}

void DctChangePolicy::mark_full(int step) {
    reset();
    if (step >= 0 && size_t(step) < log_sigma_.size()) full_log_sigma_ = log_sigma_[size_t(step)];
}

void DctChangePolicy::set_span_bound(double max_span, std::vector<double> noise_levels) {
    if (!std::isfinite(max_span) || max_span < 0)
        throw UsageError("dct policy span must be a finite number >= 0, got " + fmt(max_span));
    max_span_ = max_span;
    log_sigma_.clear();
    for (double sigma : noise_levels) {
        if (!std::isfinite(sigma) || !(sigma > 0))
            throw UsageError("dct policy noise levels must be positive and finite, got " + fmt(sigma));
        log_sigma_.push_back(std::log(sigma));
    }
    full_log_sigma_ = log_sigma_.empty() ? 0.0 : log_sigma_.front();
}

std::string DctChangePolicy::describe() const {
    return "dct:" + fmt(threshold_) + ":" + std::to_string(max_reuse_);
}

// ---- spec strings -----------------------------------------------------------------------------------------------

std::unique_ptr<AnchorPolicy> make_policy(const std::string& spec) {
    std::vector<std::string> parts;
    std::stringstream ss(spec);
    for (std::string p; std::getline(ss, p, ':');) parts.push_back(p);
    auto bad = [&](const std::string& why) {
        return UsageError("invalid anchor policy '" + spec + "': " + why +
                          " (expected interval:N, gate:TAU or dct:THRESHOLD[:MAX_REUSE])");
    };
    auto num = [&](const std::string& s) {
        size_t pos = 0;
        double v = 0;
        try {
            v = std::stod(s, &pos);
        } catch (const std::exception&) {
            throw bad("'" + s + "' is not a number");
        }
        if (pos != s.size()) throw bad("'" + s + "' is not a number");
        return v;
    };
    auto integer = [&](const std::string& s) {
        const double v = num(s);
        if (v != std::floor(v)) throw bad("'" + s + "' is not an integer");
        return static_cast<int>(v);
    };
    if (parts.empty()) throw bad("empty");
    if (parts[0] == "interval" && parts.size() == 2) return std::make_unique<FixedIntervalPolicy>(integer(parts[1]));
    if (parts[0] == "gate" && parts.size() == 2) {
        const double tau = num(parts[1]);
        if (!(tau >= 0.0 && tau <= 1.0)) throw bad("the gate threshold must be in [0, 1]");
        return std::make_unique<TimeGatePolicy>(tau);
    }
    if (parts[0] == "dct" && (parts.size() == 2 || parts.size() == 3))
        return std::make_unique<DctChangePolicy>(num(parts[1]), parts.size() == 3 ? integer(parts[2]) : 4);
    throw bad("unknown kind or wrong number of fields");
}

} // namespace anchor::cache
