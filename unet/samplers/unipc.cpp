// UniPC (Zhao et al. 2023, "UniPC: A Unified Predictor-Corrector Framework for Fast Sampling of Diffusion Models"):
// the multistep predictor UniP-p and, each step, the corrector UniC applied to the sample before the next prediction,
// reusing the model output just computed (so a step still costs one model call). As diffusers'
// UniPCMultistepScheduler: one sampler behind unet/samplers/scheduler.h (common part: unet/samplers/sampler_base.h).
#include "unet/samplers/sampler_base.h"

#include <algorithm>

namespace anchor::unet::samplers {

namespace {

class UniPcScheduler final : public DpmFamilyScheduler {
public:
    explicit UniPcScheduler(const SchedulerConfig& cfg) : DpmFamilyScheduler(cfg, "UniPC") {
        const auto& so = cfg_.solver;
        order_ = solver_order(2, 1000);
        lower_order_final_ = so.lower_order_final.value_or(true);
        predict_x0_ = so.predict_x0.value_or(true);
        // diffusers runs the DPM-Solver and DEIS solver types as bh2.
        bh1_ = so.solver_type.value_or(SolverType::Bh2) == SolverType::Bh1;
        disable_corrector_ = so.disable_corrector;
    }
    // The predictor combines solver_order - 1 earlier outputs and the corrector one more.
    int earlier_outputs() const override { return order_; }

    void set_timesteps(int n) override { set_dpm_timesteps(n, cfg_.timestep_spacing, FinalSigma::ScheduleEnd); }

    torch::Tensor step(const torch::Tensor& out, int i, const torch::Tensor& x, torch::Generator*) override {
        check_in_order(i, step_index_);
        // The model saw the uncorrected sample: its prediction is taken there, then corrects that sample (UniC with
        // the new output as the extra node, Zhao et al. algorithm 1) unless disable_corrector names the previous step.
        auto m = convert(out, x, i);
        const bool corrected =
            i > 0 && last_sample_.defined() &&
            std::find(disable_corrector_.begin(), disable_corrector_.end(), i - 1) == disable_corrector_.end();
        auto sample = corrected ? corrector(m, i) : x;
        remember(m, order_);
        // Warm-up from first order, and (lower_order_final) the last steps at most the steps left.
        const int limit = lower_order_final_ ? std::min(order_, n_ - i) : order_;
        this_order_ = std::min(limit, lower_order_nums_ + 1);
        last_sample_ = sample;
        auto prev = predictor(sample, i);
        if (lower_order_nums_ < order_) ++lower_order_nums_;
        ++step_index_;
        return prev.to(out.scalar_type());
    }

private:
    void restart() override {
        DpmFamilyScheduler::restart();
        last_sample_ = torch::Tensor();
        this_order_ = 1;
    }

    // UniPC with predict_x0 works on the data prediction (UniPC-p on DPM-Solver++'s x0), otherwise on the noise.
    torch::Tensor convert(const torch::Tensor& out, const torch::Tensor& x, int i) const {
        auto x0 = data_prediction(out, x, i);
        if (predict_x0_) return x0;
        if (cfg_.prediction_type == PredictionType::Epsilon) return out;
        const auto [alpha, sigma] = sigma_to_alpha_sigma(sig_[i]);
        if (cfg_.prediction_type == PredictionType::VPrediction) return double(alpha) * out + double(sigma) * x;
        return (x - double(alpha) * out) / double(sigma); // "sample"
    }

