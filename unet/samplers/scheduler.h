// Diffusion schedulers, split as schedule (betas, alphas_cumprod, timesteps, sigmas) -> parameterisation
// (epsilon / v-prediction -> x0, sigma <-> alpha) -> sampler (a small step function).
//
// This header is the contract between the schedulers and the txt2img pipeline: the pipeline only calls
// set_timesteps / timestep / scale_model_input / step. Semantics follow diffusers 0.27.2 exactly (see
// tests/golden/sd/schedulers/README.md), including PNDM's repeated timestep and DPM's own 'leading' spacing.
//
// Noise schedules (NoiseSchedule) choose where the loop's noise levels lie, for every sampler:
//   default      diffusers' timestep_spacing (leading / trailing / linspace) of each scheduler class, unchanged.
//   karras       Karras et al. 2022, eq. 5 with rho = 7: sigma_i = (smax^(1/rho) + i/(n-1) (smin^(1/rho) -
//                smax^(1/rho)))^rho, between the model's sigma_min = sigma(t=0) and sigma_max = sigma(t=N-1), as
//                diffusers 0.27.2's _convert_to_karras in DPMSolverMultistepScheduler (and k-diffusion's
//                get_sigmas_karras, A1111, ComfyUI, stable-diffusion.cpp). diffusers' EulerDiscreteScheduler /
//                LMSDiscreteScheduler take the range from their already spaced sigmas instead, which for 'leading'
//                spacing is [sigma(steps_offset), sigma(first timestep)]: that range is used where a scheduler
//                config's use_karras_sigmas asks for it with those samplers (SchedulerConfig::karras_spaced_range);
//                --schedule karras is always the model's range (docs/samplers.md).
//   exponential  log-linear: sigma_i = exp(linspace(log smax, log smin, n)_i) (k-diffusion get_sigmas_exponential;
//                diffusers' later _convert_to_exponential).
//   sgm_uniform  ComfyUI's comfy/samplers.py normal_scheduler(sgm=True) / stable-diffusion.cpp's SGMUniformScheduler:
//                timesteps linspace(N-1, 0, n+1)[:-1], each mapped to sigma by interpolating log sigma between the two
//                neighbouring training timesteps.
//   simple       ComfyUI's simple_scheduler / stable-diffusion.cpp's SimpleScheduler: every (N/n)-th training sigma
//                counted from the end, sigma(N-1 - floor(i N / n)).
// The model's sigmas are the training schedule's sqrt((1 - abar) / abar) in float32, as diffusers computes them.
// Sigma samplers (Euler, Euler a, DPM++ 2M, LMS) step on these sigmas (then a final 0) and give the UNet the
// timestep diffusers' _sigma_to_t interpolates for each (log sigma, linear between training timesteps):
// fractional float32 for Euler / Euler a / LMS (as diffusers' EulerDiscreteScheduler with use_karras_sigmas),
// rounded half to even for DPM++ 2M (as DPMSolverMultistepScheduler). Timestep samplers (DDIM, PNDM) run on the
// same _sigma_to_t timesteps rounded half to even (numpy.round) to integer training steps, each step going to the
// next timestep of the list (-1, i.e. alpha_bar = final_alpha, after the last) instead of diffusers' fixed
// t - N/n, so rounding may repeat a timestep at the low-noise end; PNDM's linear multistep weights assume equal
// steps and are kept as they are.
#pragma once

#include "cache/io/enum_table.h"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace anchor::unet {

enum class SamplerKind {
    DDIM,
    PNDM,
    Euler,
    EulerAncestral,
    DPMPP2M,
    DPMPP2MKarras,
    LMS,
    DPMPP2MSDE,
    DPMPP2S,
    UniPC,
    DEIS,
    DDPM,
    Heun,
    KDPM2,
    KDPM2Ancestral,
    LCM,
    TCD,
    FlowMatchEuler, // SD 3's FlowMatchEulerDiscreteScheduler (rectified flow; unet/samplers/flow_match_euler.cpp)
};

