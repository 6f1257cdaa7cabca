// What every SD cache mode's state shares (see cache_controller.h).
#include "unet/cache_controller.h"

#include "unet/shallow_probe.h"
#include "unet/unet_macs.h"
#include "unet/unet_model.h"

#include <nlohmann/json.hpp>

namespace anchor::unet {

CacheStepLog probed_step(ShallowProbe& probe, UNet2DConditionModelImpl& unet, const torch::Tensor& x, int step,
                         const torch::Tensor& injected) {
    CacheStepLog rec;
    rec.step = step;
    rec.energy_change = probe.update(unet, x, injected);
    return rec;
}

double ms_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

nlohmann::json CacheController::params_json() const {
    return nlohmann::json::object();
}

void CacheController::set_store(std::shared_ptr<cache::LatentCache> store, std::string ns) {
    features_ = BatchFeatureStore(std::move(store), std::move(ns));
}

double CacheController::step_macs(const UNet2DConditionModelImpl& unet, const torch::Tensor& x, const UNetCond& ctx,
                                  StepCompute what, int branch) {
    if (!mac_fn) {
        const auto b = unet_mac_breakdown(unet.config(), x.size(-2), x.size(-1), ctx.context.size(1));
        const double f = double(b.full().total()), sh = double(b.shallow(branch).total()),
                     lite = double(b.shallow(branch, false).total());
        mac_fn = [f, sh, lite](StepCompute w) {
            return w == StepCompute::Full ? f : w == StepCompute::Shallow ? sh : lite;
        };
    }
    return mac_fn(what);
}

nlohmann::json cache_log_json(const CacheController& c) {
    nlohmann::json steps = nlohmann::json::array();
    int full = 0;
    double macs = 0, ms = 0;
    for (const auto& r : c.log()) {
        steps.push_back({{"step", r.step},
                         {"full", r.full},
                         {"energy_change", r.energy_change},
                         {"accumulated", r.accumulated},
                         {"anchored_fraction", r.anchored_fraction},
                         {"noise_level", r.noise_level},
                         {"drift", r.drift},
                         {"calibration", r.calibration},
                         {"forecast", r.forecast},
                         {"attention_reused", r.attention_reused},
                         {"injected", r.injected},
                         {"full_share", r.full_share},
                         {"why", r.why},
                         {"macs", r.macs},
                         {"ms", r.ms}});
        full += r.full ? 1 : 0;
        macs += r.macs;
        ms += r.ms;
    }
    const size_t n = c.log().size();
    return {{"mode", c.label()},
            {"resolved", c.spec()},
            {"kind", c.name()},
            {"params", c.params_json()},
            {"full_steps", full},
            {"total_steps", n},
            {"macs_per_step", n ? macs / double(n) : 0.0},
            {"unet_ms", ms},
            {"store", c.features().store().stats_json()},
            {"steps", steps}};
}

} // namespace anchor::unet
