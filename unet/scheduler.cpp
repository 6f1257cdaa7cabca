// Diffusion schedulers following diffusers 0.27.2 to float32 rounding (see tests/golden/sd/schedulers/README.md).
//
// Layout of this file:
//   1. schedule        - betas / alphas_cumprod / sigmas (float32, as diffusers), timestep spacings (numpy rules)
//   2. parameterisation - epsilon / v_prediction / sample -> x0 for the alpha-bar (VP) and sigma (VE) forms and
//                         the sigma <-> (alpha_t, sigma_t) map
//   3. samplers        - one small class per sampler holding only its own multistep state
//
// Scalar coefficients are computed in float (the schedulers hold float32 tensors, so diffusers' 0-dim tensor
// arithmetic is float32) and applied to the tensors in the same order as diffusers' expressions, which reproduces
// the goldens to the last bit or nearly so.
#include "unet/scheduler.h"

#include "cache/io/enum_table.h"
#include "cache/io/error.h"
#include "cache/io/json_config.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <deque>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

namespace anchor::unet {

// ================================================================================================================
// Names
// ================================================================================================================

const std::vector<std::pair<std::string, SamplerKind>>& sampler_table() {
    // clang-format off
    static const std::vector<std::pair<std::string, SamplerKind>> table = {
        {"ddim", SamplerKind::DDIM},
        {"pndm", SamplerKind::PNDM},
        {"euler", SamplerKind::Euler},
        {"euler_a", SamplerKind::EulerAncestral},
        {"dpmpp_2m", SamplerKind::DPMPP2M},
        {"dpmpp_2m_karras", SamplerKind::DPMPP2MKarras},
        {"lms", SamplerKind::LMS},
    };
    // clang-format on
    return table;
}

const EnumTable<BetaSchedule>& beta_schedule_table() {
    static const EnumTable<BetaSchedule> t = {{"scaled_linear", BetaSchedule::ScaledLinear},
                                              {"linear", BetaSchedule::Linear},
                                              {"squaredcos_cap_v2", BetaSchedule::SquaredCosCapV2}};
    return t;
}

const EnumTable<PredictionType>& prediction_type_table() {
    static const EnumTable<PredictionType> t = {{"epsilon", PredictionType::Epsilon},
                                                {"v_prediction", PredictionType::VPrediction},
                                                {"sample", PredictionType::Sample}};
    return t;
}

const EnumTable<TimestepSpacing>& timestep_spacing_table() {
    static const EnumTable<TimestepSpacing> t = {{"leading", TimestepSpacing::Leading},
                                                 {"trailing", TimestepSpacing::Trailing},
                                                 {"linspace", TimestepSpacing::Linspace}};
    return t;
}

const EnumTable<NoiseSchedule>& noise_schedule_table() {
    static const EnumTable<NoiseSchedule> t = {{"default", NoiseSchedule::Default},
                                               {"karras", NoiseSchedule::Karras},
                                               {"exponential", NoiseSchedule::Exponential},
                                               {"sgm_uniform", NoiseSchedule::SgmUniform},
                                               {"simple", NoiseSchedule::Simple}};
    return t;
}

std::string noise_schedule_name(NoiseSchedule s) {
    return enum_name(noise_schedule_table(), s);
}

std::string noise_schedule_label(NoiseSchedule s) {
    static const EnumTable<NoiseSchedule> labels = {{"Automatic", NoiseSchedule::Default},
                                                    {"Karras", NoiseSchedule::Karras},
                                                    {"Exponential", NoiseSchedule::Exponential},
                                                    {"SGM Uniform", NoiseSchedule::SgmUniform},
                                                    {"Simple", NoiseSchedule::Simple}};
    return enum_name(labels, s);
}

SamplerKind sampler_from_string(const std::string& s) {
    return enum_from_string(sampler_table(), s, "sampler");
}

std::string sampler_name(SamplerKind k) {
    return enum_name(sampler_table(), k);
}

SamplerKind sampler_from_class_name(const std::string& cls, bool use_karras_sigmas) {
    if (cls == "DDIMScheduler") return SamplerKind::DDIM;
    if (cls == "PNDMScheduler") return SamplerKind::PNDM;
    if (cls == "EulerDiscreteScheduler") return SamplerKind::Euler;
    if (cls == "EulerAncestralDiscreteScheduler") return SamplerKind::EulerAncestral;
    if (cls == "DPMSolverMultistepScheduler")
        return use_karras_sigmas ? SamplerKind::DPMPP2MKarras : SamplerKind::DPMPP2M;
    if (cls == "LMSDiscreteScheduler") return SamplerKind::LMS;
    throw Error("unsupported scheduler class '" + cls +
                "' (supported: DDIMScheduler, PNDMScheduler, EulerDiscreteScheduler, "
                "EulerAncestralDiscreteScheduler, DPMSolverMultistepScheduler, LMSDiscreteScheduler)");
}

std::vector<std::string> unsupported_scheduler_settings(const std::string& json_text, SamplerKind kind) {
    const auto j = nlohmann::json::parse(json_text);
    const bool dpm = kind == SamplerKind::DPMPP2M || kind == SamplerKind::DPMPP2MKarras;
    // Read by SchedulerConfig, or inert unless a switch below enables them (thresholding's ratio and range, the
    // clipping range of clip_sample, which DDIM implements).
    static const std::set<std::string> known = {
        "_class_name",      "_diffusers_version", "num_train_timesteps", "beta_start",          "beta_end",
        "beta_schedule",    "trained_betas",      "steps_offset",        "set_alpha_to_one",    "clip_sample",
        "prediction_type",  "timestep_spacing",   "use_karras_sigmas",   "sigma_min",           "sigma_max",
        "skip_prk_steps",   "clip_sample_range",  "sample_max_value",    "dynamic_thresholding_ratio"};
    // Behaviour-changing keys: the one value implemented, for the samplers whose diffusers class has the key.
    struct Rule {
        const char* key;
        nlohmann::json value; // the supported value (null: only null)
        bool applies;
    };
    const std::vector<Rule> rules = {
        {"thresholding", false, true},
        {"rescale_betas_zero_snr", false, true},
        {"skip_prk_steps", true, kind == SamplerKind::PNDM},
        {"interpolation_type", "linear", kind == SamplerKind::Euler},
        {"timestep_type", "discrete", kind == SamplerKind::Euler},
        {"algorithm_type", "dpmsolver++", dpm},
        {"solver_order", 2, dpm},
        {"solver_type", "midpoint", dpm},
        {"lower_order_final", true, dpm},
        {"euler_at_final", false, dpm},
        {"use_lu_lambdas", false, dpm},
        {"final_sigmas_type", "zero", dpm},
        {"lambda_min_clipped", "-inf", dpm},
        {"variance_type", nullptr, dpm},
    };
    std::vector<std::string> out;
    auto same = [](const nlohmann::json& v, const nlohmann::json& want) {
        if (v == want) return true;
        // JSON has no -inf: diffusers writes lambda_min_clipped as the string "-inf"; a number must be -inf too.
        if (want == "-inf" && v.is_number()) return std::isinf(v.get<double>()) && v.get<double>() < 0;
        if (want.is_number() && v.is_number()) return v.get<double>() == want.get<double>();
        return false;
    };
    std::set<std::string> ruled;
    for (const auto& r : rules) {
        ruled.insert(r.key);
        if (!r.applies || !j.contains(r.key)) continue;
        const auto& v = j[r.key];
        if (v.is_null() && !r.value.is_boolean()) continue; // null = the class default
        if (!same(v, r.value))
            out.push_back(std::string(r.key) + " = " + v.dump() + " (only " + r.value.dump() + " is implemented for " +
                          sampler_name(kind) + ")");
    }
    for (const auto& [k, v] : j.items()) {
        if (known.count(k) || ruled.count(k)) continue;
        const bool inert = v.is_null() || (v.is_boolean() && !v.get<bool>()) || (v.is_array() && v.empty());
        if (!inert) out.push_back(k + " = " + v.dump() + " (a key this engine does not know)");
    }
    return out;
}

SchedulerConfig SchedulerConfig::from_json_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw Error("cannot open scheduler config '" + path + "'");
    std::ostringstream ss;
    ss << in.rdbuf();
    return from_json_text(ss.str(), path);
}