// Enum <-> string table that drives CLI parsing and --help: "ddim", "pndm", "euler", "euler_a", "dpmpp_2m",
// "dpmpp_2m_karras", "lms", "dpmpp_2m_sde", "dpmpp_2s", "unipc", "deis", "ddpm", "heun", "dpm2", "dpm2_a", "lcm",
// "tcd", "flow_match_euler".
const EnumTable<SamplerKind>& sampler_table();
// Other spellings of the same samplers: stable-diffusion.cpp's --sampling-method names ("dpm++2m", "euler_a",
// "dpm2", "lcm", ...) and ComfyUI's KSampler names ("dpm_2", "dpm_2_ancestral", ...), each naming one sampler of
// sampler_table() exactly (a name of theirs that means something else here, e.g. sd.cpp's ancestral "dpm++2s_a", is
// not listed). A1111's names are in unet/pipeline/infotext.h (sampler_from_any_name).
const EnumTable<SamplerKind>& sampler_alias_table();
// A sampler_table() name or an alias; throws ParamError("sampler") listing the valid names.
SamplerKind sampler_from_string(const std::string& s);
std::string sampler_name(SamplerKind k);

// The training noise schedule (diffusers' beta_schedule).
enum class BetaSchedule { ScaledLinear, Linear, SquaredCosCapV2 };
const EnumTable<BetaSchedule>& beta_schedule_table(); // "scaled_linear", "linear", "squaredcos_cap_v2"
// What the model predicts (diffusers' prediction_type).
enum class PredictionType { Epsilon, VPrediction, Sample };
const EnumTable<PredictionType>& prediction_type_table(); // "epsilon", "v_prediction", "sample"

// The VP form x_t = sqrt(abar) x0 + sqrt(1 - abar) eps (DDPM, Ho et al. 2020 eq. 4), v = sqrt(abar) eps - sqrt(1 - abar)
// x0 (Salimans & Ho 2022, sec. 4). Every sampler's model input has it: an Euler-type input x / sqrt(1 + sigma^2) with
// abar = 1 / (1 + sigma^2). vp_predict: x0 and eps of the model output `out` at x_t; vp_output: the inverse, the
// output whose x0 at x_t is `x0`.
struct X0Eps {
    torch::Tensor x0, eps;
};
X0Eps vp_predict(PredictionType type, const torch::Tensor& out, const torch::Tensor& x, float abar);
torch::Tensor vp_output(PredictionType type, const torch::Tensor& x0, const torch::Tensor& x, float abar);
// How inference timesteps are spread over the training ones (diffusers' timestep_spacing).
enum class TimestepSpacing { Leading, Trailing, Linspace };
const EnumTable<TimestepSpacing>& timestep_spacing_table(); // "leading", "trailing", "linspace"

// Where the noise levels of the loop lie (see the top of this file); stable-diffusion.cpp's --scheduler and ComfyUI's
// scheduler names.
enum class NoiseSchedule { Default, Karras, Exponential, SgmUniform, Simple };
// "default", "karras", "exponential", "sgm_uniform", "simple": drives --schedule's parsing and --help.
const EnumTable<NoiseSchedule>& noise_schedule_table();
std::string noise_schedule_name(NoiseSchedule s);
// A1111's "Schedule type" infotext label: "Automatic" (the sampler's own spacing), "Karras", "Exponential",
// "SGM Uniform", "Simple".
std::string noise_schedule_label(NoiseSchedule s);

// The solver type of the DPM-Solver family: DPM-Solver's second-order 'midpoint' / 'heun' (Lu et al. 2022a/b),
// UniPC's B(h) = h 'bh1' / e^h - 1 'bh2' (Zhao et al. 2023, sec. 3.1), DEIS's 'logrho'. Each class runs the others'
// names as its default, as diffusers does.
enum class SolverType { Midpoint, Heun, Bh1, Bh2, LogRho };
const EnumTable<SolverType>& solver_type_table(); // "midpoint", "heun", "bh1", "bh2", "logrho"
// diffusers' final_sigmas_type: the sigma after the last step is 0 or sigma(t = 0) of the training schedule.
enum class FinalSigmasType { Zero, SigmaMin };
const EnumTable<FinalSigmasType>& final_sigmas_type_table(); // "zero", "sigma_min"
// The keys of those classes' scheduler_config.json (unset: the class's default).
struct SolverSettings {
    std::optional<int> solver_order;                   // multistep order / singlestep pattern order
    std::optional<bool> lower_order_final;             // lower orders at the end of short runs
    std::optional<FinalSigmasType> final_sigmas_type;  // DPM-Solver multistep and singlestep
    std::optional<SolverType> solver_type;             // see SolverType
    std::optional<bool> euler_at_final;                // DPM-Solver multistep: first order at the last step
    std::optional<bool> predict_x0;                    // UniPC: data (true) or noise prediction
    std::vector<int> disable_corrector;                // UniPC: steps whose corrector is skipped
};

