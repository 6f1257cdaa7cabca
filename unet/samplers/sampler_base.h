// The common part of the samplers behind unet/samplers/scheduler.h's Scheduler interface: the numpy-exact schedule and
// sigma helpers (defined in unet/samplers/scheduler.cpp), the base classes, and one factory per sampler. Each sampler
// is one file in this folder (ddim.cpp, pndm.cpp, euler.cpp, euler_a.cpp, dpmpp_2m.cpp, lms.cpp, dpmpp_sde.cpp,
// dpmpp_2s.cpp, unipc.cpp, deis.cpp) holding only its own step rule and multistep state; a new sampler is a new file,
// its factory and one row of make_scheduler's table.
//
// Scalar coefficients are computed in float (the schedulers hold float32 tensors, so diffusers' 0-dim tensor
// arithmetic is float32) and applied to the tensors in the same order as diffusers' expressions, which reproduces
// the goldens to the last bit or nearly so (tests/golden/sd/schedulers/README.md).
#pragma once

#include "cache/io/error.h"
#include "unet/samplers/scheduler.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace anchor::unet::samplers {

// ---- schedule and sigma helpers (unet/samplers/scheduler.cpp)
// -------------------------------------------------------------

std::vector<float> to_floats(const torch::Tensor& t);
// Karras/EDM sigmas of the training schedule: sigma_t = sqrt((1 - abar_t) / abar_t), float32 like diffusers.
std::vector<float> train_sigmas(const torch::Tensor& alphas_cumprod);
// numpy.arange(start, stop, step) for a negative float step: length ceil((stop - start) / step).
std::vector<double> np_arange_down(double start, double stop, double step);
// numpy.linspace(start, stop, num) in float64 (endpoint forced to `stop`).
std::vector<double> np_linspace(double start, double stop, int num);
// Half to even, as numpy.round.
double np_round(double x);
// numpy.interp(x, arange(len(fp)), fp) in float64.
double np_interp_index(double x, const std::vector<float>& fp);
// diffusers' _sigma_to_t, numpy-exact: piecewise-linear interpolation of t over log sigma (log_sigmas float32 as
// numpy's np.log of the float32 sigmas, sigma itself float64).
double sigma_to_t(double sigma, const std::vector<float>& log_sigmas);
// diffusers' EulerDiscreteScheduler._sigma_to_t as numpy < 2 evaluates it for one float64 sigma against the float32
// log_sigmas: value-based casting turns every array expression into float32 (log sigma rounded to float32 for the
// distances and the weight w = (low - log sigma) / (low - high)); only t = (1 - w) low + w high is float64.
double sigma_to_t_f32(double sigma, const std::vector<float>& log_sigmas);
// Karras et al. 2022 eq. 5, rho = 7 (the paper's value): n sigmas from sigma_max down to sigma_min, in float64 as
// diffusers' _convert_to_karras.
std::vector<double> karras_sigmas(double sigma_min, double sigma_max, int n);
void check_num_steps(const SchedulerConfig& cfg, int n, const char* who);
[[noreturn]] void bad_spacing(const SchedulerConfig&);
// Descending discrete timesteps shared by DDIM / PNDM (PNDM keeps them ascending) / Euler / LMS (as float):
//   leading:  (arange(n) * (N // n))[::-1] + steps_offset
//   trailing: round(arange(N, 0, -N / n)) - 1
//   linspace: round(linspace(0, N - 1, n))[::-1]   (Euler/LMS keep the unrounded float32 values: `rounded` false)
std::vector<double> spaced_timesteps(const SchedulerConfig& cfg, int n, bool rounded_linspace);
// VE/EDM form x = x0 + sigma eps on the scaled input x / sqrt(sigma^2 + 1) (Karras et al. 2022, table 1).
torch::Tensor ve_x0(PredictionType type, const torch::Tensor& out, const torch::Tensor& x, float sigma_hat,
                    float sigma);
