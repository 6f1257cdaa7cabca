// PNDM with skip_prk_steps: PLMS (Liu et al. 2022, eq. 12 + the linear multistep of sec. 4): one sampler behind unet/samplers/scheduler.h (common part: unet/samplers/sampler_base.h).
#include "unet/samplers/sampler_base.h"

namespace anchor::unet::samplers {

namespace {

class PndmScheduler final : public SchedulerBase {
public:
    explicit PndmScheduler(const SchedulerConfig& cfg) : SchedulerBase(cfg, "PNDM") {
        final_alpha_ = cfg_.set_alpha_to_one ? 1.0f : abar_[0];
    }
    int earlier_outputs() const override { return 3; }
    void set_timesteps(int n) override {
        check_num_steps(cfg_, n, "PNDM");
        n_ = n;
        begin_ = 0;
        // diffusers: plms = concat(ts[:-1], ts[-2:-1], ts[-1:])[::-1] on ascending ts -> the second timestep repeats.
        desc_ = custom_schedule() ? rounded_schedule_timesteps(n) : spaced_timesteps(cfg_, n, true);
        const auto& desc = desc_;
        ts_.clear();
        ts_.push_back(desc[0]);
        if (n > 1) ts_.push_back(desc[1]);
        for (size_t k = 1; k < desc.size(); ++k) ts_.push_back(desc[k]);
        ets_.clear();
        counter_ = 0;
        cur_sample_ = torch::Tensor();
    }
    double init_noise_sigma() const override { return 1.0; }
    torch::Tensor scale_model_input(const torch::Tensor& x, int) const override { return x; }
    torch::Tensor step(const torch::Tensor& out, int i, const torch::Tensor& x, torch::Generator*) override {
        // diffusers' PNDM has no begin index: its counter starts at 0 on the first timestep run.
        check_in_order(i, begin_ + counter_);
        const int ratio = cfg_.num_train_timesteps / n_;
        auto t = static_cast<int64_t>(ts_[i]);
        int64_t prev = t - ratio;
        // Loop step i runs timestep desc_[pos] (ts_ = d0, d1, d1, d2, ...); a custom schedule steps to the next
        // timestep of the list, and the second step (counter 1) redoes the first, desc_[pos - 1] -> desc_[pos], where
        // diffusers adds its stride back.
        const size_t pos = i <= 1 ? size_t(i) : size_t(i - 1);
        if (custom_schedule()) prev = next_in(desc_, pos);
        if (counter_ != 1) {
            if (ets_.size() > 3) ets_.erase(ets_.begin(), ets_.end() - 3);
            ets_.push_back(out);
        } else if (custom_schedule()) {
            prev = t;
            t = static_cast<int64_t>(desc_.at(pos - 1));
        } else {
            prev = t;
            t = t + ratio;
        }
        torch::Tensor m, s = x;
        const size_t k = ets_.size();
        if (k == 1 && counter_ == 0) {
            m = out;
            cur_sample_ = x;
        } else if (k == 1 && counter_ == 1) {
            m = (out + ets_.back()) / 2;
            s = cur_sample_;
            cur_sample_ = torch::Tensor();
        } else if (k == 2) {
            m = (3 * ets_[k - 1] - ets_[k - 2]) / 2;
        } else if (k == 3) {
            m = (23 * ets_[k - 1] - 16 * ets_[k - 2] + 5 * ets_[k - 3]) / 12;
        } else {
            m = (1.0 / 24) * (55 * ets_[k - 1] - 59 * ets_[k - 2] + 37 * ets_[k - 3] - 9 * ets_[k - 4]);
        }
        auto prev_sample = prev_sample_from(s, t, prev, m);
        ++counter_;
        return prev_sample;
    }

private:
    void restart() override {
        ets_.clear();
        counter_ = 0;
        cur_sample_ = torch::Tensor();
    }
    // PNDM eq. (9): x_prev = sqrt(a_prev / a_t) x - (a_prev - a_t) eps / (a_t sqrt(1 - a_prev) + sqrt(a_t (1 - a_t)
    // a_prev)).
    torch::Tensor prev_sample_from(const torch::Tensor& x, int64_t t, int64_t prev, torch::Tensor eps) const {
        const float a_t = abar_at(t, final_alpha_), a_prev = abar_at(prev, final_alpha_);
        const float b_t = 1.0f - a_t, b_prev = 1.0f - a_prev;
        if (cfg_.prediction_type == PredictionType::VPrediction)
            eps = double(std::sqrt(a_t)) * eps + double(std::sqrt(b_t)) * x;
        else if (cfg_.prediction_type != PredictionType::Epsilon)
            throw Error("PNDM supports prediction_type epsilon or v_prediction, not '" +
                        enum_name(prediction_type_table(), cfg_.prediction_type) + "'");
        const float sample_coeff = std::sqrt(a_prev / a_t);
        const float denom = a_t * std::sqrt(b_prev) + std::sqrt(a_t * b_t * a_prev);
        return double(sample_coeff) * x - double(a_prev - a_t) * eps / double(denom);
    }

    float final_alpha_;
    std::vector<double> desc_; // the distinct-step list, descending
    std::vector<torch::Tensor> ets_;
    int counter_ = 0;
    torch::Tensor cur_sample_;
};

} // namespace

std::unique_ptr<Scheduler> make_pndm(const SchedulerConfig& cfg, std::optional<double> ) {
    return std::make_unique<PndmScheduler>(cfg);
}

} // namespace anchor::unet::samplers
