// DPM-Solver-2 (Lu et al. 2022, algorithm 1 with r = 1/2; k-diffusion's sample_dpm_2): one sampler behind
// unet/samplers/scheduler.h (common part: unet/samplers/sampler_base.h), as diffusers' KDPM2DiscreteScheduler. Each
// step from sigma_k to sigma_{k+1} is two model calls and two loop steps: an Euler half-step to the midpoint sigma_mid
// = exp((log sigma_k + log sigma_{k+1}) / 2) (even loop steps), then the full step from sigma_k with the slope at the
// midpoint (odd loop steps). The last step goes to sigma = 0 with the Euler part alone (its midpoint is 0).
#include "unet/samplers/sampler_base.h"

namespace anchor::unet::samplers {

namespace {

class Kdpm2Scheduler final : public TwoCallScheduler {
public:
    explicit Kdpm2Scheduler(const SchedulerConfig& cfg) : TwoCallScheduler(cfg, "KDPM2") {}
    void set_timesteps(int n) override {
        set_sigma_timesteps(n);
        if (custom_schedule()) // diffusers' KDPM2 with use_karras_sigmas rounds the Karras timesteps
            for (double& t : ts_) t = np_round(t);
        const std::vector<float> base = sig_; // s_0 .. s_{n-1}, 0
        // sigma_mid_k = exp(lerp(log s_k, log s_{k-1}, 1/2)) through LibTorch's own log / lerp / exp on float32, as
        // diffusers computes it (k = 0 wraps to the final 0 and is never used).
        const auto s = torch::tensor(base, torch::kFloat32);
        const auto mid = to_floats(s.log().lerp(s.roll(1).log(), 0.5).exp());
        const auto log_sigmas = log_train_sigmas();
        // Loop: [t_0, t(mid_1), t_1, t(mid_2), t_2, ..., t(mid_{n-1}), t_{n-1}]; the midpoint's timestep is
        // _sigma_to_t of its sigma, float32.
        std::vector<double> ts{ts_[0]};
        in_ = {base[0]};
        for (int k = 1; k < n; ++k) {
            ts.push_back(double(static_cast<float>(sigma_to_t_f32(mid[size_t(k)], log_sigmas))));
            ts.push_back(ts_[size_t(k)]);
            in_.push_back(mid[size_t(k)]);
            in_.push_back(base[size_t(k)]);
        }
        ts_ = ts;
        // diffusers' sigmas / sigmas_interpol: [v_0, v_1, v_1, ..., v_n, v_n, v_n] (n + 1 values -> 2n + 2).
        sig_ = repeat_after_first(base);
        sig_.push_back(base.back());
        mid_ = repeat_after_first(mid);
        mid_.push_back(mid.back());
        restart();
    }
    torch::Tensor step(const torch::Tensor& out, int i, const torch::Tensor& x, torch::Generator*) override {
        const auto [first_order, k, sigma, sigma_next] = next_call(i);
        const float sigma_mid = mid_[k + 1];
        const float sigma_in = first_order ? sigma : sigma_mid;
        auto x0 = ve_x0(cfg_.prediction_type, out, x, sigma_in, sigma_in);
        auto derivative = (x - x0) / double(sigma_in);
        if (first_order) {
            start_ = x;
            return x + derivative * double(sigma_mid - sigma);
        }
        auto prev = start_ + derivative * double(sigma_next - sigma);
        start_ = torch::Tensor();
        return prev;
    }

private:
    std::vector<float> mid_; // diffusers' sigmas_interpol, laid out as sig_
};

} // namespace

std::unique_ptr<Scheduler> make_kdpm2(const SchedulerConfig& cfg, std::optional<double>) {
    return std::make_unique<Kdpm2Scheduler>(cfg);
}

} // namespace anchor::unet::samplers
