// LMS (linear multistep in sigma, order 4): one sampler behind unet/samplers/scheduler.h (common part: unet/samplers/sampler_base.h).
#include "unet/samplers/sampler_base.h"

#include <deque>

namespace anchor::unet::samplers {

namespace {

class LmsScheduler final : public SigmaScheduler {
public:
    explicit LmsScheduler(const SchedulerConfig& cfg) : SigmaScheduler(cfg, "LMS") {}
    int earlier_outputs() const override { return 3; }
    void set_timesteps(int n) override {
        set_sigma_timesteps(n);
        derivatives_.clear();
        step_index_ = 0;
    }
    torch::Tensor step(const torch::Tensor& out, int i, const torch::Tensor& x, torch::Generator*) override {
        check_in_order(i, step_index_);
        const float sigma = sig_[i];
        auto x0 = ve_x0(cfg_.prediction_type, out, x, sigma, sigma);
        derivatives_.push_back((x - x0) / double(sigma));
        if (derivatives_.size() > kOrder) derivatives_.pop_front();
        // diffusers: order = min(step_index + 1, 4) coefficients, zipped with the derivatives stored so far (fewer
        // after a begin index > 0: the first steps of img2img use the first coefficients only).
        const int order = std::min(i + 1, kOrder);
        const int terms = std::min(order, static_cast<int>(derivatives_.size()));
        // prev = x + sum_j c_j d_{i-j}, c_j = integral over [sigma_i, sigma_{i+1}] of the Lagrange basis polynomial
        // l_j(tau) through the nodes sigma_{i-k}, k < order. diffusers integrates numerically (scipy quad); the
        // polynomial has degree < 4, so it is integrated exactly here.
        torch::Tensor acc;
        for (int j = 0; j < terms; ++j) {
            const double c = lms_coefficient(order, i, j);
            auto term = double(c) * derivatives_[derivatives_.size() - 1 - j];
            acc = j == 0 ? term : acc + term;
        }
        ++step_index_;
        return x + acc;
    }
    double lms_coefficient(int order, int t, int current) const {
        const double a = sig_[t], b = sig_[t + 1];
        // Polynomial in u = tau - a, coefficients low -> high.
        std::vector<double> poly{1.0};
        for (int k = 0; k < order; ++k) {
            if (k == current) continue;
            const double node = double(sig_[t - k]) - a;
            const double denom = double(sig_[t - current]) - double(sig_[t - k]);
            std::vector<double> next(poly.size() + 1, 0.0);
            for (size_t p = 0; p < poly.size(); ++p) {
                next[p + 1] += poly[p] / denom;
                next[p] -= poly[p] * node / denom;
            }
            poly.swap(next);
        }
        const double h = b - a;
        double integral = 0.0, hp = h;
        for (size_t p = 0; p < poly.size(); ++p, hp *= h) integral += poly[p] * hp / double(p + 1);
        return integral;
    }

private:
    void restart() override {
        derivatives_.clear();
        step_index_ = begin_;
    }
    static constexpr int kOrder = 4;
    std::deque<torch::Tensor> derivatives_;
    int step_index_ = 0;
};

} // namespace

std::unique_ptr<Scheduler> make_lms(const SchedulerConfig& cfg, std::optional<double> ) {
    return std::make_unique<LmsScheduler>(cfg);
}

} // namespace anchor::unet::samplers
