// Anchor policies: at each denoising step, decide whether the cached part of the network is recomputed ("full": the
// result becomes the new anchor) or served from the anchor cache ("reuse").
//
// Interface: `Decision AnchorPolicy::decide(const StepSignals&)`, called exactly once per loop step in order
// (step 0 .. num_steps - 1); `reset()` before a new loop. A policy reads only the signals it needs:
//   * FixedIntervalPolicy - nothing (DeepCache's uniform schedule: full every `interval` steps).
//   * TimeGatePolicy      - `layer_gates`: the mean of a learned time gate g(t) = sigmoid(W E(t) + b) per layer.
//   * DctChangePolicy     - `energy_change`: relative DCT-energy change of a cheap probe (e.g. the latent or the first
//                           block's output) between this step and the previous one (see cache/dct.h).
// Decision::action says whether the step needs a network pass for the cached part; policies that decide per layer
// also fill Decision::layers (one action per layer; action == Full when any layer is Full).
//
// Spec strings for the command line (make_policy): "interval:N", "gate:TAU", "dct:THRESHOLD[:MAX_REUSE]".
#pragma once

#include <torch/torch.h>

#include <memory>
#include <ostream>
#include <string>
#include <vector>

namespace anchor::cache {

enum class Action { Full, Reuse };
const char* action_name(Action a);
inline std::ostream& operator<<(std::ostream& os, Action a) {
    return os << action_name(a);
}

struct StepSignals {
    int step = 0;                    // loop index
    int num_steps = 0;               // loop length (0: unknown, then no step counts as the last)
    std::vector<double> layer_gates; // TimeGatePolicy
    double energy_change = 0.0;      // DctChangePolicy
};

struct Decision {
    Action action = Action::Full;
    std::vector<Action> layers; // per-layer actions (empty when the policy decides for the whole step)
    // Why a step is Full, for the per-step record ("first", "last", "change", "count", "span", ...); "" for Reuse.
    const char* why = "";
};

class AnchorPolicy {
public:
    virtual ~AnchorPolicy() = default;
    virtual Decision decide(const StepSignals& s) = 0;
    virtual void reset() = 0;
    virtual std::string describe() const = 0;
};

// Full when step % interval == 0 (DeepCache, Ma et al. 2024, uniform 1:N strategy); interval 1 = never reuse.
class FixedIntervalPolicy final : public AnchorPolicy {
public:
    explicit FixedIntervalPolicy(int interval);
    Decision decide(const StepSignals& s) override;
    void reset() override {}
    std::string describe() const override;

private:
    int interval_;
};

// Which side of tau makes a layer Full.
enum class GateDirection {
    // g_l(t) > tau: the layer's features are moving at this t, recompute it (Full); every layer is Full at step 0
    // (nothing cached yet). The gate-driven DiT caches.
    HighRecomputes,
    // g_l(t) > tau: Reuse, i.e. the layer's anchored entries may serve for the long staleness; Full = the normal one.
    // The masked diffusion LM's residual gates (text/diffusion/mdlm_cache.h): a gate near 1 passes the branch through almost
    // unattenuated, so the residual stream is dominated by the stable cached branch. No step is forced Full: whether
    // anything is cached yet is the cache's own test.
    HighReuses,
};

// Time-anchor gate: per layer, compares the gate mean g_l(t) with tau, where g(t) = sigmoid(W E(t) + b) is a learned
// per-layer gate on the timestep embedding E(t) (or, for plain adaLN gates, the modulation's gate chunk); the
// direction says which side is Full.
class TimeGatePolicy final : public AnchorPolicy {
public:
    // tau must be finite; in [0, 1] for HighRecomputes (sigmoid gates). HighReuses takes any tau: plain adaLN gates
    // are not bounded, and a tau outside their range puts every layer on one side. Throws anchor::Error.
    explicit TimeGatePolicy(double tau, GateDirection direction = GateDirection::HighRecomputes);
    Decision decide(const StepSignals& s) override;
    void reset() override {}
    std::string describe() const override;