SchedulerConfig SchedulerConfig::from_json_text(const std::string& text, const std::string& path) {
    const auto j = JsonConfig::parse(text, path);
    SchedulerConfig c;
    c.num_train_timesteps = j.get_int("num_train_timesteps", c.num_train_timesteps);
    c.beta_start = j.get_double("beta_start", c.beta_start);
    c.beta_end = j.get_double("beta_end", c.beta_end);
    c.beta_schedule = j.get_enum("beta_schedule", beta_schedule_table(), c.beta_schedule);
    c.steps_offset = j.get_int("steps_offset", c.steps_offset);
    c.set_alpha_to_one = j.get_bool("set_alpha_to_one", c.set_alpha_to_one);
    c.clip_sample = j.get_bool("clip_sample", c.clip_sample);
    c.prediction_type = j.get_enum("prediction_type", prediction_type_table(), c.prediction_type);
    c.timestep_spacing = j.get_enum("timestep_spacing", timestep_spacing_table(), c.timestep_spacing);
    c.class_name = j.get_string("_class_name", c.class_name);
    c.use_karras_sigmas = j.get_bool("use_karras_sigmas", c.use_karras_sigmas);
    if (j.has("sigma_min")) c.sigma_min = j.get_double("sigma_min", 0.0);
    if (j.has("sigma_max")) c.sigma_max = j.get_double("sigma_max", 0.0);
    j.reject("trained_betas", "the betas come from beta_schedule");
    if (c.num_train_timesteps < 2) j.fail("num_train_timesteps", "must be >= 2", j.json().at("num_train_timesteps"));
    return c;
}

