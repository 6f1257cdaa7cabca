// DPM-Solver++(2M) (Lu et al. 2022b, algorithm 2; midpoint variant as diffusers) and its SDE form (DPM-Solver++(2M)
// SDE, the sde-dpmsolver++ algorithm of diffusers' DPMSolverMultistepScheduler): one diffusers class, one history,
// one order rule, two update formulas. Also the common part of the DPM-Solver family (DpmFamilyScheduler,
// unet/samplers/sampler_base.h).
#include "unet/samplers/sampler_base.h"

namespace anchor::unet::samplers {

// ---- DpmFamilyScheduler ------------------------------------------------------------------------------------------

void DpmFamilyScheduler::set_dpm_timesteps(int n, TimestepSpacing spacing, FinalSigma final_sigma) {
    check_num_steps(cfg_, n, name_);
    const int N = cfg_.num_train_timesteps;
    const int last = N; // lambda_min_clipped = -inf clips nothing
    std::vector<double> t;
    if (spacing == TimestepSpacing::Leading) {
        // DPM's own 'leading': step_ratio = last // (n + 1), drop the final 0.
        const int ratio = last / (n + 1);
        for (int i = n; i >= 1; --i) t.push_back(double(i * ratio + cfg_.steps_offset));
    } else if (spacing == TimestepSpacing::Linspace) {
        auto v = np_linspace(0, last - 1, n + 1);
        for (int i = n; i >= 1; --i) t.push_back(np_round(v[i]));
    } else if (spacing == TimestepSpacing::Trailing) {
        for (double v : np_arange_down(last, 0, -double(N) / n)) t.push_back(np_round(v) - 1);
    } else {
        bad_spacing(cfg_);
    }
    const auto full = train_sigmas(make_alphas_cumprod(cfg_));
    sig_.clear();
    if (custom_schedule()) {
        // The schedule's sigmas, each mapped back to a timestep rounded half to even (diffusers' DPM-Solver family
        // with use_karras_sigmas: round(_sigma_to_t(sigma))).
        const auto lv = schedule_levels(*cfg_.schedule, cfg_, n);
        t.clear();
        for (size_t k = 0; k < lv.sigmas.size(); ++k) {
            sig_.push_back(static_cast<float>(lv.sigmas[k]));
            t.push_back(np_round(lv.timesteps[k]));
        }
    } else {
        for (double v : t) {
            if (v < 0 || v > N - 1)
                throw ParamError("steps", std::string(name_) + ": timestep " + std::to_string(v) + " outside [0, " +
                                              std::to_string(N - 1) + "]");
            sig_.push_back(static_cast<float>(np_interp_index(v, full)));
        }
    }
    if (final_sigma == FinalSigma::Zero)
        sig_.push_back(0.0f);
    else if (final_sigma == FinalSigma::ScheduleEnd && custom_schedule())
        sig_.push_back(sig_.back());
    else
        sig_.push_back(full.front()); // sigma(t = 0)
    ts_ = t;
    n_ = static_cast<int>(ts_.size());
    begin_ = 0;
    reset_injected_noise();
    restart();
}

torch::Tensor DpmFamilyScheduler::data_prediction(const torch::Tensor& out, const torch::Tensor& x, int i) const {
    const auto [alpha, sigma] = sigma_to_alpha_sigma(sig_[i]);
    if (cfg_.prediction_type == PredictionType::Epsilon) return (x - double(sigma) * out) / double(alpha);
    if (cfg_.prediction_type == PredictionType::VPrediction) return double(alpha) * x - double(sigma) * out;
    return out;
}

torch::Tensor DpmFamilyScheduler::dpmpp_first_order(const torch::Tensor& x0, const torch::Tensor& sample, int s,
                                                    int t) const {
    const auto lt = lambda_at(t), ls = lambda_at(s);
    const float h = lt.lambda - ls.lambda;
    return double(lt.sigma / ls.sigma) * sample - double(lt.alpha * (torch_exp(-h) - 1.0f)) * x0;
}

namespace {

// The two algorithms of DPMSolverMultistepScheduler implemented here.
enum class DpmAlgorithm {
    // DPM-Solver++ (Lu et al. 2022b): the exponential integrator of the probability-flow ODE in data prediction.
    Ode,
    // SDE-DPM-Solver++ (the SDE form of Lu et al. 2022b; diffusers' sde-dpmsolver++, k-diffusion's
    // sample_dpmpp_2m_sde): the same integrator for the reverse SDE, whose exact linear part decays the sample by an
    // extra e^{-h}, doubles the data weight's exponent and adds fresh noise of std sigma_t sqrt(1 - e^{-2h}).
    Sde,
};

class DpmSolverScheduler final : public DpmFamilyScheduler {
public:
    DpmSolverScheduler(const SchedulerConfig& cfg, DpmAlgorithm algorithm)
        : DpmFamilyScheduler(cfg, algorithm == DpmAlgorithm::Sde ? "DPMSolver++2MSDE" : "DPMSolver++2M"),
          algorithm_(algorithm) {
        const auto& so = cfg_.solver;
        // diffusers has no third-order SDE update.
        order_ = solver_order(2, algorithm == DpmAlgorithm::Sde ? 2 : 3);
        lower_order_final_ = so.lower_order_final.value_or(true);
        euler_at_final_ = so.euler_at_final.value_or(false);
        final_zero_ = so.final_sigmas_type.value_or(FinalSigmasType::Zero) == FinalSigmasType::Zero;
        // diffusers runs UniPC's and DEIS's solver types as midpoint.
        heun_ = so.solver_type.value_or(SolverType::Midpoint) == SolverType::Heun;
    }
    int earlier_outputs() const override { return order_ - 1; }

