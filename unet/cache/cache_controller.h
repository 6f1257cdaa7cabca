// What every SD cache mode's state shares: the DenoiseController with a per-step log, its feature store and its
// label, and the log's JSON record.
#pragma once

#include "unet/cache/feature_store.h"
#include "unet/pipeline/pipeline.h"

#include <nlohmann/json_fwd.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace anchor::unet {

class ShallowProbe;

// One loop step of a cache controller (the JSON sidecar / compare report).
struct CacheStepLog {
    int step = 0;
    bool full = true;
    double energy_change = 0;      // r_k of the shallow probe (0 at step 0)
    double accumulated = 0;        // A_k since the last full step (freq only; 0 otherwise)
    double anchored_fraction = 0;  // freq reuse steps: fraction of anchored DCT coefficients (1 when all reused)
    double macs = 0;               // UNet MACs of the step per sample (0 when no MAC model is attached)
    double ms = 0;                 // wall time of the UNet evaluation (and the probe)
    double noise_level = 0;        // sigma of the step (0 when the loop gave none)
    double drift = 0;              // freq: the probe's forecast residual (see FreqParams::drift; 0 at full steps)
    double calibration = 1;        // freq correct=1 reuse steps: the mean forecast calibration alpha (1 otherwise)
    bool forecast = false;         // freq skip=N: the model output was forecast, no UNet layer ran (only the probe)
    double injected = 0;           // freq noise=V: the noise injected since the last full step, against its noise level
    bool attention_reused = false; // freq attn=reuse: the shallow path added its attention layers' cached residuals
    // Device-to-host reads the step's decision made (host_read, unet/cache/shallow_probe.h); the same count on the CPU.
    int64_t d2h_scalars = 0;
    // The share of the batch's images that ran the full UNet at this step: freq decides per image (1 for one image;
    // DeepCache and off decide for the batch, 1 or 0). `full` is set when any image did.
    double full_share = 1;
    // Why a full step was full: "first", "last", "change" (A_k >= thr), "count" (max reuses), "span" (the log-sigma
    // bound), "drift" (the probe left its forecast), "noise" (injected noise, freq noise=V), "store" (no usable cached
    // entry), "interval" (DeepCache), "off";
    // "" for a reuse.
    std::string why;
};

// A DenoiseController that keeps a per-step log (and the probe's energy change for the timeline).
class CacheController : public DenoiseController {
public:
    // The log; values a GPU step left on the device for the log only (not for a decision) are read here, once.
    const std::vector<CacheStepLog>& log() const;
    // The canonical mode string ("off", "deepcache:3,branch=0", "freq:tau=0.01,...").
    virtual std::string spec() const = 0;
    // The mode as the user wrote it ("freq", "freq:fast"; make_cache_controller sets it); spec() when unset.
    std::string label() const { return label_.empty() ? spec() : label_; }
    void set_label(std::string label) { label_ = std::move(label); }
    virtual nlohmann::json params_json() const;
    // What a step computed, for its MAC count.
    enum class StepCompute { Full, Shallow, ShallowNoAttention };
    // MACs of a step per sample. When unset, the analytic count of unet/model/unet_macs.h for the UNet and latent size of
    // the first call is attached on that call.
    std::function<double(StepCompute)> mac_fn;
    // The store this mode caches in (its own unless set_store is called before the run).
    void set_store(std::shared_ptr<cache::LatentCache> store, std::string ns);
    const BatchFeatureStore& features() const { return features_; }
    void set_noise_levels(std::vector<double> sigmas) override { sigmas_ = std::move(sigmas); }

protected:
    std::string label_;
    mutable std::vector<CacheStepLog> log_;
    // A log field of step `index` whose value is still on the device (0-d): read by log(), after the steps.
    struct PendingLogValue {
        size_t index;
        double CacheStepLog::*field;
        torch::Tensor value;
    };
    mutable std::vector<PendingLogValue> pending_;
    int64_t reads_at_step_ = 0;
    // begin_step() at the top of predict, log_step(rec) at its end: the step's record with its device reads.
    void begin_step();
    void log_step(CacheStepLog rec);
    BatchFeatureStore features_;
    std::vector<double> sigmas_; // noise levels of the loop's steps (empty when the loop gave none)
    double noise_level(int step) const {
        return step >= 0 && size_t(step) < sigmas_.size() ? sigmas_[size_t(step)] : 0;
    }
    double step_macs(const UNet2DConditionModelImpl& unet, const torch::Tensor& x, const UNetCond& ctx,
                     StepCompute what, int branch);
};

// A step's record, begun with the shallow probe's r_k (every mode probes every step: the log and the policies read it).
CacheStepLog probed_step(ShallowProbe& probe, UNet2DConditionModelImpl& unet, const torch::Tensor& x, int step,
                         const torch::Tensor& injected = {});
double ms_since(std::chrono::steady_clock::time_point t0);

// The controller's log, the resolved mode and the store's statistics: "mode" is the label as the user wrote it,
// "resolved" the canonical string, "params" every key's value.
nlohmann::json cache_log_json(const CacheController& c);

} // namespace anchor::unet