// The fields of diffusers' scheduler_config.json that matter; defaults are SD 1.5's.
struct SchedulerConfig {
    int num_train_timesteps = 1000;
    double beta_start = 0.00085;
    double beta_end = 0.012;
    BetaSchedule beta_schedule = BetaSchedule::ScaledLinear;
    int steps_offset = 1;
    bool set_alpha_to_one = false;
    bool clip_sample = false;
    PredictionType prediction_type = PredictionType::Epsilon;
    TimestepSpacing timestep_spacing = TimestepSpacing::Leading;
    // Additions (not in the original contract): the diffusers class that wrote the file ("" when absent) and the
    // DPM-Solver Karras switch, so a scheduler_config.json alone identifies the sampler (see sampler_from_config).
    std::string class_name;
    bool use_karras_sigmas = false;
    // Addition: the noise schedule; unset = karras when use_karras_sigmas, else default (see effective_schedule).
    std::optional<NoiseSchedule> schedule;
    // diffusers' EulerDiscreteScheduler sigma_min / sigma_max (null = unset): the ends of its Karras range.
    std::optional<double> sigma_min, sigma_max;
    // Set by make_scheduler: the Karras sigmas take their range from the sampler's own spaced sigmas of this step
    // count, [sigma(last spaced timestep), sigma(first spaced timestep)] (or sigma_min / sigma_max when given), as
    // diffusers' EulerDiscreteScheduler / LMSDiscreteScheduler do with use_karras_sigmas (set_timesteps converts the
    // sigmas of its spaced timesteps, so the range depends on timestep_spacing). Otherwise the model's range
    // [sigma(0), sigma(N-1)], as DPMSolverMultistepScheduler and k-diffusion / A1111's karras.
    bool karras_spaced_range = false;
    // Addition: the solver settings of the DPM-Solver family (DPMSolverMultistep / DPMSolverSinglestep /
    // UniPCMultistep / DEISMultistep; each sampler reads those its class has, unset = the class default).
    SolverSettings solver;
    // LCMScheduler / TCDScheduler: the distillation schedule's step count (the timesteps are taken from
    // (1..original_inference_steps) * (N / original_inference_steps) - 1) and the scale of the timestep in the
    // consistency-model boundary condition c_skip / c_out (Song et al. 2023, appendix C; LCM's sigma_data 0.5).
    int original_inference_steps = 50;
    double timestep_scaling = 10.0;
    // FlowMatchEulerDiscreteScheduler (SD 3; Esser et al. 2024, sec. 5.3.2): the timestep shift
    // sigma' = shift sigma / (1 + (shift - 1) sigma), or with use_dynamic_shifting the resolution-dependent
    // exp(mu) / (exp(mu) + 1 / sigma - 1), mu from the image's token count (flow_match_mu) set by the caller.
    double shift = 1.0;
    bool use_dynamic_shifting = false;
    double base_shift = 0.5, max_shift = 1.15;
    int base_image_seq_len = 256, max_image_seq_len = 4096;
    std::optional<double> mu; // required with use_dynamic_shifting (ParamError("mu") at set_timesteps without it)

    // Reads a diffusers scheduler/scheduler_config.json (missing fields keep their defaults; a value this engine does
    // not know is an anchor::Error naming the file, the field and the choices).
    static SchedulerConfig from_json_file(const std::string& path);
    // Addition: the same from JSON text (`label` names the source in errors).
    static SchedulerConfig from_json_text(const std::string& text, const std::string& label = "<json>");
    // The fields every diffusers scheduler class has (the training schedule, spacing, prediction type and the class
    // name), as from_json_text reads them: what a trainer writes as its model's scheduler_config.json.
    nlohmann::json to_json() const;
};

