// The state of the off and deepcache modes (their configuration: unet/cache/cache_config.h).
#pragma once

#include "cache/anchor_policy.h"
#include "unet/cache/cache_controller.h"
#include "unet/cache/shallow_probe.h"

#include <memory>

namespace anchor::unet {

// DeepCache (Ma et al. 2023, uniform skip mode; "deepcache:N[,branch=B]"): FixedIntervalPolicy makes step i full
// when i % N == 0; a full step stores the feature entering the up layer of skip `branch`, the other steps run
// UNet2DConditionModelImpl::forward_shallow with it. interval 0 is "off": every step full. Both log the probe's
// energy change too, so the compare timeline shows the energy curve for every mode.
class DeepCacheDenoiser : public CacheController {
public:
    DeepCacheDenoiser(int interval, int branch, int band = 4);
    std::string name() const override { return interval_ == 0 ? "off" : "deepcache"; }
    std::string spec() const override;
    nlohmann::json params_json() const override;
    void begin(int num_steps, int images) override;
    torch::Tensor predict(UNet2DConditionModelImpl& unet, const torch::Tensor& x, const torch::Tensor& t,
                          const UNetCond& ctx, int step, const torch::Tensor& stem = {}) override;
    bool last_step_was_full() const override { return last_full_; }

private:
    int interval_, branch_;
    std::unique_ptr<cache::FixedIntervalPolicy> policy_; // null for "off"
    ShallowProbe probe_;
    int num_steps_ = 0;
    bool last_full_ = true;
};

} // namespace anchor::unet
