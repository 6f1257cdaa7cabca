// DPM-Solver-2 ancestral (k-diffusion's sample_dpm_2_ancestral): one sampler behind unet/samplers/scheduler.h (common
// part: unet/samplers/sampler_base.h), as diffusers' KDPM2AncestralDiscreteScheduler. Each step from sigma_k to
// sigma_{k+1} splits like Euler ancestral into a deterministic part down to sigma_down and fresh noise of sigma_up
// (sigma_up = sqrt(s_{k+1}^2 (s_k^2 - s_{k+1}^2) / s_k^2), sigma_down = sqrt(s_{k+1}^2 - sigma_up^2)), and takes the
// deterministic part as DPM-Solver-2 does: an Euler half-step to sigma_mid = exp((log s_k + log sigma_down) / 2)
// (even loop steps, a model call each), then the step to sigma_down with the slope at the midpoint plus the noise (odd
// loop steps). The last step goes to 0 with the Euler part alone. diffusers draws one noise tensor per loop step,
// using it only in the second half: drawing it in both keeps the generator streams equal.
#include "unet/samplers/sampler_base.h"

namespace anchor::unet::samplers {

namespace {

class Kdpm2AncestralScheduler final : public TwoCallScheduler {
public:
    explicit Kdpm2AncestralScheduler(const SchedulerConfig& cfg) : TwoCallScheduler(cfg, "KDPM2Ancestral") {}
    void set_timesteps(int n) override {
        set_sigma_timesteps(n);
        if (custom_schedule()) // diffusers rounds the Karras timesteps of its use_karras_sigmas
            for (double& t : ts_) t = np_round(t);
        const std::vector<float> base = sig_; // s_0 .. s_{n-1}, 0
        // LibTorch's own float32 kernels, in diffusers' expression order.
        const auto s = torch::tensor(base, torch::kFloat32);
        auto next = s.roll(-1);
        next.select(0, -1).fill_(0.0);
        const auto up = (next.pow(2) * (s.pow(2) - next.pow(2)) / s.pow(2)).pow(0.5);
        auto down = (next.pow(2) - up.pow(2)).pow(0.5);
        down.select(0, -1).fill_(0.0);
        auto mid = s.log().lerp(down.log(), 0.5).exp();
        mid.narrow(0, mid.size(0) - 2, 2).zero_();
        const auto upv = to_floats(up), downv = to_floats(down), midv = to_floats(mid);
        const auto log_sigmas = log_train_sigmas();
        // Loop: [t_0, t(mid_0), t_1, t(mid_1), t_2, ..., t(mid_{n-2}), t_{n-1}].
        std::vector<double> ts{ts_[0]};
        in_ = {base[0]};
        for (int k = 1; k < n; ++k) {
            ts.push_back(double(static_cast<float>(sigma_to_t_f32(midv[size_t(k - 1)], log_sigmas))));
            ts.push_back(ts_[size_t(k)]);
            in_.push_back(midv[size_t(k - 1)]);
            in_.push_back(base[size_t(k)]);
        }
        ts_ = ts;
        auto lay_out = [](const std::vector<float>& v) { // diffusers' [v_0, v_1, v_1, ..., v_n, v_n, v_n]
            auto r = repeat_after_first(v);
            r.push_back(v.back());
            return r;
        };
        sig_ = lay_out(base);
        mid_ = lay_out(midv);
        up_ = lay_out(upv);
        down_ = lay_out(downv);
        restart();
        reset_injected_noise();
    }
    torch::Tensor step(const torch::Tensor& out, int i, const torch::Tensor& x, torch::Generator* gen) override {
        const auto call = next_call(i);
        const bool first_order = call.first;
        const size_t j = call.k;
        const float sigma = call.sigma, sigma_mid = mid_[j], sigma_up = up_[j];
        const float sigma_in = first_order ? sigma : sigma_mid;
        const auto noise = draw_noise(out, gen);
        auto x0 = ve_x0(cfg_.prediction_type, out, x, sigma_in, sigma_in);
        auto derivative = (x - x0) / double(sigma_in);
        if (first_order) {
            start_ = x;
            // The injected noise carried to the midpoint with x0 held fixed: x_mid - x0 = (x - x0) sigma_mid / sigma.
            if (injected_.defined()) carry_injected_noise(double(sigma_mid) / double(sigma), torch::zeros_like(x));
            return x + derivative * double(sigma_mid - sigma);
        }
        const float sigma_down = down_[j];
        auto prev = start_ + derivative * double(sigma_down - sigma);
        const auto fresh = noise * double(sigma_up);
        prev = prev + fresh;
        start_ = torch::Tensor();
        // ... and from the midpoint to sigma_down: (x - x0) sigma_down / sigma overall.
        if (sigma_up > 0) carry_injected_noise(double(sigma_down) / double(sigma_mid), fresh);
        return prev;
    }

private:
    std::vector<float> mid_, up_, down_; // diffusers' sigmas_interpol / sigmas_up / sigmas_down, laid out as sig_
};

} // namespace

std::unique_ptr<Scheduler> make_kdpm2_ancestral(const SchedulerConfig& cfg, std::optional<double>) {
    return std::make_unique<Kdpm2AncestralScheduler>(cfg);
}

} // namespace anchor::unet::samplers