// ================================================================================================================
// 1. Schedule
// ================================================================================================================

torch::Tensor make_betas(const SchedulerConfig& cfg) {
    const int64_t n = cfg.num_train_timesteps;
    const auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
    if (cfg.beta_schedule == BetaSchedule::ScaledLinear)
        return torch::linspace(std::sqrt(cfg.beta_start), std::sqrt(cfg.beta_end), n, f32).pow(2);
    if (cfg.beta_schedule == BetaSchedule::Linear) return torch::linspace(cfg.beta_start, cfg.beta_end, n, f32);
    if (cfg.beta_schedule == BetaSchedule::SquaredCosCapV2) {
        // Improved DDPM (Nichol & Dhariwal 2021) eq. 17: alpha_bar(t) = cos((t + s) / (1 + s) * pi / 2)^2, s = 0.008.
        auto alpha_bar = [](double t) { return std::pow(std::cos((t + 0.008) / 1.008 * M_PI / 2), 2); };
        std::vector<float> b(n);
        for (int64_t i = 0; i < n; ++i) {
            const double t1 = double(i) / n, t2 = double(i + 1) / n;
            b[i] = static_cast<float>(std::min(1 - alpha_bar(t2) / alpha_bar(t1), 0.999));
        }
        return torch::tensor(b, f32);
    }
    throw Error("unknown beta schedule");
}

torch::Tensor make_alphas_cumprod(const SchedulerConfig& cfg) {
    return torch::cumprod(1 - make_betas(cfg), 0);
}

