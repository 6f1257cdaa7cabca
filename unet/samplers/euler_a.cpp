// Euler ancestral (k-diffusion sample_euler_ancestral): one sampler behind unet/samplers/scheduler.h (common part: unet/samplers/sampler_base.h).
#include "unet/samplers/sampler_base.h"

namespace anchor::unet::samplers {

namespace {

class EulerAncestralScheduler final : public SigmaScheduler {
public:
    EulerAncestralScheduler(const SchedulerConfig& cfg, double eta)
        : SigmaScheduler(cfg, "EulerAncestral"), eta_(static_cast<float>(eta)) {}
    void set_timesteps(int n) override {
        set_sigma_timesteps(n);
        reset_injected_noise();
    }
    torch::Tensor step(const torch::Tensor& out, int i, const torch::Tensor& x, torch::Generator* gen) override {
        check_index(i);
        const float sigma = sig_[i];
        auto sample = x.to(torch::kFloat32);
        auto x0 = ve_x0(cfg_.prediction_type, out, sample, sigma, sigma);
        // Split the step to sigma_to into a deterministic part down to sigma_down and fresh noise of sigma_up
        // (k-diffusion get_ancestral_step): sigma_up = min(s_to, eta sqrt(s_to^2 (s_from^2 - s_to^2) / s_from^2)),
        // sigma_down = sqrt(s_to^2 - sigma_up^2). eta = 1 is diffusers' EulerAncestralDiscreteScheduler; eta = 0
        // leaves the Euler step (the noise is still drawn, scaled by 0, so generator streams stay aligned).
        const float s_from = sig_[i], s_to = sig_[i + 1];
        const float sigma_up =
            std::min(s_to, eta_ * std::sqrt(s_to * s_to * (s_from * s_from - s_to * s_to) / (s_from * s_from)));
        const float sigma_down = std::sqrt(s_to * s_to - sigma_up * sigma_up);
        auto derivative = (sample - x0) / double(sigma);
        const float dt = sigma_down - sigma;
        auto prev_sample = sample + derivative * double(dt);
        const auto fresh = draw_noise(out, gen) * double(sigma_up);
        prev_sample = prev_sample + fresh;
        if (sigma_up > 0) carry_injected_noise(double(sigma_down) / double(sigma), fresh);
        return prev_sample.to(out.scalar_type());
    }

private:
    float eta_;
};

} // namespace

std::unique_ptr<Scheduler> make_euler_a(const SchedulerConfig& cfg, std::optional<double> eta) {
    return std::make_unique<EulerAncestralScheduler>(cfg, *eta);
}

} // namespace anchor::unet::samplers