class Scheduler {
public:
    virtual ~Scheduler() = default;
    virtual void set_timesteps(int num_inference_steps) = 0;
    // Number of model evaluations in the loop (PNDM with skip_prk_steps: num_inference_steps + 1).
    virtual int num_loop_steps() const = 0;
    // Timestep value of loop step i as the UNet receives it (int-valued for DDIM/PNDM/DPM, float for Euler/LMS).
    virtual double timestep(int i) const = 0;
    virtual double init_noise_sigma() const = 0;
    virtual torch::Tensor scale_model_input(const torch::Tensor& x, int i) const = 0;
    // One sampler step at loop index i: model_output (eps or v) and sample x -> prev_sample. `gen` is used by
    // samplers that draw noise (Euler draws and discards one randn per step like diffusers; Euler ancestral draws one
    // per step whatever its eta; DDIM with eta > 0).
    virtual torch::Tensor step(const torch::Tensor& model_output, int i, const torch::Tensor& x,
                               torch::Generator* gen) = 0;
    // The full tensors, for tests: timesteps in loop order and sigmas (empty where the scheduler has none).
    virtual std::vector<double> timesteps() const = 0;
    virtual std::vector<double> sigmas() const { return {}; }

    // ---- additions: img2img / inpaint (diffusers' get_timesteps and scheduler.add_noise) ----
    // The loop starts at loop step `begin` (diffusers' set_begin_index(t_start * order)): multistep samplers count
    // their history from there (PNDM's counter, LMS/DPM's step_index). set_timesteps resets it to 0.
    virtual void set_begin_index(int begin) = 0;
    virtual int begin_index() const = 0;
    // diffusers' add_noise at the noise level of loop step i: sqrt(abar_t) x0 + sqrt(1 - abar_t) noise with
    // t = timestep(i) (DDIM, PNDM), x0 + sigma_i noise (Euler, Euler a, LMS), alpha_i x0 + sigma_i noise with the VP
    // pair of sigma_i (DPM-Solver). diffusers' sigma schedulers take sigma from their begin or step index, the
    // alpha-bar ones from the timestep: both are loop step i here.
    virtual torch::Tensor add_noise(const torch::Tensor& x0, const torch::Tensor& noise, int i) const = 0;

    // ---- addition: the injected noise carried forward (for the feature caches) ----
    // The part of the current sample that the fresh noise of the noise-term samplers put there (Euler a; DDIM with
    // eta > 0), each step carrying it as it carries the sample with the denoised estimate held fixed:
    //   N_{i+1} = c_i N_i + s_i z_i,  Euler a: c = sigma_down / sigma, s = sigma_up (k-diffusion get_ancestral_step);
    //                                 DDIM: c = sqrt(1 - abar_prev - std^2) / sqrt(1 - abar_t), s = std (eq. 12, 16).
    // sample - N is then the deterministic part of the trajectory, what a cache's step decision should look at: the
    // fresh noise changes the sample at every step by design and is no evidence that the deep features moved.
    // Undefined for samplers without a noise term and before the first step that draws one; set_timesteps and
    // set_begin_index start it again.
    const torch::Tensor& injected_noise() const { return injected_; }
    // The product of the carries c of the steps so far (1 at the start): N of an earlier step s, carried to the current
    // one, is N_s * injected_carry() / (injected_carry() at s).
    double injected_carry() const { return carry_; }
    // What the model predicts (eps, v or the sample): how its output responds to noise in its input.
    virtual PredictionType prediction_type() const { return PredictionType::Epsilon; }
    // How many earlier model outputs one step combines with the current one: 0 for the single-step samplers (DDIM,
    // Euler, Euler a), 1 for DPM-Solver++ 2M, 3 for the order-4 linear multistep ones (LMS, PLMS).
    virtual int earlier_outputs() const { return 0; }
    // diffusers' scheduler.order: loop steps (model calls) per inference step, 2 for Heun / KDPM2 / KDPM2 ancestral
    // (a predictor and a corrector call), whose set_begin_index takes a multiple of it; 1 for the others.
    virtual int order() const { return 1; }
    // The noise level (VE sigma) of each loop step's model input where the sampler has sigmas: sigmas() for all of
    // them except KDPM2 / KDPM2 ancestral, whose second evaluation of a step sits at the interpolated sigma between
    // the two (empty where the scheduler has none).
    virtual std::vector<double> model_sigmas() const { return sigmas(); }
    // The clean-image estimate the last step() returned besides the sample where diffusers returns one as the step's
    // output (LCMScheduler's `denoised`, TCDScheduler's `pred_noised_sample`); undefined for the others.
    virtual torch::Tensor denoised() const { return {}; }

protected:
    void carry_injected_noise(double carry, const torch::Tensor& fresh) {
        injected_ = injected_.defined() ? injected_ * carry + fresh : fresh;
        carry_ *= carry;
    }
    void reset_injected_noise() {
        injected_ = torch::Tensor();
        carry_ = 1.0;
    }
    torch::Tensor injected_;
    double carry_ = 1.0;
};