// sigma (VE) -> (alpha_t, sigma_t) of the VP process: alpha_t = 1 / sqrt(sigma^2 + 1), sigma_t = sigma * alpha_t.
struct AlphaSigma {
    float alpha, sigma;
};
AlphaSigma sigma_to_alpha_sigma(float sigma);
// log / exp of a float32 scalar through LibTorch's own kernels: diffusers evaluates these on 0-dim float32 tensors,
// whose vectorised (Sleef) results can differ from libm's by an ulp.
float torch_log(float v);
float torch_exp(float v);
float torch_expm1(float v);
// Noise of model_output's shape from `gen` (drawn on the generator's device, then moved), like diffusers' randn_tensor.
torch::Tensor draw_noise(const torch::Tensor& like, torch::Generator* gen);

// ---- base classes ------------------------------------------------------------------------------------------------

class SchedulerBase : public Scheduler {
public:
    SchedulerBase(const SchedulerConfig& cfg, const char* name) : cfg_(cfg), name_(name) {
        abar_ = to_floats(make_alphas_cumprod(cfg_));
    }
    std::vector<double> timesteps() const override { return ts_; }
    int num_loop_steps() const override { return static_cast<int>(ts_.size()); }
    double timestep(int i) const override {
        check_index(i);
        return ts_[i];
    }
    void set_begin_index(int begin) override {
        if (ts_.empty()) throw Error(std::string(name_) + ": set_timesteps was not called");
        if (begin < 0 || begin >= static_cast<int>(ts_.size()))
            throw Error(std::string(name_) + ": begin index " + std::to_string(begin) + " outside [0, " +
                        std::to_string(ts_.size()) + ")");
        begin_ = begin;
        reset_injected_noise();
        restart();
    }
    int begin_index() const override { return begin_; }
    PredictionType prediction_type() const override { return cfg_.prediction_type; }
    // Alpha-bar form (DDIM / PNDM add_noise): abar at the timestep of loop step i, float32 like diffusers.
    torch::Tensor add_noise(const torch::Tensor& x0, const torch::Tensor& noise, int i) const override {
        check_index(i);
        const float abar = abar_.at(static_cast<size_t>(ts_[i]));
        return x0 * double(std::sqrt(abar)) + noise * double(std::sqrt(1.0f - abar));
    }

protected:
    // Multistep state back to the begin index (set_begin_index).
    virtual void restart() {}
    void check_index(int i) const {
        if (ts_.empty()) throw Error(std::string(name_) + ": set_timesteps was not called");
        if (i < 0 || i >= static_cast<int>(ts_.size()))
            throw Error(std::string(name_) + ": loop step " + std::to_string(i) + " outside [0, " +
                        std::to_string(ts_.size()) + ")");
    }
    // Multistep samplers keep history, so their steps must come in loop order.
    void check_in_order(int i, int expected) const {
        check_index(i);
        if (i != expected)
            throw Error(std::string(name_) + ": step(" + std::to_string(i) + ") called out of order (expected step " +
                        std::to_string(expected) + "); call set_timesteps to restart");
    }
    float abar_at(int64_t t, float final_alpha) const {
        return t >= 0 ? abar_.at(static_cast<size_t>(t)) : final_alpha;
    }
    // A schedule other than diffusers' own spacing (see the top of scheduler.h).
    bool custom_schedule() const { return cfg_.schedule.value_or(NoiseSchedule::Default) != NoiseSchedule::Default; }
    // Timestep samplers on a custom schedule: its _sigma_to_t timesteps rounded half to even (numpy.round).
    std::vector<double> rounded_schedule_timesteps(int n) const {
        std::vector<double> t;
        for (double v : schedule_levels(*cfg_.schedule, cfg_, n).timesteps) t.push_back(np_round(v));
        return t;
    }
    // DDIM / DDPM's set_timesteps: the spaced integer timesteps (linspace rounded), or the custom schedule's.
    void set_discrete_timesteps(int n) {
        check_num_steps(cfg_, n, name_);
        n_ = n;
        begin_ = 0;
        ts_ = custom_schedule() ? rounded_schedule_timesteps(n) : spaced_timesteps(cfg_, n, true);
        reset_injected_noise();
    }
    // The timestep after descending-list position k (-1 past the end: alpha_bar = final_alpha).
    static int64_t next_in(const std::vector<double>& desc, size_t k) {
        return k + 1 < desc.size() ? static_cast<int64_t>(desc[k + 1]) : -1;
    }

