// Diffusion schedulers following diffusers 0.27.2 to float32 rounding (see tests/golden/sd/schedulers/README.md).
//
// The common part of the schedulers:
//   1. schedule        - betas / alphas_cumprod / sigmas (float32, as diffusers), timestep spacings (numpy rules)
//   2. parameterisation - epsilon / v_prediction / sample -> x0 for the alpha-bar (VP) and sigma (VE) forms and
//                         the sigma <-> (alpha_t, sigma_t) map
//   3. the factory     - one row per sampler; each sampler is one file in unet/samplers/ (sampler_base.h)
#include "unet/samplers/scheduler.h"

#include "unet/samplers/sampler_base.h"

#include "cache/io/enum_table.h"
#include "cache/io/error.h"
#include "cache/io/read_file.h"
#include "cache/io/json_config.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
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
        {"dpmpp_2m_sde", SamplerKind::DPMPP2MSDE},
        {"dpmpp_2s", SamplerKind::DPMPP2S},
        {"unipc", SamplerKind::UniPC},
        {"deis", SamplerKind::DEIS},
        {"ddpm", SamplerKind::DDPM},
        {"heun", SamplerKind::Heun},
        {"dpm2", SamplerKind::KDPM2},
        {"dpm2_a", SamplerKind::KDPM2Ancestral},
        {"lcm", SamplerKind::LCM},
        {"tcd", SamplerKind::TCD},
        {"flow_match_euler", SamplerKind::FlowMatchEuler},
    };
    // clang-format on
    return table;
}

