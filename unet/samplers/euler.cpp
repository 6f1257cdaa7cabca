// Euler (Karras et al. 2022, algorithm 2 with s_churn = 0): one sampler behind unet/samplers/scheduler.h (common part: unet/samplers/sampler_base.h).
#include "unet/samplers/sampler_base.h"

namespace anchor::unet::samplers {

namespace {

class EulerScheduler final : public SigmaScheduler {
public:
    explicit EulerScheduler(const SchedulerConfig& cfg) : SigmaScheduler(cfg, "Euler") {}
    void set_timesteps(int n) override { set_sigma_timesteps(n); }
    torch::Tensor step(const torch::Tensor& out, int i, const torch::Tensor& x, torch::Generator* gen) override {
        check_index(i);
        const float sigma = sig_[i];
        // diffusers draws the churn noise even when gamma = 0 and discards it; drawing keeps generator streams equal.
        (void)draw_noise(out, gen);
        const float sigma_hat = sigma; // gamma = 0
        auto sample = x.to(torch::kFloat32);
        auto x0 = ve_x0(cfg_.prediction_type, out, sample, sigma_hat, sigma);
        auto derivative = (sample - x0) / double(sigma_hat); // d = (x - D(x)) / sigma
        const float dt = sig_[i + 1] - sigma_hat;
        return (sample + derivative * double(dt)).to(out.scalar_type());
    }
};

} // namespace

std::unique_ptr<Scheduler> make_euler(const SchedulerConfig& cfg, std::optional<double> ) {
    return std::make_unique<EulerScheduler>(cfg);
}

} // namespace anchor::unet::samplers