    SchedulerConfig cfg_;
    const char* name_;
    std::vector<float> abar_;
    std::vector<double> ts_;
    int n_ = 0;     // num_inference_steps
    int begin_ = 0; // first loop step (set_begin_index)
};

// The base of DDIM and DDPM: integer timesteps (set_discrete_timesteps), the unscaled sample as model input, and the
// timestep a step goes to.
class DiscreteAlphaBarScheduler : public SchedulerBase {
public:
    using SchedulerBase::SchedulerBase;
    void set_timesteps(int n) override { set_discrete_timesteps(n); }
    double init_noise_sigma() const override { return 1.0; }
    torch::Tensor scale_model_input(const torch::Tensor& x, int) const override { return x; }

protected:
    // diffusers' fixed stride on its own spacing; the next timestep of the list on a custom schedule (-1 past the
    // end).
    int64_t prev_timestep(int i) const {
        return custom_schedule() ? next_in(ts_, size_t(i))
                                 : static_cast<int64_t>(ts_[i]) - cfg_.num_train_timesteps / n_;
    }
};

// ---- sigma-space samplers share timesteps/sigmas and the input scaling -------------------------------------------
class SigmaScheduler : public SchedulerBase {
public:
    using SchedulerBase::SchedulerBase;
    std::vector<double> sigmas() const override { return std::vector<double>(sig_.begin(), sig_.end()); }
    // diffusers: sqrt(sigma_max^2 + 1) for 'leading', sigma_max for 'linspace'/'trailing'.
    double init_noise_sigma() const override {
        if (sig_.empty()) throw Error(std::string(name_) + ": set_timesteps was not called");
        const float m = *std::max_element(sig_.begin(), sig_.end());
        if (cfg_.timestep_spacing == TimestepSpacing::Linspace || cfg_.timestep_spacing == TimestepSpacing::Trailing)
            return m;
        return std::sqrt(m * m + 1.0f);
    }
    // x / sqrt(sigma^2 + 1): the VP-normalised input the UNet was trained on.
    torch::Tensor scale_model_input(const torch::Tensor& x, int i) const override {
        check_index(i);
        const float s = sig_[i];
        return x / double(std::sqrt(s * s + 1.0f));
    }
    torch::Tensor add_noise(const torch::Tensor& x0, const torch::Tensor& noise, int i) const override {
        check_index(i);
        return x0 + noise * double(sig_[i]);
    }

protected:
    // Float32 timesteps (spacing) and sigmas = interp(timesteps, arange(N), train_sigmas) ++ [0]; on a custom
    // schedule its sigmas (float32) and their fractional _sigma_to_t timesteps (float32, as diffusers' Euler with
    // use_karras_sigmas) ++ [0].
    void set_sigma_timesteps(int n) {
        check_num_steps(cfg_, n, name_);
        n_ = n;
        begin_ = 0;
        const auto full = train_sigmas(make_alphas_cumprod(cfg_));
        if (custom_schedule() && cfg_.karras_spaced_range && *cfg_.schedule == NoiseSchedule::Karras) {
            // diffusers' Euler / LMS set_timesteps with use_karras_sigmas: the spaced timesteps' sigmas
            // (np.interp, float64) give _convert_to_karras its range, sigma_max = the first one, sigma_min = the
            // last (unless the config sets them); the timesteps are _sigma_to_t of the Karras sigmas.
            const auto spaced = spaced_timesteps(cfg_, n, false);
            const double smax = cfg_.sigma_max.value_or(np_interp_index(spaced.front(), full));
            const double smin = cfg_.sigma_min.value_or(np_interp_index(spaced.back(), full));
            std::vector<float> log_sigmas(full.size());
            for (size_t k = 0; k < full.size(); ++k) log_sigmas[k] = std::log(full[k]);
            const auto levels = karras_sigmas(smin, smax, n);
            ts_.clear();
            sig_.clear();
            for (double sigma : levels) {
                ts_.push_back(double(static_cast<float>(sigma_to_t_f32(sigma, log_sigmas))));
                sig_.push_back(static_cast<float>(sigma));
            }
            sig_.push_back(0.0f);
            return;
        }
        if (custom_schedule()) {
            const auto lv = schedule_levels(*cfg_.schedule, cfg_, n);
            ts_.clear();
            sig_.clear();
            for (double t : lv.timesteps) ts_.push_back(double(static_cast<float>(t)));
            for (double s : lv.sigmas) sig_.push_back(static_cast<float>(s));
            sig_.push_back(0.0f);
            return;
        }
        ts_ = spaced_timesteps(cfg_, n, false);
        sig_.clear();
        for (double t : ts_) sig_.push_back(static_cast<float>(np_interp_index(t, full)));
        sig_.push_back(0.0f);
    }
    std::vector<float> sig_;
};

