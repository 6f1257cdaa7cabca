// Flow-matching Euler (SD 3's FlowMatchEulerDiscreteScheduler, diffusers 0.31): one sampler behind
// unet/samplers/scheduler.h. The model predicts the velocity v = noise - x0 of the rectified-flow path
// x_sigma = (1 - sigma) x0 + sigma noise (Esser et al. 2024, "Scaling Rectified Flow Transformers", sec. 2-3), and a
// step is Euler's x' = x + (sigma_next - sigma) v on the shifted sigmas, the last one 0.
//
// The schedule as diffusers builds it: the training sigmas t / N (t = N..1) shifted once by
// sigma' = shift sigma / (1 + (shift - 1) sigma) (eq. 23 with shift = sqrt(m / n)) give sigma_max and sigma_min;
// set_timesteps spaces n timesteps linearly between sigma_max N and sigma_min N (float64), divides by N and shifts
// again (so the training schedule's shift is applied twice to the low end, as diffusers does), rounds to float32, and
// the model's timestep is sigma * N. With use_dynamic_shifting the second shift is exp(mu) / (exp(mu) + 1/sigma - 1)
// (the training sigmas stay unshifted).
#include "unet/samplers/sampler_base.h"

namespace anchor::unet {

double flow_match_mu(const SchedulerConfig& cfg, int64_t image_seq_len) {
    const double m = (cfg.max_shift - cfg.base_shift) / double(cfg.max_image_seq_len - cfg.base_image_seq_len);
    const double b = cfg.base_shift - m * cfg.base_image_seq_len;
    return double(image_seq_len) * m + b;
}

namespace samplers {

namespace {

class FlowMatchEulerScheduler final : public Scheduler {
public:
    explicit FlowMatchEulerScheduler(const SchedulerConfig& cfg) : cfg_(cfg) {
        if (cfg.schedule && *cfg.schedule != NoiseSchedule::Default)
            throw ParamError("schedule", "flow_match_euler runs its own shifted schedule only ('default'), not '" +
                                             noise_schedule_name(*cfg.schedule) + "'");
        // Training sigmas in float32 as torch computes them: linspace(1, N, N)[::-1] / N, shifted unless dynamic.
        const int N = cfg.num_train_timesteps;
        const float first = float(N) / float(N), last = 1.0f / float(N);
        sigma_max_ = shifted_f32(first);
        sigma_min_ = shifted_f32(last);
    }
    void set_timesteps(int n) override {
        check_num_steps(cfg_, n, "flow_match_euler");
        if (cfg_.use_dynamic_shifting && !cfg_.mu)
            throw ParamError("mu", "flow_match_euler with use_dynamic_shifting needs mu (flow_match_mu of the image's "
                                   "token count)");
        const double N = cfg_.num_train_timesteps;
        sig_.clear();
        ts_.clear();
        for (double t : np_linspace(double(sigma_max_) * N, double(sigma_min_) * N, n)) {
            const double s = t / N;
            const double shifted = cfg_.use_dynamic_shifting
                                       ? std::exp(*cfg_.mu) / (std::exp(*cfg_.mu) + (1.0 / s - 1.0))
                                       : cfg_.shift * s / (1.0 + (cfg_.shift - 1.0) * s);
            sig_.push_back(float(shifted));
            ts_.push_back(float(shifted) * float(N)); // float32 product, as torch
        }
        sig_.push_back(0.0f);
        begin_ = 0;
    }
    int num_loop_steps() const override { return int(ts_.size()); }
    double timestep(int i) const override { return ts_.at(size_t(i)); }
    double init_noise_sigma() const override { return 1.0; }
    torch::Tensor scale_model_input(const torch::Tensor& x, int) const override { return x; }
    torch::Tensor step(const torch::Tensor& v, int i, const torch::Tensor& x, torch::Generator*) override {
        if (i < 0 || i >= num_loop_steps())
            throw Error("flow_match_euler: step " + std::to_string(i) + " outside [0, " +
                        std::to_string(num_loop_steps()) + ")");
        const float dt = sig_[size_t(i) + 1] - sig_[size_t(i)];
        return (x.to(torch::kFloat32) + double(dt) * v).to(v.scalar_type());
    }
    std::vector<double> timesteps() const override { return {ts_.begin(), ts_.end()}; }
    std::vector<double> sigmas() const override { return {sig_.begin(), sig_.end()}; }
    void set_begin_index(int begin) override { begin_ = begin; }
    int begin_index() const override { return begin_; }
    // diffusers' scale_noise: the point sigma of the straight path from x0 to the noise.
    torch::Tensor add_noise(const torch::Tensor& x0, const torch::Tensor& noise, int i) const override {
        const float s = sig_.at(size_t(i));
        return double(s) * noise + double(1.0f - s) * x0;
    }

private:
    float shifted_f32(float s) const {
        if (cfg_.use_dynamic_shifting) return s;
        const float sh = float(cfg_.shift);
        return sh * s / (1.0f + (sh - 1.0f) * s);
    }
    SchedulerConfig cfg_;
    float sigma_max_ = 1.0f, sigma_min_ = 0.0f;
    std::vector<float> sig_, ts_;
    int begin_ = 0;
};

} // namespace

std::unique_ptr<Scheduler> make_flow_match_euler(const SchedulerConfig& cfg, std::optional<double>) {
    return std::make_unique<FlowMatchEulerScheduler>(cfg);
}

} // namespace samplers
} // namespace anchor::unet