    // The quantities UniP and UniC share (Zhao et al. sec. 3.1): hh = -h for the data prediction (h for the noise),
    // h phi_1 = e^{hh} - 1, phi_{k+1} = phi_k / hh - 1 / (k+1)!, B(h) = hh ("bh1") or e^{hh} - 1 ("bh2"),
    // b_k = phi_k k! / B(h), and R_{k,j} = r_j^{k-1} over the nodes r_j = (lambda_{s_j} - lambda_s0) / h and 1, with
    // the differences D1_j = (m_j - m0) / r_j.
    struct Coefficients {
        float h_phi_1, b_h;
        torch::Tensor r, b; // R [order, order], b [order]
        std::vector<torch::Tensor> d1s;
    };
    // From sigma index `anchor` (the newest history node s0 = recent(0)) to `target`; the k-th older node
    // (k = 1 .. order - 1) is sigma index first_older - (k - 1) with output recent(k).
    Coefficients coefficients(int anchor, int target, int order, int first_older) const {
        const auto t = lambda_at(target), s0 = lambda_at(anchor);
        const float h = t.lambda - s0.lambda;
        const auto& m0 = recent(0);
        Coefficients c;
        std::vector<float> rks;
        for (int k = 1; k < order; ++k) {
            const float rk = (lambda_at(first_older - (k - 1)).lambda - s0.lambda) / h;
            rks.push_back(rk);
            c.d1s.push_back((recent(k) - m0) / double(rk));
        }
        rks.push_back(1.0f);
        const float hh = predict_x0_ ? -h : h;
        c.h_phi_1 = torch_expm1(hh);
        float h_phi_k = c.h_phi_1 / hh - 1.0f;
        int64_t factorial = 1;
        c.b_h = bh1_ ? hh : torch_expm1(hh);
        const auto rk_t = torch::tensor(rks, torch::kFloat32);
        std::vector<torch::Tensor> rows;
        std::vector<float> b;
        for (int k = 1; k <= order; ++k) {
            rows.push_back(torch::pow(rk_t, k - 1));
            b.push_back(h_phi_k * float(factorial) / c.b_h);
            factorial *= k + 1;
            h_phi_k = h_phi_k / hh - static_cast<float>(1.0 / double(factorial));
        }
        c.r = torch::stack(rows);
        c.b = torch::tensor(b, torch::kFloat32);
        return c;
    }
    static torch::Tensor weighted_sum(const torch::Tensor& rhos, const std::vector<torch::Tensor>& d1s) {
        torch::Tensor acc;
        for (size_t k = 0; k < d1s.size(); ++k) {
            auto term = rhos[int64_t(k)].item<float>() * d1s[k];
            acc = k == 0 ? term : acc + term;
        }
        return acc;
    }
    // The order-0 part of both updates: data prediction (sigma_t / sigma_s0) x - alpha_t h phi_1 m0, noise
    // prediction (alpha_t / alpha_s0) x - sigma_t h phi_1 m0; `scale` is the factor of B(h) in the rest (alpha_t or
    // sigma_t).
    torch::Tensor base_update(const torch::Tensor& x, const Lambda& t, const Lambda& s0, const Coefficients& c,
                              float* scale) const {
        *scale = predict_x0_ ? t.alpha : t.sigma;
        const float decay = predict_x0_ ? t.sigma / s0.sigma : t.alpha / s0.alpha;
        return double(decay) * x - double(*scale * c.h_phi_1) * recent(0);
    }

    // UniP-p: x_t = base - scale B(h) sum_k rho_k D1_k, rho = R[:-1, :-1]^-1 b[:-1] (rho = 0.5 at order 2).
    torch::Tensor predictor(const torch::Tensor& x, int i) const {
        const int order = this_order_;
        const auto c = coefficients(i, i + 1, order, i - 1);
        float scale = 0;
        auto x_t = base_update(x, lambda_at(i + 1), lambda_at(i), c, &scale);
        if (!c.d1s.empty()) {
            const auto rhos =
                order == 2 ? torch::tensor({0.5f})
                           : at::linalg_solve(c.r.slice(0, 0, -1).slice(1, 0, -1), c.b.slice(0, 0, -1), true);
            x_t = x_t - double(scale * c.b_h) * weighted_sum(rhos, c.d1s);
        }
        return x_t.to(x.scalar_type());
    }

    // UniC, from the previous step's sample (sigma index i - 1) to this one with this step's output m_t as the extra
    // node, at the order the previous prediction used: x_t = base - scale B(h) (sum_k rho_k D1_k + rho_last (m_t -
    // m0)), rho = R^-1 b (rho = 0.5 at order 1).
    torch::Tensor corrector(const torch::Tensor& m_t, int i) const {
        const int order = this_order_;
        const auto c = coefficients(i - 1, i, order, i - 2);
        const auto rhos = order == 1 ? torch::tensor({0.5f}) : at::linalg_solve(c.r, c.b, true);
        float scale = 0;
        auto x_t = base_update(last_sample_, lambda_at(i), lambda_at(i - 1), c, &scale);
        auto d1_t = m_t - recent(0);
        const float rho_last = rhos[-1].item<float>();
        auto corr = c.d1s.empty() ? rho_last * d1_t : weighted_sum(rhos, c.d1s) + rho_last * d1_t;
        return (x_t - double(scale * c.b_h) * corr).to(last_sample_.scalar_type());
    }

    int order_ = 2;
    bool lower_order_final_ = true, predict_x0_ = true, bh1_ = false;
    std::vector<int> disable_corrector_;
    torch::Tensor last_sample_;
    int this_order_ = 1;
};

} // namespace

std::unique_ptr<Scheduler> make_unipc(const SchedulerConfig& cfg, std::optional<double>) {
    return std::make_unique<UniPcScheduler>(cfg);
}

} // namespace anchor::unet::samplers
