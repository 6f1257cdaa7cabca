// DDIM (Song et al. 2021, eq. 12): one sampler behind unet/samplers/scheduler.h (common part:
// unet/samplers/sampler_base.h).
#include "unet/samplers/sampler_base.h"

namespace anchor::unet::samplers {

namespace {

class DdimScheduler final : public DiscreteAlphaBarScheduler {
public:
    DdimScheduler(const SchedulerConfig& cfg, double eta) : DiscreteAlphaBarScheduler(cfg, "DDIM"), eta_(eta) {
        final_alpha_ = cfg_.set_alpha_to_one ? 1.0f : abar_[0];
    }
    torch::Tensor step(const torch::Tensor& out, int i, const torch::Tensor& x, torch::Generator* gen) override {
        check_index(i);
        const auto t = static_cast<int64_t>(ts_[i]);
        const int64_t prev = prev_timestep(i);
        const float a_t = abar_at(t, final_alpha_), a_prev = abar_at(prev, final_alpha_);
        const float b_t = 1.0f - a_t, b_prev = 1.0f - a_prev;
        auto [x0, eps] = vp_predict(cfg_.prediction_type, out, x, a_t);
        if (cfg_.clip_sample) {
            x0 = x0.clamp(-1.0, 1.0);
            eps = (x - double(std::sqrt(a_t)) * x0) / double(std::sqrt(b_t));
        }
        // sigma_t(eta) = eta * sqrt((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev))   (eq. 16)
        const float variance = (b_prev / b_t) * (1.0f - a_t / a_prev);
        const float std_dev = static_cast<float>(eta_) * std::sqrt(variance);
        auto direction = double(std::sqrt(1.0f - a_prev - std_dev * std_dev)) * eps;
        auto prev_sample = double(std::sqrt(a_prev)) * x0 + direction;
        if (eta_ > 0) {
            const auto fresh = double(std_dev) * draw_noise(out, gen);
            prev_sample = prev_sample + fresh;
            carry_injected_noise(std::sqrt(1.0f - a_prev - std_dev * std_dev) / std::sqrt(b_t), fresh);
        }
        return prev_sample;
    }

private:
    double eta_;
    float final_alpha_;
};

} // namespace

std::unique_ptr<Scheduler> make_ddim(const SchedulerConfig& cfg, std::optional<double> eta) {
    return std::make_unique<DdimScheduler>(cfg, *eta);
}

} // namespace anchor::unet::samplers
