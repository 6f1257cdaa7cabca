// DDPM ancestral sampling (Ho et al. 2020, eq. 6-7, algorithm 2 with the posterior variance beta~_t): one sampler
// behind unet/samplers/scheduler.h (common part: unet/samplers/sampler_base.h), as diffusers' DDPMScheduler with
// variance_type "fixed_small".
#include "unet/samplers/sampler_base.h"

namespace anchor::unet::samplers {

namespace {

class DdpmScheduler final : public DiscreteAlphaBarScheduler {
public:
    explicit DdpmScheduler(const SchedulerConfig& cfg) : DiscreteAlphaBarScheduler(cfg, "DDPM") {}
    torch::Tensor step(const torch::Tensor& out, int i, const torch::Tensor& x, torch::Generator* gen) override {
        check_index(i);
        const auto t = static_cast<int64_t>(ts_[i]);
        // Past the end the chain reaches the data: alpha_bar_prev = 1 (DDPM has no set_alpha_to_one).
        const int64_t prev = prev_timestep(i);
        const float a_t = abar_.at(static_cast<size_t>(t)), a_prev = abar_at(prev, 1.0f);
        const float b_t = 1.0f - a_t, b_prev = 1.0f - a_prev;
        const float cur_alpha = a_t / a_prev, cur_beta = 1.0f - cur_alpha;
        auto x0 = vp_predict(cfg_.prediction_type, out, x, a_t).x0;
        if (cfg_.clip_sample) x0 = x0.clamp(-1.0, 1.0);
        // Posterior mean mu~_t(x_t, x0) (eq. 7): sqrt(abar_prev) beta_t / (1 - abar_t) x0 + sqrt(alpha_t)
        // (1 - abar_prev) / (1 - abar_t) x_t, with beta_t = 1 - abar_t / abar_prev over the skipped steps.
        const float c_x0 = (std::sqrt(a_prev) * cur_beta) / b_t;
        const float c_x = std::sqrt(cur_alpha) * b_prev / b_t;
        auto prev_sample = double(c_x0) * x0 + double(c_x) * x;
        if (t > 0) {
            // beta~_t = (1 - abar_prev) / (1 - abar_t) beta_t, floored at 1e-20 as diffusers does.
            const float variance = std::max((b_prev / b_t) * cur_beta, 1e-20f);
            const auto fresh = draw_noise(out, gen) * double(std::sqrt(variance));
            prev_sample = prev_sample + fresh;
            carry_injected_noise(c_x, fresh);
        }
        return prev_sample;
    }
};

} // namespace

std::unique_ptr<Scheduler> make_ddpm(const SchedulerConfig& cfg, std::optional<double>) {
    return std::make_unique<DdpmScheduler>(cfg);
}

} // namespace anchor::unet::samplers
