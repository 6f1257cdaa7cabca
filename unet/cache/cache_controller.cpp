// What every SD cache mode's state shares (see cache_controller.h).
#include "unet/cache/cache_controller.h"

#include "unet/cache/shallow_probe.h"
#include "unet/model/unet_macs.h"
#include "unet/model/unet_model.h"

#include <nlohmann/json.hpp>

namespace anchor::unet {

CacheStepLog probed_step(ShallowProbe& probe, UNet2DConditionModelImpl& unet, const torch::Tensor& x, int step,
                         const torch::Tensor& injected) {
    CacheStepLog rec;
    rec.step = step;
    rec.energy_change = probe.update(unet, x, injected);
    return rec;
}

const std::vector<CacheStepLog>& CacheController::log() const {
    if (!pending_.empty()) {
        std::vector<torch::Tensor> values;
        for (const auto& p : pending_) values.push_back(p.value);
        const auto host = host_read(values);
        for (size_t i = 0; i < pending_.size(); ++i) log_.at(pending_[i].index).*(pending_[i].field) = host[i];
        pending_.clear();
    }
    return log_;
}

void CacheController::begin_step() {
    reads_at_step_ = host_reads();
}

void CacheController::log_step(CacheStepLog rec) {
    rec.d2h_scalars = host_reads() - reads_at_step_;
    log_.push_back(std::move(rec));
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
    int64_t d2h_max = 0;
    double macs = 0, ms = 0;
    for (const auto& r : c.log()) {
        d2h_max = std::max(d2h_max, r.d2h_scalars);
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
                         {"d2h_scalars", r.d2h_scalars},
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
            {"d2h_scalars_per_step", d2h_max}, // the most device-to-host reads of one step's decision
            {"unet_ms", ms},
            {"store", c.features().store().stats_json()},
            {"steps", steps}};
}

} // namespace anchor::unet
