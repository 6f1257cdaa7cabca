// Heun's second-order method on the probability-flow ODE (Karras et al. 2022, algorithm 1 with the trapezoidal
// correction, s_churn = 0): one sampler behind unet/samplers/scheduler.h (common part: unet/samplers/sampler_base.h),
// as diffusers' HeunDiscreteScheduler. Each step is two model calls and two loop steps: an Euler predictor from sigma_k
// to sigma_{k+1} (even loop steps), then the corrector at sigma_{k+1} averaging the two slopes (odd loop steps); the
// last step goes to sigma = 0 with the predictor alone.
#include "unet/samplers/sampler_base.h"

namespace anchor::unet::samplers {

namespace {

class HeunScheduler final : public TwoCallScheduler {
public:
    explicit HeunScheduler(const SchedulerConfig& cfg) : TwoCallScheduler(cfg, "Heun") {}
    void set_timesteps(int n) override {
        set_sigma_timesteps(n);
        // timesteps [t0, t1, t1, ..., t_{n-1}, t_{n-1}]; sigmas [s0, s1, s1, ..., s_{n-1}, s_{n-1}, 0].
        ts_ = repeat_after_first(ts_);
        const float last = sig_.back();
        sig_.pop_back();
        sig_ = repeat_after_first(sig_);
        sig_.push_back(last);
        in_.assign(sig_.begin(), sig_.end() - 1);
        restart();
    }
    torch::Tensor step(const torch::Tensor& out, int i, const torch::Tensor& x, torch::Generator*) override {
        // The corrector's model call was at the end of its step.
        const auto [first_order, k, sigma, sigma_next] = next_call(i);
        const float sigma_in = first_order ? sigma : sigma_next;
        auto x0 = ve_x0(cfg_.prediction_type, out, x, sigma_in, sigma_in);
        if (cfg_.clip_sample) x0 = x0.clamp(-1.0, 1.0);
        auto derivative = (x - x0) / double(sigma_in);
        if (first_order) {
            dt_ = sigma_next - sigma;
            prev_derivative_ = derivative;
            start_ = x;
            return x + derivative * double(dt_);
        }
        // Trapezoidal rule: the mean of the slopes at both ends, applied from the step's start.
        derivative = (prev_derivative_ + derivative) / 2;
        auto prev = start_ + derivative * double(dt_);
        prev_derivative_ = start_ = torch::Tensor();
        return prev;
    }

private:
    void restart() override {
        TwoCallScheduler::restart();
        prev_derivative_ = torch::Tensor();
    }
    torch::Tensor prev_derivative_;
    float dt_ = 0;
};

} // namespace

std::unique_ptr<Scheduler> make_heun(const SchedulerConfig& cfg, std::optional<double>) {
    return std::make_unique<HeunScheduler>(cfg);
}

} // namespace anchor::unet::samplers
