// The off and deepcache modes (see deepcache.h).
#include "unet/cache/deepcache.h"

#include "cache/io/error.h"
#include "unet/model/unet_model.h"

#include <nlohmann/json.hpp>

#include <optional>

namespace anchor::unet {

using torch::Tensor;

DeepCacheDenoiser::DeepCacheDenoiser(int interval, int branch, int band)
    : interval_(interval), branch_(branch), probe_(band) {
    if (interval < 0) throw Error("deepcache: interval must be >= 1 (0 = off), got " + std::to_string(interval));
    if (branch < 0) throw Error("deepcache: branch must be >= 0, got " + std::to_string(branch));
    if (interval > 0) policy_ = std::make_unique<cache::FixedIntervalPolicy>(interval);
}

std::string DeepCacheDenoiser::spec() const {
    if (interval_ == 0) return "off";
    return "deepcache:" + std::to_string(interval_) + (branch_ ? ",branch=" + std::to_string(branch_) : "");
}

nlohmann::json DeepCacheDenoiser::params_json() const {
    if (interval_ == 0) return nlohmann::json::object();
    return {{"interval", interval_}, {"branch", branch_}};
}

void DeepCacheDenoiser::begin(int num_steps, int images) {
    num_steps_ = num_steps;
    probe_.reset(images);
    features_.begin(images);
    log_.clear();
    pending_.clear();
    last_full_ = true;
}

Tensor DeepCacheDenoiser::predict(UNet2DConditionModelImpl& unet, const Tensor& x, const Tensor& t, const UNetCond& ctx,
                                  int step, const Tensor&) {
    torch::NoGradGuard ng;
    const auto t0 = std::chrono::steady_clock::now();
    begin_step();
    CacheStepLog rec = probed_step(probe_, unet, x, step);
    rec.noise_level = noise_level(step);
    cache::Decision d;
    d.why = "off";
    if (policy_) d = policy_->decide({step, num_steps_, {}, rec.energy_change});
    bool full = d.action == cache::Action::Full;
    // The feature of the last full step serves the interval - 1 steps after it.
    std::optional<Tensor> cached;
    if (!full) cached = features_.get(branch_, kFeature, 0, step, interval_ - 1);
    if (!full && (!cached || cached->size(0) != x.size(0))) full = true, d.why = "store";
    Tensor out;
    if (full) {
        SkipFeatureCapture f(branch_);
        out = unet.forward(x, t, ctx, policy_ ? &f : nullptr, probe_.stem());
        if (policy_) features_.put(branch_, kFeature, 0, f.feature, step);
    } else {
        out = unet.forward_shallow(x, t, ctx, branch_, *cached, probe_.stem());
    }
    last_full_ = rec.full = full;
    rec.full_share = full ? 1.0 : 0.0;
    rec.why = full ? d.why : "";
    rec.anchored_fraction = full ? 0.0 : 1.0;
    rec.macs = step_macs(unet, x, ctx, full ? StepCompute::Full : StepCompute::Shallow, branch_);
    rec.ms = ms_since(t0);
    log_step(std::move(rec));
    return out;
}

} // namespace anchor::unet