    // Gate means per layer: W [L, D] with b [L], or W [L, G, D] with b [L, G] (mean over the G gate units);
    // emb [D]. Returns mean_g sigmoid(W_l E + b_l) for each layer l.
    static std::vector<double> gate_means(const torch::Tensor& W, const torch::Tensor& b, const torch::Tensor& emb);

private:
    double tau_;
    GateDirection direction_;
};

// How a policy decides the last step of a loop. Full: always computed (it produces the output and has no later step
// to amortise a reuse); Rules: like any other step; Reuse: never computed (where the schedule ends so close to
// sigma = 0 that an output error barely reaches the image).
enum class LastStep { Full, Rules, Reuse };

// DCT-energy change rate: reuse while the change accumulated since the last full step,
//   A_k = sum_{j = last_full + 1}^{k} r_j,   r_j = sum_uv |E_j(u,v) - E_{j-1}(u,v)| / (sum_uv E_{j-1}(u,v) + eps),
// stays below `threshold`; full when A_k >= threshold or after `max_reuse` consecutive reuses. The first step is always
// full, the last one as set_last_step says (default: always full).
class DctChangePolicy final : public AnchorPolicy {
public:
    DctChangePolicy(double threshold, int max_reuse);
    Decision decide(const StepSignals& s) override;
    void reset() override;
    std::string describe() const override;
    double accumulated() const { return acc_; }
    // Per-step thresholds (a calibrated profile): step k uses thresholds[min(k, size - 1)]; empty = the fixed one.
    void set_step_thresholds(std::vector<double> thresholds) { step_thresholds_ = std::move(thresholds); }
    // A reuse run bounded in the schedule's own units, the same for any step count and sampler: given the noise
    // levels sigma_0 > ... > sigma_{n-1} of the loop's steps, step k is full ("span") when
    //   ln sigma_full - ln sigma_k > max_span * (ln sigma_0 - ln sigma_{n-1}),
    // i.e. the log-sigma (half the log-SNR) distance since the last full step passes a fraction of the whole loop's.
    // max_span 0 or no levels: no such bound. Throws UsageError for a negative or non-finite max_span, or a level
    // that is not positive and finite.
    void set_span_bound(double max_span, std::vector<double> noise_levels);
    // How the last step is decided (default Full).
    void set_last_step(LastStep l) { last_ = l; }
    LastStep last_step() const { return last_; }
    // Step `step` was made full by a rule of the caller's (a store miss, a drift bound): the run of reuses and the
    // accumulated change restart there, as after a full step of the policy's own.
    void mark_full(int step);

private:
    double threshold_;
    std::vector<double> step_thresholds_;
    int max_reuse_;
    double max_span_ = 0.0;
    std::vector<double> log_sigma_;
    double full_log_sigma_ = 0.0; // ln sigma of the last full step
    double acc_ = 0.0;
    int reuses_ = 0;
    LastStep last_ = LastStep::Full;
};

// A quality target in dB of PSNR against the uncached image, spent as one scale on a change rule's thresholds (the
// accumulated change, the drift and skip bounds of DctChangePolicy's caller). Each threshold bounds a relative
// residual the reuse steps may leave per image, so the error a run admits grows with the scale and its PSNR falls by
// about a fixed number of dB each time the scale doubles; a calibration measures, for a family of samplers, the PSNR
// the 5th-percentile image reaches at scale 1 (ref_db) and that slope (db_per_halving), and the scale for a target T is
//   s = 2^((ref_db - T) / db_per_halving),
// clamped to [min_scale, max_scale] (below the first every step is full anyway; above the last the reuse runs are
// bounded by the rules that do not scale).
struct QualityTargetCalibration {
    double ref_db = 30.0;
    double db_per_halving = 6.0;
    double min_scale = 1.0 / 64;
    double max_scale = 4.0;
};
// Throws UsageError for a target that is not positive and finite or a calibration whose slope is not positive.
double target_threshold_scale(double target_db, const QualityTargetCalibration& cal);

// "interval:3", "gate:0.5", "dct:0.15" or "dct:0.15:4" (max_reuse defaults to 4). Throws UsageError.
std::unique_ptr<AnchorPolicy> make_policy(const std::string& spec);

} // namespace anchor::cache