// ---- the DPM-Solver family: DPM-Solver++ 2M / 2M SDE / 2S, UniPC, DEIS ------------------------------------------
// diffusers' DPMSolverMultistep, DPMSolverSinglestep, UniPCMultistep and DEISMultistep schedulers share the schedule
// and the parameterisation: integer timesteps with DPM's own spacing, sigmas interpolated at them (float32) and one
// final sigma, the VP pair (alpha_t, sigma_t) of each sigma and its half log-SNR lambda = log alpha - log sigma
// (Lu et al. 2022a, sec. 3.1), the unscaled model input, init_noise_sigma 1, add_noise alpha x0 + sigma noise.

// The sigma after the last step: 0 (DPM-Solver final_sigmas_type 'zero'), sigma(t = 0) of the training schedule
// ('sigma_min'), or what UniPC / DEIS append: sigma(t = 0) on the default spacing but the schedule's last sigma again
// on a custom schedule (their use_karras_sigmas path), which makes the last step keep the sample.
enum class FinalSigma { Zero, TrainMin, ScheduleEnd };

class DpmFamilyScheduler : public SchedulerBase {
public:
    using SchedulerBase::SchedulerBase;
    std::vector<double> sigmas() const override { return std::vector<double>(sig_.begin(), sig_.end()); }
    double init_noise_sigma() const override { return 1.0; }
    torch::Tensor scale_model_input(const torch::Tensor& x, int) const override { return x; }
    torch::Tensor add_noise(const torch::Tensor& x0, const torch::Tensor& noise, int i) const override {
        check_index(i);
        const auto [alpha, sigma] = sigma_to_alpha_sigma(sig_[i]);
        return x0 * double(alpha) + noise * double(sigma);
    }

protected:
    // Timesteps of `spacing` as diffusers' DPM-Solver family spaces them ('leading' with step ratio N // (n + 1),
    // 'linspace' over n + 1 points less the last, 'trailing'), or on a custom schedule its sigmas with their
    // _sigma_to_t timesteps rounded half to even; then the final sigma. Resets the begin index and calls restart().
    void set_dpm_timesteps(int n, TimestepSpacing spacing, FinalSigma final_sigma);
    struct Lambda {
        float alpha, sigma, lambda;
    };
    // The VP pair and lambda of sigma index k (lambda through LibTorch's log, as diffusers' 0-dim tensors).
    Lambda lambda_at(int k) const {
        const auto [alpha, sigma] = sigma_to_alpha_sigma(sig_.at(size_t(k)));
        return {alpha, sigma, torch_log(alpha) - torch_log(sigma)};
    }
    // Data prediction x0 of the model output at sigma index i (Lu et al. 2022b eq. 9; v: Salimans & Ho 2022).
    torch::Tensor data_prediction(const torch::Tensor& out, const torch::Tensor& x, int i) const;
    // DPM-Solver++ first order (= DDIM), from sigma index s to t: x_t = (sigma_t / sigma_s) x - alpha_t (e^{-h} - 1)
    // x0, h = lambda_t - lambda_s (Lu et al. 2022b eq. 10 with k = 1).
    torch::Tensor dpmpp_first_order(const torch::Tensor& x0, const torch::Tensor& sample, int s, int t) const;
    // The model outputs the solver converted at the last steps (at most `keep`), for the multistep formulas;
    // recent(0) is the newest. restart() clears them with the order warm-up count and the step counter.
    void remember(const torch::Tensor& m, int keep) {
        history_.push_back(m);
        while (static_cast<int>(history_.size()) > keep) history_.pop_front();
    }
    const torch::Tensor& recent(int k) const { return history_.at(history_.size() - 1 - size_t(k)); }
    void restart() override {
        history_.clear();
        lower_order_nums_ = 0;
        step_index_ = begin_;
    }
    // The order of this step of a multistep solver of order `order` (diffusers' DPM-Solver / DEIS rule): first order
    // while there is no history yet or where `first_at_final`, at most second order with one earlier output or where
    // `second_at_final`. Counts the step into the warm-up.
    int multistep_order(int order, bool first_at_final, bool second_at_final) {
        int o = 3;
        if (order == 1 || lower_order_nums_ < 1 || first_at_final)
            o = 1;
        else if (order == 2 || lower_order_nums_ < 2 || second_at_final)
            o = 2;
        if (lower_order_nums_ < order) ++lower_order_nums_;
        return o;
    }
    // A solver order from the configuration (the class's default when unset), refused outside [1, max_order].
    int solver_order(int default_order, int max_order) const {
        const int o = cfg_.solver.solver_order.value_or(default_order);
        if (o < 1 || o > max_order)
            throw ParamError("solver_order", std::string(name_) + ": solver_order must be in [1, " +
                                                 std::to_string(max_order) + "], got " + std::to_string(o));
        return o;
    }