const EnumTable<SamplerKind>& sampler_alias_table() {
    // stable-diffusion.cpp's sample_method names (its "euler", "euler_a", "heun", "dpm2", "lcm", "tcd" are ours
    // already) and ComfyUI's KSampler names.
    // clang-format off
    static const EnumTable<SamplerKind> table = {
        {"dpm++2m", SamplerKind::DPMPP2M},
        {"dpmpp_2m_k", SamplerKind::DPMPP2MKarras},
        {"k_lms", SamplerKind::LMS},
        {"plms", SamplerKind::PNDM},
        {"euler_ancestral", SamplerKind::EulerAncestral},
        {"k_euler", SamplerKind::Euler},
        {"k_euler_a", SamplerKind::EulerAncestral},
        {"dpm_2", SamplerKind::KDPM2},
        {"k_dpm_2", SamplerKind::KDPM2},
        {"dpm_2_ancestral", SamplerKind::KDPM2Ancestral},
        {"k_dpm_2_a", SamplerKind::KDPM2Ancestral},
        {"dpm2a", SamplerKind::KDPM2Ancestral},
        {"k_heun", SamplerKind::Heun},
        {"uni_pc", SamplerKind::UniPC},
        {"k_dpmpp_2m_sde", SamplerKind::DPMPP2MSDE},
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

const EnumTable<SolverType>& solver_type_table() {
    static const EnumTable<SolverType> t = {{"midpoint", SolverType::Midpoint},
                                            {"heun", SolverType::Heun},
                                            {"bh1", SolverType::Bh1},
                                            {"bh2", SolverType::Bh2},
                                            {"logrho", SolverType::LogRho}};
    return t;
}

const EnumTable<FinalSigmasType>& final_sigmas_type_table() {
    static const EnumTable<FinalSigmasType> t = {{"zero", FinalSigmasType::Zero},
                                                 {"sigma_min", FinalSigmasType::SigmaMin}};
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
    for (const auto& [name, kind] : sampler_alias_table())
        if (name == s) return kind;
    return enum_from_string(sampler_table(), s, "sampler");
}

std::string sampler_name(SamplerKind k) {
    return enum_name(sampler_table(), k);
}

namespace {

// One row per sampler: the diffusers class it follows (with its use_karras_sigmas switch where that names another
// sampler), its default eta (samplers with a noise term), whether diffusers' Karras of that class converts its own
// spaced sigmas (Euler, LMS) rather than the model's, and its factory (its file in unet/samplers/).
struct SamplerRow {
    SamplerKind kind;
    const char* diffusers_class;
    bool karras;
    std::optional<double> default_eta;
    bool karras_spaced_range;
    std::unique_ptr<Scheduler> (*make)(const SchedulerConfig&, std::optional<double>);
    // The class's algorithm_type this row runs, where the class has several behind different samplers (nullptr: the
    // class's plain row).
    const char* algorithm_type = nullptr;
};

const std::vector<SamplerRow>& sampler_rows() {
    // clang-format off
    static const std::vector<SamplerRow> rows = {
        {SamplerKind::DDIM,           "DDIMScheduler",                   false, 0.0,          false, samplers::make_ddim},
        {SamplerKind::PNDM,           "PNDMScheduler",                   false, std::nullopt, false, samplers::make_pndm},
        {SamplerKind::Euler,          "EulerDiscreteScheduler",          false, std::nullopt, true,  samplers::make_euler},
        {SamplerKind::EulerAncestral, "EulerAncestralDiscreteScheduler", false, 1.0,          false, samplers::make_euler_a},
        {SamplerKind::DPMPP2M,        "DPMSolverMultistepScheduler",     false, std::nullopt, false, samplers::make_dpmpp_2m},
        {SamplerKind::DPMPP2MKarras,  "DPMSolverMultistepScheduler",     true,  std::nullopt, false, samplers::make_dpmpp_2m},
        {SamplerKind::LMS,            "LMSDiscreteScheduler",            false, std::nullopt, true,  samplers::make_lms},
        {SamplerKind::DPMPP2MSDE,     "DPMSolverMultistepScheduler",     false, std::nullopt, false, samplers::make_dpmpp_2m_sde, "sde-dpmsolver++"},
        {SamplerKind::DPMPP2S,        "DPMSolverSinglestepScheduler",    false, std::nullopt, false, samplers::make_dpmpp_2s},
        {SamplerKind::UniPC,          "UniPCMultistepScheduler",         false, std::nullopt, false, samplers::make_unipc},
        {SamplerKind::DEIS,           "DEISMultistepScheduler",          false, std::nullopt, false, samplers::make_deis},
        {SamplerKind::DDPM,           "DDPMScheduler",                   false, std::nullopt, false, samplers::make_ddpm},
        {SamplerKind::Heun,           "HeunDiscreteScheduler",           false, std::nullopt, true,  samplers::make_heun},
        {SamplerKind::KDPM2,          "KDPM2DiscreteScheduler",          false, std::nullopt, true,  samplers::make_kdpm2},
        {SamplerKind::KDPM2Ancestral, "KDPM2AncestralDiscreteScheduler", false, std::nullopt, true,  samplers::make_kdpm2_ancestral},
        {SamplerKind::LCM,            "LCMScheduler",                    false, std::nullopt, false, samplers::make_lcm},
        {SamplerKind::TCD,            "TCDScheduler",                    false, 0.3,          false, samplers::make_tcd},
        {SamplerKind::FlowMatchEuler, "FlowMatchEulerDiscreteScheduler", false, std::nullopt, false, samplers::make_flow_match_euler},
    };
    // clang-format on
    return rows;
}

const SamplerRow& sampler_row(SamplerKind kind) {
    for (const auto& r : sampler_rows())
        if (r.kind == kind) return r;
    throw Error("invalid SamplerKind");
}

} // namespace

SamplerKind sampler_from_class_name(const std::string& cls, bool use_karras_sigmas, const std::string& algorithm_type) {
    // The row of the class that runs `algorithm_type` if one does; else the class's Karras row when asked for and
    // there is one, else its plain row.
    for (const auto& r : sampler_rows())
        if (cls == r.diffusers_class && r.algorithm_type && algorithm_type == r.algorithm_type) return r.kind;
    const SamplerRow* found = nullptr;
    std::string supported;
    for (const auto& r : sampler_rows()) {
        if (cls == r.diffusers_class && !r.algorithm_type && (!found || (use_karras_sigmas && r.karras))) found = &r;
        if (supported.find(r.diffusers_class) == std::string::npos)
            supported += (supported.empty() ? "" : ", ") + std::string(r.diffusers_class);
    }
    if (!found) throw Error("unsupported scheduler class '" + cls + "' (supported: " + supported + ")");
    return found->kind;
}

std::vector<std::string> unsupported_scheduler_settings(const std::string& json_text, SamplerKind kind) {
    const auto j = nlohmann::json::parse(json_text);
    const bool dpm = kind == SamplerKind::DPMPP2M || kind == SamplerKind::DPMPP2MKarras;
    const bool sde = kind == SamplerKind::DPMPP2MSDE, dpm_2s = kind == SamplerKind::DPMPP2S;
    const bool unipc = kind == SamplerKind::UniPC, deis = kind == SamplerKind::DEIS;
    const bool flow = kind == SamplerKind::FlowMatchEuler;
    // Read by SchedulerConfig, or inert unless a switch below enables them (thresholding's ratio and range, the
    // clipping range of clip_sample, which DDIM implements).
    static const std::set<std::string> known = {
        "_class_name",      "_diffusers_version", "num_train_timesteps", "beta_start",          "beta_end",
        "beta_schedule",    "trained_betas",      "steps_offset",        "set_alpha_to_one",    "clip_sample",
        "prediction_type",  "timestep_spacing",   "use_karras_sigmas",   "sigma_min",           "sigma_max",
        "skip_prk_steps",   "clip_sample_range",  "sample_max_value",    "dynamic_thresholding_ratio",
        "lower_order_final", "euler_at_final",    "predict_x0",          "disable_corrector",
        "original_inference_steps", "timestep_scaling", "shift", "use_dynamic_shifting", "base_shift", "max_shift",
        "base_image_seq_len", "max_image_seq_len"};
    // Behaviour-changing keys: the value implemented (and those that run the same), for the samplers whose diffusers
    // class has the key.
    struct Rule {
        const char* key;
        nlohmann::json value; // the supported value (null: only null)
        bool applies;
        // Other values that run the same (diffusers maps them to the implemented one): an array, or null.
        nlohmann::json same_as = nullptr;
    };
    std::vector<Rule> rules = {
        {"thresholding", false, true},
        {"rescale_betas_zero_snr", false, true},
        {"skip_prk_steps", true, kind == SamplerKind::PNDM},
        {"interpolation_type", "linear", kind == SamplerKind::Euler},
        {"timestep_type", "discrete", kind == SamplerKind::Euler},
        // The DPM-Solver family (dpmpp_2m / dpmpp_2m_karras, dpmpp_2m_sde, dpmpp_2s, unipc, deis): the solver settings
        // they implement (SolverSettings); lower_order_final, euler_at_final, predict_x0 and disable_corrector take
        // any value. diffusers runs the other classes' algorithm and solver types as the class's own (e.g. DEIS's
        // 'logrho' as DPM-Solver's 'midpoint').
        {"algorithm_type", "dpmsolver++", dpm || dpm_2s, {"deis"}},
        {"algorithm_type", "sde-dpmsolver++", sde},
        {"algorithm_type", "deis", deis, {"dpmsolver", "dpmsolver++"}},
        {"solver_order", 2, dpm || deis, {1, 3}},
        {"solver_order", 2, sde || dpm_2s, {1}}, // no third-order SDE (diffusers has none) or singlestep update
        {"solver_type", "midpoint", dpm || sde || dpm_2s, {"heun", "logrho", "bh1", "bh2"}},
        {"solver_type", "bh2", unipc, {"bh1", "midpoint", "heun", "logrho"}},
        {"solver_type", "logrho", deis, {"midpoint", "heun", "bh1", "bh2"}},
        {"use_lu_lambdas", false, dpm || sde},
        {"final_sigmas_type", "zero", dpm || sde || dpm_2s, {"sigma_min"}},
        {"lambda_min_clipped", "-inf", dpm || sde || dpm_2s},
        {"variance_type", nullptr, dpm || sde || dpm_2s},
        {"solver_p", nullptr, unipc},
        {"variance_type", "fixed_small", kind == SamplerKind::DDPM},
    };
    // FlowMatchEulerDiscreteScheduler's later switches: only the plain shifted schedule and Euler step exist here.
    // Listed for that class only (Euler's use_exponential_sigmas stays an unknown key there).
    if (flow)
        rules.insert(rules.end(), {{"use_karras_sigmas", false, true},
                                   {"use_exponential_sigmas", false, true},
                                   {"use_beta_sigmas", false, true},
                                   {"invert_sigmas", false, true},
                                   {"stochastic_sampling", false, true},
                                   {"shift_terminal", nullptr, true},
                                   {"time_shift_type", "exponential", true}});
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
        const bool accepted = r.same_as.is_array() && std::any_of(r.same_as.begin(), r.same_as.end(),
                                                                 [&](const nlohmann::json& a) { return same(v, a); });
        if (!same(v, r.value) && !accepted) {
            std::string values = r.value.dump();
            if (r.same_as.is_array())
                for (const auto& a : r.same_as) values += ", " + a.dump();
            out.push_back(std::string(r.key) + " = " + v.dump() + " (only " + values + " is implemented for " +
                          sampler_name(kind) + ")");
        }
    }
    for (const auto& [k, v] : j.items()) {
        if (known.count(k) || ruled.count(k)) continue;
        const bool inert = v.is_null() || (v.is_boolean() && !v.get<bool>()) || (v.is_array() && v.empty());
        if (!inert) out.push_back(k + " = " + v.dump() + " (a key this engine does not know)");
    }
    return out;
}

SchedulerConfig SchedulerConfig::from_json_file(const std::string& path) {
    return from_json_text(read_file(path, "scheduler config"), path);
}

namespace {
// The plain fields of every scheduler class, bound once for reading and writing (cache/io/json_config.h).
std::vector<JsonField> common_fields(SchedulerConfig& c) {
    return {ANCHOR_JSON_FIELD(c, num_train_timesteps), ANCHOR_JSON_FIELD(c, beta_start),
            ANCHOR_JSON_FIELD(c, beta_end),            ANCHOR_JSON_FIELD(c, steps_offset),
            ANCHOR_JSON_FIELD(c, set_alpha_to_one),    ANCHOR_JSON_FIELD(c, clip_sample),
            JsonField{"_class_name", &c.class_name}};
}
} // namespace

nlohmann::json SchedulerConfig::to_json() const {
    SchedulerConfig c = *this;
    nlohmann::json j = json_of(common_fields(c));
    j["beta_schedule"] = enum_name(beta_schedule_table(), beta_schedule);
    j["prediction_type"] = enum_name(prediction_type_table(), prediction_type);
    j["timestep_spacing"] = enum_name(timestep_spacing_table(), timestep_spacing);
    return j;
}

SchedulerConfig SchedulerConfig::from_json_text(const std::string& text, const std::string& path) {
    const auto j = JsonConfig::parse(text, path);
    SchedulerConfig c;
    j.read(common_fields(c));
    c.beta_schedule = j.get_enum("beta_schedule", beta_schedule_table(), c.beta_schedule);
    c.prediction_type = j.get_enum("prediction_type", prediction_type_table(), c.prediction_type);
    c.timestep_spacing = j.get_enum("timestep_spacing", timestep_spacing_table(), c.timestep_spacing);
    c.use_karras_sigmas = j.get_bool("use_karras_sigmas", c.use_karras_sigmas);
    if (j.has("sigma_min")) c.sigma_min = j.get_double("sigma_min", 0.0);
    if (j.has("sigma_max")) c.sigma_max = j.get_double("sigma_max", 0.0);
    auto& so = c.solver;
    if (j.has("solver_order")) {
        so.solver_order = j.get_int("solver_order", 2);
        if (*so.solver_order < 1) j.fail("solver_order", "must be >= 1", j.json().at("solver_order"));
    }
    if (j.has("lower_order_final")) so.lower_order_final = j.get_bool("lower_order_final", true);
    if (j.has("final_sigmas_type"))
        so.final_sigmas_type = j.get_enum("final_sigmas_type", final_sigmas_type_table(), FinalSigmasType::Zero);
    if (j.has("solver_type")) so.solver_type = j.get_enum("solver_type", solver_type_table(), SolverType::Midpoint);
    if (j.has("euler_at_final")) so.euler_at_final = j.get_bool("euler_at_final", false);
    if (j.has("predict_x0")) so.predict_x0 = j.get_bool("predict_x0", true);
    so.disable_corrector = j.get_int_list("disable_corrector", {});
    c.original_inference_steps = j.get_int("original_inference_steps", c.original_inference_steps);
    c.timestep_scaling = j.get_double("timestep_scaling", c.timestep_scaling);
    if (j.has("original_inference_steps") &&
        (c.original_inference_steps < 1 || c.original_inference_steps > c.num_train_timesteps))
        j.fail("original_inference_steps", "must be in [1, num_train_timesteps]",
               j.json().at("original_inference_steps"));
    c.shift = j.get_double("shift", c.shift);
    c.use_dynamic_shifting = j.get_bool("use_dynamic_shifting", c.use_dynamic_shifting);
    c.base_shift = j.get_double("base_shift", c.base_shift);
    c.max_shift = j.get_double("max_shift", c.max_shift);
    c.base_image_seq_len = j.get_int("base_image_seq_len", c.base_image_seq_len);
    c.max_image_seq_len = j.get_int("max_image_seq_len", c.max_image_seq_len);
    if (!(c.shift > 0)) j.fail("shift", "must be > 0", j.json().at("shift"));
    if (c.use_dynamic_shifting && c.max_image_seq_len == c.base_image_seq_len)
        j.fail("max_image_seq_len", "must differ from base_image_seq_len", j.json().at("max_image_seq_len"));
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

namespace samplers {

std::vector<float> to_floats(const torch::Tensor& t) {
    auto c = t.to(torch::kFloat32).contiguous();
    return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

std::vector<float> train_sigmas(const torch::Tensor& alphas_cumprod) {
    return to_floats(((1 - alphas_cumprod) / alphas_cumprod).pow(0.5));
}

std::vector<double> np_arange_down(double start, double stop, double step) {
    const auto len = static_cast<int64_t>(std::ceil((stop - start) / step));
    std::vector<double> v;
    for (int64_t i = 0; i < len; ++i) v.push_back(start + double(i) * step);
    return v;
}

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

double np_round(double x) {
    return std::nearbyint(x);
}

double np_interp_index(double x, const std::vector<float>& fp) {
    const int64_t n = static_cast<int64_t>(fp.size());
    if (x <= 0) return fp[0];
    if (x >= double(n - 1)) return fp[n - 1];
    const auto j = static_cast<int64_t>(std::floor(x));
    const double slope = double(fp[j + 1]) - double(fp[j]);
    return slope * (x - double(j)) + double(fp[j]);
}

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

torch::Tensor ve_x0(PredictionType type, const torch::Tensor& out, const torch::Tensor& x, float sigma_hat,
                    float sigma) {
    if (type == PredictionType::Epsilon) return x - double(sigma_hat) * out;
    if (type == PredictionType::VPrediction) {
        const float s2p1 = sigma * sigma + 1.0f;
        return out * double(-sigma / std::sqrt(s2p1)) + x / double(s2p1);
    }
    return out; // "sample"
}

AlphaSigma sigma_to_alpha_sigma(float sigma) {
    const float alpha = 1.0f / std::sqrt(sigma * sigma + 1.0f);
    return {alpha, sigma * alpha};
}

float torch_log(float v) {
    return torch::log(torch::scalar_tensor(v, torch::kFloat32)).item<float>();
}

float torch_exp(float v) {
    return torch::exp(torch::scalar_tensor(v, torch::kFloat32)).item<float>();
}

float torch_expm1(float v) {
    return torch::expm1(torch::scalar_tensor(v, torch::kFloat32)).item<float>();
}

torch::Tensor draw_noise(const torch::Tensor& like, torch::Generator* gen) {
    if (!gen) return torch::randn(like.sizes(), like.options());
    auto opts = like.options().device(gen->device());
    return torch::randn(like.sizes(), *gen, opts).to(like.device());
}

} // namespace samplers

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
    return sampler_row(kind).default_eta.has_value();
}

std::optional<double> effective_eta(SamplerKind kind, std::optional<double> eta) {
    if (!sampler_takes_eta(kind)) {
        if (eta) {
            std::string takers;
            for (const auto& r : sampler_rows())
                if (r.default_eta) takers += (takers.empty() ? "" : " and ") + sampler_name(r.kind);
            throw ParamError("eta", "sampler " + sampler_name(kind) + " has no noise term; eta applies to " + takers +
                                        " only");
        }
        return std::nullopt;
    }
    if (eta && !(std::isfinite(*eta) && *eta >= 0))
        throw ParamError("eta", "must be a finite number >= 0, got " + std::to_string(*eta));
    return eta.value_or(*sampler_row(kind).default_eta);
}

ScheduleLevels schedule_levels(NoiseSchedule s, const SchedulerConfig& cfg, int n) {
    using samplers::check_num_steps, samplers::karras_sigmas, samplers::np_linspace, samplers::sigma_to_t,
        samplers::train_sigmas;
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
    const auto& row = sampler_row(kind);
    SchedulerConfig cfg = cfg_in;
    cfg.schedule = effective_schedule(kind, cfg_in);
    // A scheduler config's use_karras_sigmas (no schedule given) means diffusers' Karras of that class: Euler and LMS
    // convert their spaced sigmas; DPM-Solver the model's, as --schedule karras does for every sampler.
    cfg.karras_spaced_range = !cfg_in.schedule && cfg_in.use_karras_sigmas && row.karras_spaced_range;
    return row.make(cfg, effective_eta(kind, eta_in));
}

} // namespace anchor::unet