namespace {

std::vector<float> to_floats(const torch::Tensor& t) {
    auto c = t.to(torch::kFloat32).contiguous();
    return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

// Karras/EDM sigmas of the training schedule: sigma_t = sqrt((1 - abar_t) / abar_t), float32 like diffusers.
std::vector<float> train_sigmas(const torch::Tensor& alphas_cumprod) {
    return to_floats(((1 - alphas_cumprod) / alphas_cumprod).pow(0.5));
}

// numpy.arange(start, stop, step) for a negative float step: length ceil((stop - start) / step).
std::vector<double> np_arange_down(double start, double stop, double step) {
    const auto len = static_cast<int64_t>(std::ceil((stop - start) / step));
    std::vector<double> v;
    for (int64_t i = 0; i < len; ++i) v.push_back(start + double(i) * step);
    return v;
}

// numpy.linspace(start, stop, num) in float64 (endpoint forced to `stop`).
std::vector<double> np_linspace(double start, double stop, int num) {
    std::vector<double> v(num);
    if (num == 1) {
        v[0] = start;
        return v;
    }
    const double step = (stop - start) / (num - 1);
    for (int i = 0; i < num; ++i) v[i] = double(i) * step + start;
    v[num - 1] = stop;
    return v;
}

// Half to even, as numpy.round.
double np_round(double x) {
    return std::nearbyint(x);
}

// numpy.interp(x, arange(len(fp)), fp) in float64.
double np_interp_index(double x, const std::vector<float>& fp) {
    const int64_t n = static_cast<int64_t>(fp.size());
    if (x <= 0) return fp[0];
    if (x >= double(n - 1)) return fp[n - 1];
    const auto j = static_cast<int64_t>(std::floor(x));
    const double slope = double(fp[j + 1]) - double(fp[j]);
    return slope * (x - double(j)) + double(fp[j]);
}

// diffusers' _sigma_to_t, numpy-exact: piecewise-linear interpolation of t over log sigma (log_sigmas float32 as
// numpy's np.log of the float32 sigmas, sigma itself float64).
double sigma_to_t(double sigma, const std::vector<float>& log_sigmas) {
    const double log_sigma = std::log(std::max(sigma, 1e-10));
    const int64_t n = static_cast<int64_t>(log_sigmas.size());
    int64_t low = 0;
    for (int64_t k = 0; k < n; ++k)
        if (log_sigma - double(log_sigmas[k]) >= 0) low = k; // argmax of the cumulative count = last such k
    low = std::min(low, n - 2);
    const float lo = log_sigmas[low], hi = log_sigmas[low + 1];
    double w = (double(lo) - log_sigma) / double(lo - hi); // (low - high) is a float32 difference in numpy
    w = std::clamp(w, 0.0, 1.0);
    return (1 - w) * double(low) + w * double(low + 1);
}

// diffusers' EulerDiscreteScheduler._sigma_to_t as numpy < 2 evaluates it for one float64 sigma against the float32
// log_sigmas: value-based casting turns every array expression into float32 (log sigma rounded to float32 for the
// distances and the weight w = (low - log sigma) / (low - high)); only t = (1 - w) low + w high is float64.
double sigma_to_t_f32(double sigma, const std::vector<float>& log_sigmas) {
    const auto l = static_cast<float>(std::log(std::max(sigma, 1e-10)));
    const int64_t n = static_cast<int64_t>(log_sigmas.size());
    int64_t low = 0;
    for (int64_t k = 0; k < n; ++k)
        if (l - log_sigmas[k] >= 0.0f) low = k;
    low = std::min(low, n - 2);
    float w = (log_sigmas[low] - l) / (log_sigmas[low] - log_sigmas[low + 1]);
    w = std::clamp(w, 0.0f, 1.0f);
    return double(1.0f - w) * double(low) + double(w) * double(low + 1);
}

// Karras et al. 2022 eq. 5, rho = 7 (the paper's value): n sigmas from sigma_max down to sigma_min, in float64 as
// diffusers' _convert_to_karras.
std::vector<double> karras_sigmas(double sigma_min, double sigma_max, int n) {
    const double rho = 7.0, min_inv = std::pow(sigma_min, 1 / rho), max_inv = std::pow(sigma_max, 1 / rho);
    std::vector<double> out;
    for (double r : np_linspace(0, 1, n)) out.push_back(std::pow(max_inv + r * (min_inv - max_inv), rho));
    return out;
}

void check_num_steps(const SchedulerConfig& cfg, int n, const char* who) {
    if (n < 1 || n > cfg.num_train_timesteps)
        throw ParamError("steps", std::string(who) + ": num_inference_steps must be in [1, " +
                                      std::to_string(cfg.num_train_timesteps) + "], got " + std::to_string(n));
}

[[noreturn]] void bad_spacing(const SchedulerConfig&) {
    throw Error("unknown timestep spacing"); // the enum has no other value
}

// Descending discrete timesteps shared by DDIM / PNDM (PNDM keeps them ascending) / Euler / LMS (as float):
//   leading:  (arange(n) * (N // n))[::-1] + steps_offset
//   trailing: round(arange(N, 0, -N / n)) - 1
//   linspace: round(linspace(0, N - 1, n))[::-1]   (Euler/LMS keep the unrounded float32 values: `rounded` false)
std::vector<double> spaced_timesteps(const SchedulerConfig& cfg, int n, bool rounded_linspace) {
    const int N = cfg.num_train_timesteps;
    std::vector<double> t;
    if (cfg.timestep_spacing == TimestepSpacing::Leading) {
        const int ratio = N / n;
        for (int i = n - 1; i >= 0; --i) t.push_back(double(i * ratio + cfg.steps_offset));
    } else if (cfg.timestep_spacing == TimestepSpacing::Trailing) {
        for (double v : np_arange_down(N, 0, -double(N) / n)) t.push_back(np_round(v) - 1);
    } else if (cfg.timestep_spacing == TimestepSpacing::Linspace) {
        auto v = np_linspace(0, N - 1, n);
        for (int i = n - 1; i >= 0; --i)
            t.push_back(rounded_linspace ? np_round(v[i]) : double(static_cast<float>(v[i])));
    } else {
        bad_spacing(cfg);
    }
    for (double x : t)
        if (x < 0 || x > N - 1)
            throw ParamError("steps", "timestep spacing '" + enum_name(timestep_spacing_table(), cfg.timestep_spacing) +
                                          "' with " + std::to_string(n) + " steps gives timestep " + std::to_string(x) +
                                          " outside [0, " + std::to_string(N - 1) + "]");
    return t;
}

} // namespace

// ================================================================================================================
// 2. Parameterisation
// ================================================================================================================

X0Eps vp_predict(PredictionType type, const torch::Tensor& out, const torch::Tensor& x, float abar) {
    const float beta = 1.0f - abar;
    const double sa = std::sqrt(abar), sb = std::sqrt(beta);
    if (type == PredictionType::Epsilon) return {(x - sb * out) / sa, out};
    if (type == PredictionType::VPrediction) return {sa * x - sb * out, sa * out + sb * x};
    auto x0 = out; // "sample"
    return {x0, (x - sa * x0) / sb};
}

torch::Tensor vp_output(PredictionType type, const torch::Tensor& x0, const torch::Tensor& x, float abar) {
    if (type == PredictionType::Sample) return x0;
    const double sa = std::sqrt(abar), sb = std::sqrt(1.0f - abar);
    const auto eps = (x - sa * x0) / sb;
    return type == PredictionType::Epsilon ? eps : sa * eps - sb * x0;
}

namespace {

// VE/EDM form x = x0 + sigma eps on the scaled input x / sqrt(sigma^2 + 1) (Karras et al. 2022, table 1).
torch::Tensor ve_x0(PredictionType type, const torch::Tensor& out, const torch::Tensor& x, float sigma_hat,
                    float sigma) {
    if (type == PredictionType::Epsilon) return x - double(sigma_hat) * out;
    if (type == PredictionType::VPrediction) {
        const float s2p1 = sigma * sigma + 1.0f;
        return out * double(-sigma / std::sqrt(s2p1)) + x / double(s2p1);
    }
    return out; // "sample"
}

// sigma (VE) -> (alpha_t, sigma_t) of the VP process: alpha_t = 1 / sqrt(sigma^2 + 1), sigma_t = sigma * alpha_t.
struct AlphaSigma {
    float alpha, sigma;
};
AlphaSigma sigma_to_alpha_sigma(float sigma) {
    const float alpha = 1.0f / std::sqrt(sigma * sigma + 1.0f);
    return {alpha, sigma * alpha};
}

// log / exp of a float32 scalar through LibTorch's own kernels: diffusers evaluates these on 0-dim float32 tensors,
// whose vectorised (Sleef) results can differ from libm's by an ulp.
float torch_log(float v) {
    return torch::log(torch::scalar_tensor(v, torch::kFloat32)).item<float>();
}
float torch_exp(float v) {
    return torch::exp(torch::scalar_tensor(v, torch::kFloat32)).item<float>();
}

// Noise of model_output's shape from `gen` (drawn on the generator's device, then moved), like diffusers' randn_tensor.
torch::Tensor draw_noise(const torch::Tensor& like, torch::Generator* gen) {
    if (!gen) return torch::randn(like.sizes(), like.options());
    auto opts = like.options().device(gen->device());
    return torch::randn(like.sizes(), *gen, opts).to(like.device());
}

// ================================================================================================================
// 3. Samplers
// ================================================================================================================

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

// ---- DDIM (Song et al. 2021, eq. 12) ----------------------------------------------------------------------------
class DdimScheduler final : public SchedulerBase {
public:
    DdimScheduler(const SchedulerConfig& cfg, double eta) : SchedulerBase(cfg, "DDIM"), eta_(eta) {
        final_alpha_ = cfg_.set_alpha_to_one ? 1.0f : abar_[0];
    }
    void set_timesteps(int n) override {
        check_num_steps(cfg_, n, "DDIM");
        n_ = n;
        begin_ = 0;
        ts_ = custom_schedule() ? rounded_schedule_timesteps(n) : spaced_timesteps(cfg_, n, true);
        reset_injected_noise();
    }
    double init_noise_sigma() const override { return 1.0; }
    torch::Tensor scale_model_input(const torch::Tensor& x, int) const override { return x; }
    torch::Tensor step(const torch::Tensor& out, int i, const torch::Tensor& x, torch::Generator* gen) override {
        check_index(i);
        const auto t = static_cast<int64_t>(ts_[i]);
        // diffusers' fixed stride on its own spacing; the next timestep of the list on a custom schedule.
        const int64_t prev = custom_schedule() ? next_in(ts_, size_t(i)) : t - cfg_.num_train_timesteps / n_;
        const float a_t = abar_at(t, final_alpha_), a_prev = abar_at(prev, final_alpha_);
        const float b_t = 1.0f - a_t, b_prev = 1.0f - a_prev;
        auto [x0, eps] = vp_predict(cfg_.prediction_type, out, x, a_t);
        if (cfg_.clip_sample) {
            x0 = x0.clamp(-1.0, 1.0);
            eps = (x - double(std::sqrt(a_t)) * x0) / double(std::sqrt(b_t));
        }
        // sigma_t(eta) = eta * sqrt((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev))   (eq. 16)
        const float variance = (b_prev / b_t) * (1.0f - a_t / a_prev);
        const float std_dev = static_cast<float>(eta_) * std::sqrt(variance);
        auto direction = double(std::sqrt(1.0f - a_prev - std_dev * std_dev)) * eps;
        auto prev_sample = double(std::sqrt(a_prev)) * x0 + direction;
        if (eta_ > 0) {
            const auto fresh = double(std_dev) * draw_noise(out, gen);
            prev_sample = prev_sample + fresh;
            carry_injected_noise(std::sqrt(1.0f - a_prev - std_dev * std_dev) / std::sqrt(b_t), fresh);
        }
        return prev_sample;
    }

private:
    double eta_;
    float final_alpha_;
};

// ---- PNDM with skip_prk_steps: PLMS (Liu et al. 2022, eq. 12 + the linear multistep of sec. 4) ----------------
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

// ---- Euler (Karras et al. 2022, algorithm 2 with s_churn = 0) --------------------------------------------------
class EulerScheduler final : public SigmaScheduler {
public:
    explicit EulerScheduler(const SchedulerConfig& cfg) : SigmaScheduler(cfg, "Euler") {}
    void set_timesteps(int n) override { set_sigma_timesteps(n); }
    torch::Tensor step(const torch::Tensor& out, int i, const torch::Tensor& x, torch::Generator* gen) override {
        check_index(i);
        const float sigma = sig_[i];
        // diffusers draws the churn noise even when gamma = 0 and discards it; drawing keeps generator streams equal.
        (void)draw_noise(out, gen);
        const float sigma_hat = sigma; // gamma = 0
        auto sample = x.to(torch::kFloat32);
        auto x0 = ve_x0(cfg_.prediction_type, out, sample, sigma_hat, sigma);
        auto derivative = (sample - x0) / double(sigma_hat); // d = (x - D(x)) / sigma
        const float dt = sig_[i + 1] - sigma_hat;
        return (sample + derivative * double(dt)).to(out.scalar_type());
    }
};

// ---- Euler ancestral (k-diffusion sample_euler_ancestral) --------------------------------------------------------
class EulerAncestralScheduler final : public SigmaScheduler {
public:
    EulerAncestralScheduler(const SchedulerConfig& cfg, double eta)
        : SigmaScheduler(cfg, "EulerAncestral"), eta_(static_cast<float>(eta)) {}
    void set_timesteps(int n) override {
        set_sigma_timesteps(n);
        reset_injected_noise();
    }
    torch::Tensor step(const torch::Tensor& out, int i, const torch::Tensor& x, torch::Generator* gen) override {
        check_index(i);
        const float sigma = sig_[i];
        auto sample = x.to(torch::kFloat32);
        auto x0 = ve_x0(cfg_.prediction_type, out, sample, sigma, sigma);
        // Split the step to sigma_to into a deterministic part down to sigma_down and fresh noise of sigma_up
        // (k-diffusion get_ancestral_step): sigma_up = min(s_to, eta sqrt(s_to^2 (s_from^2 - s_to^2) / s_from^2)),
        // sigma_down = sqrt(s_to^2 - sigma_up^2). eta = 1 is diffusers' EulerAncestralDiscreteScheduler; eta = 0
        // leaves the Euler step (the noise is still drawn, scaled by 0, so generator streams stay aligned).
        const float s_from = sig_[i], s_to = sig_[i + 1];
        const float sigma_up =
            std::min(s_to, eta_ * std::sqrt(s_to * s_to * (s_from * s_from - s_to * s_to) / (s_from * s_from)));
        const float sigma_down = std::sqrt(s_to * s_to - sigma_up * sigma_up);
        auto derivative = (sample - x0) / double(sigma);
        const float dt = sigma_down - sigma;
        auto prev_sample = sample + derivative * double(dt);
        const auto fresh = draw_noise(out, gen) * double(sigma_up);
        prev_sample = prev_sample + fresh;
        if (sigma_up > 0) carry_injected_noise(double(sigma_down) / double(sigma), fresh);
        return prev_sample.to(out.scalar_type());
    }

private:
    float eta_;
};

// ---- LMS (linear multistep in sigma, order 4) ------------------------------------------------------------------
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

// ---- DPM-Solver++(2M) (Lu et al. 2022b, algorithm 2; midpoint variant as diffusers) ---------------------------
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

NoiseSchedule effective_schedule(SamplerKind kind, const SchedulerConfig& cfg) {
    if (kind == SamplerKind::DPMPP2MKarras) {
        if (cfg.schedule && *cfg.schedule != NoiseSchedule::Karras)
            throw ParamError("schedule", "sampler dpmpp_2m_karras is dpmpp_2m with the karras schedule, not '" +
                                             noise_schedule_name(*cfg.schedule) + "' (use sampler dpmpp_2m with " +
                                             "schedule " + noise_schedule_name(*cfg.schedule) + ")");
        return NoiseSchedule::Karras;
    }
    if (cfg.schedule) return *cfg.schedule;
    return cfg.use_karras_sigmas ? NoiseSchedule::Karras : NoiseSchedule::Default;
}

bool sampler_takes_eta(SamplerKind kind) {
    return kind == SamplerKind::DDIM || kind == SamplerKind::EulerAncestral;
}

std::optional<double> effective_eta(SamplerKind kind, std::optional<double> eta) {
    if (!sampler_takes_eta(kind)) {
        if (eta)
            throw ParamError("eta", "sampler " + sampler_name(kind) +
                                        " has no noise term; eta applies to ddim and euler_a only");
        return std::nullopt;
    }
    if (eta && !(std::isfinite(*eta) && *eta >= 0))
        throw ParamError("eta", "must be a finite number >= 0, got " + std::to_string(*eta));
    return eta.value_or(kind == SamplerKind::EulerAncestral ? 1.0 : 0.0);
}

ScheduleLevels schedule_levels(NoiseSchedule s, const SchedulerConfig& cfg, int n) {
    check_num_steps(cfg, n, "schedule");
    const auto full = train_sigmas(make_alphas_cumprod(cfg)); // sigma(t), t = 0 .. N-1, ascending
    std::vector<float> log_sigmas(full.size());
    for (size_t k = 0; k < full.size(); ++k) log_sigmas[k] = std::log(full[k]);
    const int N = static_cast<int>(full.size());
    const double sigma_min = full.front(), sigma_max = full.back();
    ScheduleLevels out;
    if (s == NoiseSchedule::Karras) {
        out.sigmas = karras_sigmas(sigma_min, sigma_max, n);
    } else if (s == NoiseSchedule::Exponential) {
        // Equal steps in log sigma (k-diffusion get_sigmas_exponential), float64.
        for (double l : np_linspace(std::log(sigma_max), std::log(sigma_min), n)) out.sigmas.push_back(std::exp(l));
    } else if (s == NoiseSchedule::SgmUniform) {
        // ComfyUI normal_scheduler(sgm=True): n of n + 1 equal timesteps from N-1 down to 0 (the 0 dropped), sigma by
        // linear interpolation of log sigma between the neighbouring training timesteps (ModelSamplingDiscrete.sigma).
        for (int k = 0; k < n; ++k) {
            const double t = double(N - 1) - double(k) * double(N - 1) / double(n);
            const auto lo = static_cast<int64_t>(std::floor(t));
            const auto hi = std::min<int64_t>(lo + 1, N - 1);
            const double w = t - double(lo);
            out.sigmas.push_back(std::exp((1 - w) * double(log_sigmas[lo]) + w * double(log_sigmas[hi])));
        }
    } else if (s == NoiseSchedule::Simple) {
        // ComfyUI simple_scheduler: the training sigmas from the end in strides of N / n (float), truncated.
        const double stride = double(N) / double(n);
        for (int k = 0; k < n; ++k) out.sigmas.push_back(full[size_t(N - 1 - static_cast<int64_t>(k * stride))]);
    } else {
        throw Error("schedule_levels: the default schedule is each sampler's own timestep spacing");
    }
    for (double sigma : out.sigmas) out.timesteps.push_back(sigma_to_t(sigma, log_sigmas));
    return out;
}

std::unique_ptr<Scheduler> make_scheduler(SamplerKind kind, const SchedulerConfig& cfg_in,
                                          std::optional<double> eta_in) {
    SchedulerConfig cfg = cfg_in;
    cfg.schedule = effective_schedule(kind, cfg_in);
    // A scheduler config's use_karras_sigmas (no schedule given) means diffusers' Karras of that class: Euler and LMS
    // convert their spaced sigmas; DPM-Solver the model's, as --schedule karras does for every sampler.
    cfg.karras_spaced_range =
        !cfg_in.schedule && cfg_in.use_karras_sigmas && (kind == SamplerKind::Euler || kind == SamplerKind::LMS);
    const auto eta = effective_eta(kind, eta_in);
    switch (kind) {
    case SamplerKind::DDIM:
        return std::make_unique<DdimScheduler>(cfg, *eta);
    case SamplerKind::PNDM:
        return std::make_unique<PndmScheduler>(cfg);
    case SamplerKind::Euler:
        return std::make_unique<EulerScheduler>(cfg);
    case SamplerKind::EulerAncestral:
        return std::make_unique<EulerAncestralScheduler>(cfg, *eta);
    case SamplerKind::DPMPP2M:
    case SamplerKind::DPMPP2MKarras:
        return std::make_unique<DpmSolverScheduler>(cfg);
    case SamplerKind::LMS:
        return std::make_unique<LmsScheduler>(cfg);
    }
    throw Error("make_scheduler: invalid SamplerKind");
}

} // namespace anchor::unet