    std::vector<float> sig_;
    std::deque<torch::Tensor> history_;
    int lower_order_nums_ = 0; // steps taken so far, capped at the solver order (the warm-up of a multistep method)
    int step_index_ = 0;
};

// ---- two-evaluation samplers (Heun, KDPM2): each step's second model call is a loop step of its own ----------
// diffusers' torch.cat([v[:1], v[1:].repeat_interleave(2)]): the first value once, every later one twice.
template <class T> std::vector<T> repeat_after_first(const std::vector<T>& v) {
    std::vector<T> out;
    for (size_t k = 0; k < v.size(); ++k) {
        out.push_back(v[k]);
        if (k > 0) out.push_back(v[k]);
    }
    return out;
}

// ---- consistency-model samplers (LCM, TCD) -------------------------------------------------------------------------
// LCMScheduler / TCDScheduler's set_timesteps: n of the distillation schedule's timesteps (1..K) * (N / K) - 1,
// K = original_inference_steps, taken from the top at indices floor(linspace(0, K, n, endpoint=False)).
// ParamError("steps") when n > K; ParamError("schedule") for a schedule other than default (those samplers run on
// the timesteps they were distilled on).
std::vector<double> distilled_timesteps(const SchedulerConfig& cfg, int n, const char* who);

// The base of Heun / KDPM2 / KDPM2 ancestral: two loop steps per step, and a loop that starts on a step's first call.
class TwoCallScheduler : public SigmaScheduler {
public:
    using SigmaScheduler::SigmaScheduler;
    int order() const override { return 2; }
    // The corrector's step starts from the sample before the predictor's call.
    int earlier_outputs() const override { return 1; }
    std::vector<double> model_sigmas() const override { return std::vector<double>(in_.begin(), in_.end()); }
    torch::Tensor scale_model_input(const torch::Tensor& x, int i) const override {
        check_index(i);
        return x / double(std::sqrt(in_[size_t(i)] * in_[size_t(i)] + 1.0f));
    }
    void set_begin_index(int begin) override {
        if (begin % 2 != 0)
            throw Error(std::string(name_) + ": begin index " + std::to_string(begin) +
                        " is a step's second model call (two calls per step: the begin index is t_start * 2)");
        SigmaScheduler::set_begin_index(begin);
    }

protected:
    void restart() override {
        start_ = torch::Tensor();
        step_index_ = begin_;
    }
    // Loop step i's place in its step (checked in order, counted): the first call (predictor) runs from sig_[i]
    // toward sig_[i + 1]; the second call's step started at sig_[i - 1] and ends at sig_[i]. `k` is the step's index
    // into the per-step tables (i, or i - 1 on the second call).
    struct CallOf {
        bool first;
        size_t k;
        float sigma, sigma_next;
    };
    CallOf next_call(int i) {
        check_in_order(i, step_index_);
        ++step_index_;
        const bool first = !start_.defined();
        const size_t k = first ? size_t(i) : size_t(i - 1);
        return {first, k, sig_[k], sig_[k + 1]};
    }
    // log of the training sigmas in float32, for _sigma_to_t of the midpoints.
    std::vector<float> log_train_sigmas() const {
        const auto full = train_sigmas(make_alphas_cumprod(cfg_));
        std::vector<float> l(full.size());
        for (size_t k = 0; k < full.size(); ++k) l[k] = std::log(full[k]);
        return l;
    }
    std::vector<float> in_; // the model input's sigma of each loop step
    torch::Tensor start_;   // the sample at the step's first call; undefined: the next call is a first one
    int step_index_ = 0;
};