// The scheduler of `kind` with cfg's schedule (effective_schedule) and eta (effective_eta: unset = the sampler's
// default). Throws ParamError("schedule") / ParamError("eta") as those do.
std::unique_ptr<Scheduler> make_scheduler(SamplerKind kind, const SchedulerConfig& cfg = {},
                                          std::optional<double> eta = std::nullopt);

// The schedule a scheduler of `kind` runs with cfg: dpmpp_2m_karras means dpmpp_2m with karras (any other schedule
// set in cfg.schedule is a ParamError("schedule")); else cfg.schedule; else karras when cfg.use_karras_sigmas; else
// default.
NoiseSchedule effective_schedule(SamplerKind kind, const SchedulerConfig& cfg);
// The samplers with a noise term take eta: DDIM (Song et al. 2021 eq. 16, default 0 = deterministic) and Euler
// ancestral (k-diffusion's get_ancestral_step, default 1; 0 is Euler on the same sigmas).
bool sampler_takes_eta(SamplerKind kind);
// The eta `kind` runs with: the given one or the sampler's default; nullopt for samplers without a noise term.
// ParamError("eta") for an eta given to such a sampler (naming the samplers that take one), or one < 0 or not finite.
std::optional<double> effective_eta(SamplerKind kind, std::optional<double> eta);
// The n noise levels (descending, without the final 0) of a schedule other than default, from cfg's training
// schedule, and the fractional training timestep of each (diffusers' _sigma_to_t). Throws for default, which is each
// sampler's own timestep spacing.
struct ScheduleLevels {
    std::vector<double> sigmas, timesteps;
};
ScheduleLevels schedule_levels(NoiseSchedule s, const SchedulerConfig& cfg, int n);

// The dynamic shift of a flow-matching schedule for an image of `image_seq_len` transformer tokens: linear in the
// token count through (base_image_seq_len, base_shift) and (max_image_seq_len, max_shift) (diffusers' calculate_shift).
double flow_match_mu(const SchedulerConfig& cfg, int64_t image_seq_len);

// ---- additions: schedule and class-name helpers ----
// The training noise schedule exactly as diffusers computes it (float32 [num_train_timesteps]): "scaled_linear" =
// linspace(sqrt(b0), sqrt(b1), N) squared, "linear" = linspace(b0, b1, N), "squaredcos_cap_v2" = Nichol & Dhariwal
// 2021 eq. 17 with beta capped at 0.999. alphas_cumprod = cumprod(1 - betas) in float32.
torch::Tensor make_betas(const SchedulerConfig& cfg);
torch::Tensor make_alphas_cumprod(const SchedulerConfig& cfg);
// diffusers class name (+ use_karras_sigmas, + algorithm_type where the class has several) -> sampler:
// "DDIMScheduler", "PNDMScheduler", "EulerDiscreteScheduler", "EulerAncestralDiscreteScheduler",
// "DPMSolverMultistepScheduler" (algorithm_type "sde-dpmsolver++": dpmpp_2m_sde), "LMSDiscreteScheduler",
// "DPMSolverSinglestepScheduler", "UniPCMultistepScheduler", "DEISMultistepScheduler". Throws anchor::Error for an
// unknown class. An algorithm_type no row names gives the class's plain row (unsupported_scheduler_settings then
// reports it).
SamplerKind sampler_from_class_name(const std::string& class_name, bool use_karras_sigmas = false,
                                    const std::string& algorithm_type = "");
// The settings of a diffusers scheduler configuration (JSON text) that the sampler `kind` would not run as diffusers
// does: a behaviour-changing key of that class with a value this engine does not implement (e.g.
// DPMSolverMultistepScheduler's algorithm_type 'sde-dpmsolver++', EulerDiscreteScheduler's interpolation_type
// 'log_linear', thresholding true), or a key this engine does not know at all with a value other than null / false.
// One "key = value (why)" entry each; empty when the configuration is fully supported. Keys of other classes that
// diffusers' from_config ignores for this one (PNDM's skip_prk_steps for Euler, ...) are not reported.
std::vector<std::string> unsupported_scheduler_settings(const std::string& json_text, SamplerKind kind);

} // namespace anchor::unet
