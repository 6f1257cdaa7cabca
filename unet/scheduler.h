// Diffusion schedulers, split as schedule (betas, alphas_cumprod, timesteps, sigmas) -> parameterisation
// (epsilon / v-prediction -> x0, sigma <-> alpha) -> sampler (a small step function).
//
// This header is the contract between the schedulers and the txt2img pipeline: the pipeline only calls
// set_timesteps / timestep / scale_model_input / step. Semantics follow diffusers 0.27.2 exactly (see
// tests/golden/sd/schedulers/README.md), including PNDM's repeated timestep and DPM's own 'leading' spacing.
#pragma once

#include "cache/io/enum_table.h"

#include <torch/torch.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace anchor::unet {

enum class SamplerKind { DDIM, PNDM, Euler, EulerAncestral, DPMPP2M, DPMPP2MKarras, LMS };

// Enum <-> string table that drives CLI parsing and --help: "ddim", "pndm", "euler", "euler_a", "dpmpp_2m",
// "dpmpp_2m_karras", "lms".
const EnumTable<SamplerKind>& sampler_table();
SamplerKind sampler_from_string(const std::string& s); // throws ParamError("sampler") listing the valid names
std::string sampler_name(SamplerKind k);

// The training noise schedule (diffusers' beta_schedule).
enum class BetaSchedule { ScaledLinear, Linear, SquaredCosCapV2 };
const EnumTable<BetaSchedule>& beta_schedule_table(); // "scaled_linear", "linear", "squaredcos_cap_v2"
// What the model predicts (diffusers' prediction_type).
enum class PredictionType { Epsilon, VPrediction, Sample };
const EnumTable<PredictionType>& prediction_type_table(); // "epsilon", "v_prediction", "sample"
// How inference timesteps are spread over the training ones (diffusers' timestep_spacing).
enum class TimestepSpacing { Leading, Trailing, Linspace };
const EnumTable<TimestepSpacing>& timestep_spacing_table(); // "leading", "trailing", "linspace"

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

    // Reads a diffusers scheduler/scheduler_config.json (missing fields keep their defaults; a value this engine does
    // not know is an anchor::Error naming the file, the field and the choices).
    static SchedulerConfig from_json_file(const std::string& path);
    // Addition: the same from JSON text (`label` names the source in errors).
    static SchedulerConfig from_json_text(const std::string& text, const std::string& label = "<json>");
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
    // samplers that draw noise (Euler draws and discards one randn per step like diffusers; Euler ancestral uses it;
    // DDIM with eta > 0).
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
};

// eta only applies to DDIM.
std::unique_ptr<Scheduler> make_scheduler(SamplerKind kind, const SchedulerConfig& cfg = {}, double eta = 0.0);

// ---- additions: schedule and class-name helpers ----
// The training noise schedule exactly as diffusers computes it (float32 [num_train_timesteps]): "scaled_linear" =
// linspace(sqrt(b0), sqrt(b1), N) squared, "linear" = linspace(b0, b1, N), "squaredcos_cap_v2" = Nichol & Dhariwal
// 2021 eq. 17 with beta capped at 0.999. alphas_cumprod = cumprod(1 - betas) in float32.
torch::Tensor make_betas(const SchedulerConfig& cfg);
torch::Tensor make_alphas_cumprod(const SchedulerConfig& cfg);
// diffusers class name (+ use_karras_sigmas) -> sampler: "DDIMScheduler", "PNDMScheduler", "EulerDiscreteScheduler",
// "EulerAncestralDiscreteScheduler", "DPMSolverMultistepScheduler", "LMSDiscreteScheduler". Throws anchor::Error
// for an unknown class.
SamplerKind sampler_from_class_name(const std::string& class_name, bool use_karras_sigmas = false);

} // namespace anchor::unet