// The base of LCM / TCD: the distillation timesteps, an unscaled input, and the step's clean estimate.
class ConsistencyScheduler : public SchedulerBase {
public:
    using SchedulerBase::SchedulerBase;
    void set_timesteps(int n) override {
        ts_ = distilled_timesteps(cfg_, n, name_);
        n_ = n;
        begin_ = 0;
        denoised_ = torch::Tensor();
        reset_injected_noise();
    }
    double init_noise_sigma() const override { return 1.0; }
    torch::Tensor scale_model_input(const torch::Tensor& x, int) const override { return x; }
    torch::Tensor denoised() const override { return denoised_; }

protected:
    torch::Tensor denoised_;
};

// ---- one factory per sampler (its own file); eta is set for the samplers that take one (sampler_takes_eta) ------
std::unique_ptr<Scheduler> make_ddim(const SchedulerConfig& cfg, std::optional<double> eta);
std::unique_ptr<Scheduler> make_pndm(const SchedulerConfig& cfg, std::optional<double> eta);
std::unique_ptr<Scheduler> make_euler(const SchedulerConfig& cfg, std::optional<double> eta);
std::unique_ptr<Scheduler> make_euler_a(const SchedulerConfig& cfg, std::optional<double> eta);
std::unique_ptr<Scheduler> make_dpmpp_2m(const SchedulerConfig& cfg, std::optional<double> eta);
std::unique_ptr<Scheduler> make_lms(const SchedulerConfig& cfg, std::optional<double> eta);
std::unique_ptr<Scheduler> make_dpmpp_2m_sde(const SchedulerConfig& cfg, std::optional<double> eta);
std::unique_ptr<Scheduler> make_dpmpp_2s(const SchedulerConfig& cfg, std::optional<double> eta);
std::unique_ptr<Scheduler> make_unipc(const SchedulerConfig& cfg, std::optional<double> eta);
std::unique_ptr<Scheduler> make_deis(const SchedulerConfig& cfg, std::optional<double> eta);
std::unique_ptr<Scheduler> make_ddpm(const SchedulerConfig& cfg, std::optional<double> eta);
std::unique_ptr<Scheduler> make_heun(const SchedulerConfig& cfg, std::optional<double> eta);
std::unique_ptr<Scheduler> make_kdpm2(const SchedulerConfig& cfg, std::optional<double> eta);
std::unique_ptr<Scheduler> make_kdpm2_ancestral(const SchedulerConfig& cfg, std::optional<double> eta);
std::unique_ptr<Scheduler> make_lcm(const SchedulerConfig& cfg, std::optional<double> eta);
std::unique_ptr<Scheduler> make_tcd(const SchedulerConfig& cfg, std::optional<double> eta);
std::unique_ptr<Scheduler> make_flow_match_euler(const SchedulerConfig& cfg, std::optional<double> eta);

} // namespace anchor::unet::samplers