    void set_timesteps(int n) override {
        set_dpm_timesteps(n, cfg_.timestep_spacing, final_zero_ ? FinalSigma::Zero : FinalSigma::TrainMin);
    }

    torch::Tensor step(const torch::Tensor& out, int i, const torch::Tensor& x, torch::Generator* gen) override {
        check_in_order(i, step_index_);
        // Warm-up from first order; the last step first order when it ends at sigma 0 (final_sigmas_type zero), with
        // euler_at_final, or in a short run (lower_order_final, under 15 steps), the second-to-last at most second
        // order in a short run.
        const bool short_run = lower_order_final_ && n_ < 15;
        const bool first_at_final = i == n_ - 1 && (euler_at_final_ || short_run || final_zero_);
        const bool second_at_final = i == n_ - 2 && short_run;
        auto x0 = data_prediction(out, x, i);
        remember(x0, order_);
        auto sample = x.to(torch::kFloat32);
        // The SDE draws its noise every step (the last one too, where its scale may be 0), as diffusers' step does.
        torch::Tensor noise;
        if (algorithm_ == DpmAlgorithm::Sde) noise = draw_noise(sample, gen);
        const bool sde = algorithm_ == DpmAlgorithm::Sde;
        torch::Tensor prev;
        switch (multistep_order(order_, first_at_final, second_at_final)) {
        case 1:
            prev = sde ? sde_first_order(x0, sample, noise, i) : dpmpp_first_order(x0, sample, i, i + 1);
            break;
        case 2:
            prev = sde ? sde_second_order(sample, noise, i) : second_order(sample, i);
            break;
        default:
            prev = third_order(sample, i);
        }
        ++step_index_;
        return prev.to(out.scalar_type());
    }

private:
    // D1 = (m0 - m1) / r0 with r0 = h_0 / h (Lu et al. 2022b, algorithm 2).
    torch::Tensor first_difference(int i, float h) const {
        const auto s0 = lambda_at(i), s1 = lambda_at(i - 1);
        const float r0 = (s0.lambda - s1.lambda) / h;
        return double(1.0f / r0) * (recent(0) - recent(1));
    }

    // x_t = (sigma_t / sigma_s0) x - alpha_t (e^{-h} - 1) D0 + second-order term, D0 = m0:
    //   midpoint: - 0.5 alpha_t (e^{-h} - 1) D1;   heun: + alpha_t ((e^{-h} - 1) / h + 1) D1
    torch::Tensor second_order(const torch::Tensor& sample, int i) const {
        const auto t = lambda_at(i + 1), s0 = lambda_at(i);
        const float h = t.lambda - s0.lambda;
        auto d1 = first_difference(i, h);
        const float em1 = torch_exp(-h) - 1.0f;
        const float c = t.alpha * em1;
        auto x_t = double(t.sigma / s0.sigma) * sample - double(c) * recent(0);
        return heun_ ? x_t + double(t.alpha * (em1 / h + 1.0f)) * d1 : x_t - double(0.5f * c) * d1;
    }

