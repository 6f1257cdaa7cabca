// DPM-Solver++(2M) (Lu et al. 2022b, algorithm 2; midpoint variant as diffusers): one sampler behind unet/scheduler.h (common part: unet/samplers/sampler_base.h).
#include "unet/samplers/sampler_base.h"

namespace anchor::unet::samplers {

namespace {

class DpmSolverScheduler final : public SchedulerBase {
public:
    explicit DpmSolverScheduler(const SchedulerConfig& cfg) : SchedulerBase(cfg, "DPMSolver++2M") {}
    int earlier_outputs() const override { return 1; }
    std::vector<double> sigmas() const override { return std::vector<double>(sig_.begin(), sig_.end()); }
    double init_noise_sigma() const override { return 1.0; }
    torch::Tensor scale_model_input(const torch::Tensor& x, int) const override { return x; }

    void set_timesteps(int n) override {
        check_num_steps(cfg_, n, "DPMSolver++2M");
        const int N = cfg_.num_train_timesteps;
        const int last = N; // lambda_min_clipped = -inf clips nothing
        std::vector<double> t;
        if (cfg_.timestep_spacing == TimestepSpacing::Leading) {
            // DPM's own 'leading': step_ratio = last // (n + 1), drop the final 0.
            const int ratio = last / (n + 1);
            for (int i = n; i >= 1; --i) t.push_back(double(i * ratio + cfg_.steps_offset));
        } else if (cfg_.timestep_spacing == TimestepSpacing::Linspace) {
            auto v = np_linspace(0, last - 1, n + 1);
            for (int i = n; i >= 1; --i) t.push_back(np_round(v[i]));
        } else if (cfg_.timestep_spacing == TimestepSpacing::Trailing) {
            for (double v : np_arange_down(last, 0, -double(N) / n)) t.push_back(np_round(v) - 1);
        } else {
            bad_spacing(cfg_);
        }
        const auto full = train_sigmas(make_alphas_cumprod(cfg_));
        sig_.clear();
        if (custom_schedule()) {
            // The schedule's sigmas, each mapped back to a timestep rounded half to even (diffusers' DPM-Solver with
            // use_karras_sigmas: round(_sigma_to_t(sigma))).
            const auto lv = schedule_levels(*cfg_.schedule, cfg_, n);
            t.clear();
            for (size_t k = 0; k < lv.sigmas.size(); ++k) {
                sig_.push_back(static_cast<float>(lv.sigmas[k]));
                t.push_back(np_round(lv.timesteps[k]));
            }
        } else {
            for (double v : t) {
                if (v < 0 || v > N - 1)
                    throw ParamError("steps", "DPMSolver++2M: timestep " + std::to_string(v) + " outside [0, " +
                                                  std::to_string(N - 1) + "]");
                sig_.push_back(static_cast<float>(np_interp_index(v, full)));
            }
        }
        sig_.push_back(0.0f); // final_sigmas_type "zero"
        ts_ = t;
        n_ = static_cast<int>(ts_.size());
        begin_ = 0;
        restart();
    }
    torch::Tensor add_noise(const torch::Tensor& x0, const torch::Tensor& noise, int i) const override {
        check_index(i);
        const auto [alpha, sigma] = sigma_to_alpha_sigma(sig_[i]);
        return x0 * double(alpha) + noise * double(sigma);
    }

    torch::Tensor step(const torch::Tensor& out, int i, const torch::Tensor& x, torch::Generator*) override {
        check_in_order(i, step_index_);
        // The last step is first order because the final sigma is 0 (final_sigmas_type zero); so is the first one
        // (no history yet).
        const bool lower_order_final = i == n_ - 1;
        auto x0 = convert_model_output(out, x, i);
        model_outputs_[0] = model_outputs_[1];
        model_outputs_[1] = x0;
        auto sample = x.to(torch::kFloat32);
        torch::Tensor prev;
        if (lower_order_nums_ < 1 || lower_order_final)
            prev = first_order(x0, sample, i);
        else
            prev = second_order(sample, i);
        if (lower_order_nums_ < 2) ++lower_order_nums_;
        ++step_index_;
        return prev.to(out.scalar_type());
    }

private:
    void restart() override {
        model_outputs_[0] = model_outputs_[1] = torch::Tensor();
        lower_order_nums_ = 0;
        step_index_ = begin_;
    }
    // Data prediction x0 (DPM-Solver++ works on x0, Lu et al. 2022b eq. 9).
    torch::Tensor convert_model_output(const torch::Tensor& out, const torch::Tensor& x, int i) const {
        const auto [alpha, sigma] = sigma_to_alpha_sigma(sig_[i]);
        if (cfg_.prediction_type == PredictionType::Epsilon) return (x - double(sigma) * out) / double(alpha);
        if (cfg_.prediction_type == PredictionType::VPrediction) return double(alpha) * x - double(sigma) * out;
        return out;
    }

    struct Lambda {
        float alpha, sigma, lambda;
    };
    Lambda at(int k) const {
        const auto [alpha, sigma] = sigma_to_alpha_sigma(sig_[k]);
        return {alpha, sigma, torch_log(alpha) - torch_log(sigma)}; // lambda = log(alpha / sigma), half log-SNR
    }

    // x_t = (sigma_t / sigma_s) x - alpha_t (e^{-h} - 1) x0,  h = lambda_t - lambda_s   (eq. 10, first order)
    torch::Tensor first_order(const torch::Tensor& x0, const torch::Tensor& sample, int i) const {
        const auto t = at(i + 1), s = at(i);
        const float h = t.lambda - s.lambda;
        return double(t.sigma / s.sigma) * sample - double(t.alpha * (torch_exp(-h) - 1.0f)) * x0;
    }

    // 2M midpoint: D0 = m0, D1 = (m0 - m1) / r0, r0 = h_0 / h;
    // x_t = (sigma_t / sigma_s0) x - alpha_t (e^{-h} - 1) D0 - 0.5 alpha_t (e^{-h} - 1) D1
    torch::Tensor second_order(const torch::Tensor& sample, int i) const {
        const auto t = at(i + 1), s0 = at(i), s1 = at(i - 1);
        const auto& m0 = model_outputs_[1];
        const auto& m1 = model_outputs_[0];
        const float h = t.lambda - s0.lambda, h0 = s0.lambda - s1.lambda;
        const float r0 = h0 / h;
        auto d1 = double(1.0f / r0) * (m0 - m1);
        const float c = t.alpha * (torch_exp(-h) - 1.0f);
        return double(t.sigma / s0.sigma) * sample - double(c) * m0 - double(0.5f * c) * d1;
    }

    std::vector<float> sig_;
    torch::Tensor model_outputs_[2];
    int lower_order_nums_ = 0;
    int step_index_ = 0;
};

} // namespace

std::unique_ptr<Scheduler> make_dpmpp_2m(const SchedulerConfig& cfg, std::optional<double> ) {
    return std::make_unique<DpmSolverScheduler>(cfg);
}

} // namespace anchor::unet::samplers
