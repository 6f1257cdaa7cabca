// DEIS (Zhang & Chen 2023, "Fast Sampling of Diffusion Models with Exponential Integrator"): the log-rho multistep
// exponential integrator in noise prediction, its polynomial extrapolation integrated exactly in log rho, rho =
// sigma_t / alpha_t, as diffusers' DEISMultistepScheduler (algorithm_type deis, solver_type logrho). One sampler
// behind unet/samplers/scheduler.h (common part: unet/samplers/sampler_base.h).
#include "unet/samplers/sampler_base.h"

namespace anchor::unet::samplers {

namespace {

class DeisScheduler final : public DpmFamilyScheduler {
public:
    explicit DeisScheduler(const SchedulerConfig& cfg) : DpmFamilyScheduler(cfg, "DEIS") {
        order_ = solver_order(2, 3);
        lower_order_final_ = cfg_.solver.lower_order_final.value_or(true);
    }
    int earlier_outputs() const override { return order_ - 1; }

    void set_timesteps(int n) override { set_dpm_timesteps(n, cfg_.timestep_spacing, FinalSigma::ScheduleEnd); }

    torch::Tensor step(const torch::Tensor& out, int i, const torch::Tensor& x, torch::Generator*) override {
        check_in_order(i, step_index_);
        // Short runs (under 15 steps) end at lower orders (lower_order_final), as diffusers.
        const bool short_run = lower_order_final_ && n_ < 15;
        const bool first_at_final = i == n_ - 1 && short_run;
        const bool second_at_final = i == n_ - 2 && short_run;
        // DEIS integrates the noise prediction: eps rebuilt from the data prediction (so v / sample models work).
        const auto [alpha, sigma] = sigma_to_alpha_sigma(sig_[i]);
        const auto x0 = data_prediction(out, x, i);
        remember((x - double(alpha) * x0) / double(sigma), order_);
        torch::Tensor prev;
        switch (multistep_order(order_, first_at_final, second_at_final)) {
        case 1:
            prev = first_order(x, i);
            break;
        case 2:
            prev = second_order(x, i);
            break;
        default:
            prev = third_order(x, i);
        }
        ++step_index_;
        return prev.to(out.scalar_type());
    }

private:
    // x_t = (alpha_t / alpha_s) x - sigma_t (e^{h} - 1) eps (DDIM in noise prediction).
    torch::Tensor first_order(const torch::Tensor& sample, int i) const {
        const auto t = lambda_at(i + 1), s = lambda_at(i);
        const float h = t.lambda - s.lambda;
        return double(t.alpha / s.alpha) * sample - double(t.sigma * (torch_exp(h) - 1.0f)) * recent(0);
    }

    // rho = sigma / alpha of sigma index k.
    float rho_at(int k) const {
        const auto l = lambda_at(k);
        return l.sigma / l.alpha;
    }
    // Antiderivatives in rho of the Lagrange basis polynomials in log rho through the nodes (Zhang & Chen eq. 15
    // with the log-rho time): linear, F(t; b, c) = t (log t - log c - 1) / (log b - log c) for the node b ...
    static float basis_integral(float t, float b, float c) {
        const float lt = std::log(t), lb = std::log(b), lc = std::log(c);
        return t * (-lc + lt - 1.0f) / (lb - lc);
    }
    // ... and quadratic, for the node b of (b, c, d).
    static float basis_integral(float t, float b, float c, float d) {
        const float lt = std::log(t), lb = std::log(b), lc = std::log(c), ld = std::log(d);
        const float num = t * (lc * (ld - lt + 1.0f) - ld * lt + ld + lt * lt - 2.0f * lt + 2.0f);
        return num / ((lb - lc) * (lb - ld));
    }
    // x_t = alpha_t (x / alpha_s0 + c1 eps_0 + c2 eps_1), c_k = F(rho_t) - F(rho_s0) of eps_k's basis.
    torch::Tensor second_order(const torch::Tensor& sample, int i) const {
        const float rt = rho_at(i + 1), r0 = rho_at(i), r1 = rho_at(i - 1);
        const float c1 = basis_integral(rt, r0, r1) - basis_integral(r0, r0, r1);
        const float c2 = basis_integral(rt, r1, r0) - basis_integral(r0, r1, r0);
        const auto t = lambda_at(i + 1), s0 = lambda_at(i);
        return double(t.alpha) * (sample / double(s0.alpha) + double(c1) * recent(0) + double(c2) * recent(1));
    }
    // x_t = alpha_t (x / alpha_s0 + c1 eps_0 + c2 eps_1 + c3 eps_2).
    torch::Tensor third_order(const torch::Tensor& sample, int i) const {
        const float rt = rho_at(i + 1), r0 = rho_at(i), r1 = rho_at(i - 1), r2 = rho_at(i - 2);
        const float c1 = basis_integral(rt, r0, r1, r2) - basis_integral(r0, r0, r1, r2);
        const float c2 = basis_integral(rt, r1, r2, r0) - basis_integral(r0, r1, r2, r0);
        const float c3 = basis_integral(rt, r2, r0, r1) - basis_integral(r0, r2, r0, r1);
        const auto t = lambda_at(i + 1), s0 = lambda_at(i);
        return double(t.alpha) *
               (sample / double(s0.alpha) + double(c1) * recent(0) + double(c2) * recent(1) + double(c3) * recent(2));
    }

    int order_ = 2;
    bool lower_order_final_ = true;
};

} // namespace

std::unique_ptr<Scheduler> make_deis(const SchedulerConfig& cfg, std::optional<double>) {
    return std::make_unique<DeisScheduler>(cfg);
}

} // namespace anchor::unet::samplers
