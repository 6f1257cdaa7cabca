// Latent consistency model multistep sampling (Luo et al. 2023, algorithm 1; Song et al. 2023, algorithm 1): one
// sampler behind unet/samplers/scheduler.h (common part: unet/samplers/sampler_base.h), as diffusers' LCMScheduler. Each step
// maps the sample to the consistency function's clean estimate f(x_t, t) = c_skip(t) x_t + c_out(t) x0(x_t) and,
// except after the last step, noises it afresh to the next timestep.
#include "unet/samplers/sampler_base.h"

namespace anchor::unet::samplers {

std::vector<double> distilled_timesteps(const SchedulerConfig& cfg, int n, const char* who) {
    check_num_steps(cfg, n, who);
    if (cfg.schedule.value_or(NoiseSchedule::Default) != NoiseSchedule::Default)
        throw ParamError("schedule", std::string(who) +
                                         " runs on the timesteps its model was distilled on; schedule '" +
                                         noise_schedule_name(*cfg.schedule) + "' does not apply (use default)");
    const int K = cfg.original_inference_steps, N = cfg.num_train_timesteps;
    if (K < 1 || K > N)
        throw ParamError("original_inference_steps", std::string(who) + ": original_inference_steps must be in [1, " +
                                                         std::to_string(N) + "], got " + std::to_string(K));
    if (n > K)
        throw ParamError("steps", std::string(who) + ": num_inference_steps must be <= original_inference_steps (" +
                                      std::to_string(K) + "), got " + std::to_string(n));
    const int k = N / K;
    std::vector<double> origin; // descending
    for (int j = K; j >= 1; --j) origin.push_back(double(j * k - 1));
    const double stride = double(K) / double(n); // numpy.linspace(0, K, n, endpoint=False)
    std::vector<double> t;
    for (int i = 0; i < n; ++i) t.push_back(origin.at(size_t(std::floor(double(i) * stride))));
    return t;
}

namespace {

class LcmScheduler final : public ConsistencyScheduler {
public:
    explicit LcmScheduler(const SchedulerConfig& cfg) : ConsistencyScheduler(cfg, "LCM") {
        final_alpha_ = cfg_.set_alpha_to_one ? 1.0f : abar_[0];
    }
    torch::Tensor step(const torch::Tensor& out, int i, const torch::Tensor& x, torch::Generator* gen) override {
        check_index(i);
        const auto t = static_cast<int64_t>(ts_[size_t(i)]);
        const int64_t prev = i + 1 < n_ ? static_cast<int64_t>(ts_[size_t(i + 1)]) : t;
        const float a_t = abar_.at(size_t(t)), a_prev = abar_at(prev, final_alpha_);
        // Boundary condition c_skip(0) = 1, c_out(0) = 0 (Song et al. 2023, appendix C) with sigma_data = 0.5 on the
        // scaled timestep, float32 as diffusers' 0-dim tensors.
        const float scaled = static_cast<float>(t) * static_cast<float>(cfg_.timestep_scaling);
        const float c_skip = 0.25f / (scaled * scaled + 0.25f);
        const float c_out = scaled / std::sqrt(scaled * scaled + 0.25f);
        auto x0 = vp_predict(cfg_.prediction_type, out, x, a_t).x0;
        if (cfg_.clip_sample) x0 = x0.clamp(-1.0, 1.0);
        denoised_ = double(c_out) * x0 + double(c_skip) * x;
        if (i == n_ - 1) return denoised_;
        // Forward diffusion of the estimate to the next timestep (DDPM eq. 4).
        const auto fresh = double(std::sqrt(1.0f - a_prev)) * draw_noise(out, gen);
        carry_injected_noise(double(std::sqrt(a_prev)) * double(c_skip), fresh);
        return double(std::sqrt(a_prev)) * denoised_ + fresh;
    }

private:
    float final_alpha_;
};

} // namespace

std::unique_ptr<Scheduler> make_lcm(const SchedulerConfig& cfg, std::optional<double>) {
    return std::make_unique<LcmScheduler>(cfg);
}

} // namespace anchor::unet::samplers
