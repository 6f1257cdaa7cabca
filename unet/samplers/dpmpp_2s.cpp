// DPM-Solver++(2S) (Lu et al. 2022b, algorithm 1 with the intermediate point on the timestep grid, as diffusers'
// DPMSolverSinglestepScheduler with solver_order 2): one sampler behind unet/samplers/scheduler.h (common part:
// unet/samplers/sampler_base.h).
#include "unet/samplers/sampler_base.h"

namespace anchor::unet::samplers {

namespace {

class DpmSolverSinglestepScheduler final : public DpmFamilyScheduler {
public:
    explicit DpmSolverSinglestepScheduler(const SchedulerConfig& cfg) : DpmFamilyScheduler(cfg, "DPMSolver++2S") {
        const auto& so = cfg_.solver;
        // The third-order singlestep update is not implemented (solver_order 3 is refused).
        order_ = solver_order(2, 2);
        final_zero_ = so.final_sigmas_type.value_or(FinalSigmasType::Zero) == FinalSigmasType::Zero;
        heun_ = so.solver_type.value_or(SolverType::Midpoint) == SolverType::Heun;
    }
    // The second step of a pair combines the first one's output.
    int earlier_outputs() const override { return order_ - 1; }

    // diffusers 0.27.2's singlestep solver has no timestep_spacing: its timesteps are always linspace(0, N - 1,
    // n + 1) rounded, less the last.
    void set_timesteps(int n) override {
        set_dpm_timesteps(n, TimestepSpacing::Linspace, final_zero_ ? FinalSigma::Zero : FinalSigma::TrainMin);
        // Pairs of steps (first order to the grid point s0, then second order from the pair's start over both). With
        // lower_order_final the last step is first order alone (an even count ends with two first-order steps);
        // diffusers forces lower_order_final for an odd count and for a final sigma of 0.
        const bool lower_final = cfg_.solver.lower_order_final.value_or(true) || n_ % order_ != 0 || final_zero_;
        orders_.clear();
        if (order_ == 1) {
            orders_.assign(size_t(n_), 1);
            return;
        }
        const int pairs = !lower_final ? n_ / 2 : n_ % 2 == 0 ? n_ / 2 - 1 : n_ / 2;
        for (int k = 0; k < pairs; ++k) orders_.insert(orders_.end(), {1, 2});
        while (static_cast<int>(orders_.size()) < n_) orders_.push_back(1);
    }

    torch::Tensor step(const torch::Tensor& out, int i, const torch::Tensor& x, torch::Generator*) override {
        check_in_order(i, step_index_);
        auto x0 = data_prediction(out, x, i);
        remember(x0, 2);
        int order = orders_.at(size_t(i));
        if (order == 2 && history_.size() < 2) order = 1; // no pair start yet (a begin index inside a pair)
        if (order == 1) pair_start_ = x;
        ++step_index_;
        if (order == 1) return dpmpp_first_order(x0, pair_start_, i, i + 1);
        return second_order(i);
    }

private:
    void restart() override {
        DpmFamilyScheduler::restart();
        pair_start_ = torch::Tensor();
    }

    // From the pair's start s1 (sample x) over s0 to t: h = lambda_t - lambda_s1, r0 = (lambda_s0 - lambda_s1) / h,
    // D0 = m1, D1 = (m0 - m1) / r0; x_t = (sigma_t / sigma_s1) x - alpha_t (e^{-h} - 1) D0 + second-order term:
    //   midpoint: - 0.5 alpha_t (e^{-h} - 1) D1;   heun: + alpha_t ((e^{-h} - 1) / h + 1) D1
    torch::Tensor second_order(int i) const {
        const auto t = lambda_at(i + 1), s0 = lambda_at(i), s1 = lambda_at(i - 1);
        const auto &m0 = recent(0), &m1 = recent(1);
        const float h = t.lambda - s1.lambda, h0 = s0.lambda - s1.lambda;
        const float r0 = h0 / h;
        auto d1 = double(1.0f / r0) * (m0 - m1);
        const float em1 = torch_exp(-h) - 1.0f;
        const float c = t.alpha * em1;
        auto x_t = double(t.sigma / s1.sigma) * pair_start_ - double(c) * m1;
        return heun_ ? x_t + double(t.alpha * (em1 / h + 1.0f)) * d1 : x_t - double(0.5f * c) * d1;
    }

    int order_ = 2;
    bool final_zero_ = true, heun_ = false;
    std::vector<int> orders_;
    torch::Tensor pair_start_;
};

} // namespace

std::unique_ptr<Scheduler> make_dpmpp_2s(const SchedulerConfig& cfg, std::optional<double>) {
    return std::make_unique<DpmSolverSinglestepScheduler>(cfg);
}

} // namespace anchor::unet::samplers