    // 3M (Lu et al. 2022b, appendix A): D1 = D1_0 + r0 / (r0 + r1) (D1_0 - D1_1), D2 = (D1_0 - D1_1) / (r0 + r1);
    // x_t = (sigma_t / sigma_s0) x - alpha_t (e^{-h} - 1) D0 + alpha_t ((e^{-h} - 1) / h + 1) D1
    //       - alpha_t ((e^{-h} - 1 + h) / h^2 - 0.5) D2
    torch::Tensor third_order(const torch::Tensor& sample, int i) const {
        const auto t = lambda_at(i + 1), s0 = lambda_at(i), s1 = lambda_at(i - 1), s2 = lambda_at(i - 2);
        const float h = t.lambda - s0.lambda, h0 = s0.lambda - s1.lambda, h1 = s1.lambda - s2.lambda;
        const float r0 = h0 / h, r1 = h1 / h;
        const auto &m0 = recent(0), &m1 = recent(1), &m2 = recent(2);
        auto d1_0 = double(1.0f / r0) * (m0 - m1);
        auto d1_1 = double(1.0f / r1) * (m1 - m2);
        auto d1 = d1_0 + double(r0 / (r0 + r1)) * (d1_0 - d1_1);
        auto d2 = double(1.0f / (r0 + r1)) * (d1_0 - d1_1);
        const float e = torch_exp(-h);
        return double(t.sigma / s0.sigma) * sample - double(t.alpha * (e - 1.0f)) * m0 +
               double(t.alpha * ((e - 1.0f) / h + 1.0f)) * d1 -
               double(t.alpha * ((e - 1.0f + h) / (h * h) - 0.5f)) * d2;
    }

    // The SDE steps share the decay of the sample, sigma_t / sigma_s e^{-h}, the weight alpha_t (1 - e^{-2h}) of the
    // data prediction and the fresh noise sigma_t sqrt(1 - e^{-2h}) z; the carry of the injected noise is the decay.
    struct SdeTerms {
        float h, decay, data, noise;
    };
    SdeTerms sde_terms(int s, int t) const {
        const auto lt = lambda_at(t), ls = lambda_at(s);
        const float h = lt.lambda - ls.lambda;
        return {h, lt.sigma / ls.sigma * torch_exp(-h), lt.alpha * (1.0f - torch_exp(-2.0f * h)),
                lt.sigma * std::sqrt(1.0f - torch_exp(-2.0f * h))};
    }
    torch::Tensor add_fresh_noise(const torch::Tensor& deterministic, const SdeTerms& k, const torch::Tensor& noise) {
        const auto fresh = double(k.noise) * noise;
        if (k.noise > 0) carry_injected_noise(double(k.decay), fresh);
        return deterministic + fresh;
    }
    // x_t = (sigma_t / sigma_s e^{-h}) x + alpha_t (1 - e^{-2h}) x0 + sigma_t sqrt(1 - e^{-2h}) z
    torch::Tensor sde_first_order(const torch::Tensor& x0, const torch::Tensor& sample, const torch::Tensor& noise,
                                  int i) {
        const auto k = sde_terms(i, i + 1);
        return add_fresh_noise(double(k.decay) * sample + double(k.data) * x0, k, noise);
    }
    // x_t = (sigma_t / sigma_s0 e^{-h}) x + alpha_t (1 - e^{-2h}) D0 + second-order term + sigma_t sqrt(1 - e^{-2h}) z
    //   midpoint: + 0.5 alpha_t (1 - e^{-2h}) D1;   heun: + alpha_t ((1 - e^{-2h}) / (-2h) + 1) D1
    torch::Tensor sde_second_order(const torch::Tensor& sample, const torch::Tensor& noise, int i) {
        const auto k = sde_terms(i, i + 1);
        auto d1 = first_difference(i, k.h);
        auto x_t = double(k.decay) * sample + double(k.data) * recent(0);
        if (heun_) {
            const auto t = lambda_at(i + 1);
            x_t = x_t + double(t.alpha * ((1.0f - torch_exp(-2.0f * k.h)) / (-2.0f * k.h) + 1.0f)) * d1;
        } else {
            x_t = x_t + double(0.5f * k.data) * d1;
        }
        return add_fresh_noise(x_t, k, noise);
    }

    DpmAlgorithm algorithm_;
    int order_ = 2;
    bool lower_order_final_ = true, euler_at_final_ = false, final_zero_ = true, heun_ = false;
};

} // namespace

std::unique_ptr<Scheduler> make_dpmpp_2m(const SchedulerConfig& cfg, std::optional<double>) {
    return std::make_unique<DpmSolverScheduler>(cfg, DpmAlgorithm::Ode);
}

std::unique_ptr<Scheduler> make_dpmpp_2m_sde(const SchedulerConfig& cfg, std::optional<double>) {
    return std::make_unique<DpmSolverScheduler>(cfg, DpmAlgorithm::Sde);
}

} // namespace anchor::unet::samplers
