// Trajectory consistency distillation's strategic stochastic sampling (Zheng et al. 2024, algorithm 4): one sampler
// behind unet/samplers/scheduler.h (common part: unet/samplers/sampler_base.h), as diffusers' TCDScheduler. Each step goes
// from t to the intermediate s = floor((1 - gamma) t_prev) along the model's ODE (x0 and eps re-noised to s), then
// forward-diffuses from s to t_prev with fresh noise; gamma (diffusers' `eta`, default 0.3) = 0 is deterministic,
// 1 is LCM-like.
#include "unet/samplers/sampler_base.h"

namespace anchor::unet::samplers {

namespace {

class TcdScheduler final : public ConsistencyScheduler {
public:
    TcdScheduler(const SchedulerConfig& cfg, double gamma) : ConsistencyScheduler(cfg, "TCD"), gamma_(gamma) {}
    torch::Tensor step(const torch::Tensor& out, int i, const torch::Tensor& x, torch::Generator* gen) override {
        check_index(i);
        const auto t = static_cast<int64_t>(ts_[size_t(i)]);
        const int64_t prev = i + 1 < n_ ? static_cast<int64_t>(ts_[size_t(i + 1)]) : 0;
        // s = floor((1 - gamma) * t_prev), the product in float32 as diffusers' tensor arithmetic.
        const auto s = static_cast<int64_t>(std::floor(static_cast<float>(1.0 - gamma_) * static_cast<float>(prev)));
        const float a_t = abar_.at(size_t(t)), a_prev = abar_.at(size_t(prev)), a_s = abar_.at(size_t(s));
        const float b_t = 1.0f - a_t, b_s = 1.0f - a_s;
        const auto [x0, eps] = vp_predict(cfg_.prediction_type, out, x, a_t);
        denoised_ = double(std::sqrt(a_s)) * x0 + double(std::sqrt(b_s)) * eps;
        if (!(gamma_ > 0) || i == n_ - 1) return denoised_;
        const float ratio = a_prev / a_s;
        const auto fresh = double(std::sqrt(1.0f - ratio)) * draw_noise(out, gen);
        // With x0 held fixed, eps = (x - sqrt(abar_t) x0) / sqrt(1 - abar_t) carries the sample into the re-noised one.
        carry_injected_noise(double(std::sqrt(ratio)) * double(std::sqrt(b_s)) / double(std::sqrt(b_t)), fresh);
        return double(std::sqrt(ratio)) * denoised_ + fresh;
    }

private:
    double gamma_;
};

} // namespace

std::unique_ptr<Scheduler> make_tcd(const SchedulerConfig& cfg, std::optional<double> eta) {
    if (*eta > 1.0) throw ParamError("eta", "TCD's gamma (eta) must be in [0, 1], got " + std::to_string(*eta));
    return std::make_unique<TcdScheduler>(cfg, *eta);
}

} // namespace anchor::unet::samplers
