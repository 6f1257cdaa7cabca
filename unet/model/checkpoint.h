// Loading Stable Diffusion 1.x / 2.x checkpoints: a diffusers folder (unet/, vae/, text_encoder/, tokenizer/,
// scheduler/ with config.json files; fp32/fp16 safetensors, sharded or not) or an original single-file checkpoint
// (model.diffusion_model.*, first_stage_model.*, cond_stage_model.*). Single files are read through one name table
// (diffusers name -> original name, `ldm_name`) and their configs derived from tensor shapes.
#pragma once

#include "unet/model/clip_text.h"
#include "unet/model/clip_tokenizer.h"
#include "unet/model/lora.h"
#include "unet/model/name_conversion.h"
#include "unet/samplers/scheduler.h"
#include "unet/model/sd_family.h"
#include "unet/model/unet_model.h"
#include "unet/model/taesd.h"
#include "unet/model/vae.h"

#include <torch/torch.h>

#include <initializer_list>
#include <optional>
#include <string>

namespace anchor {
class WeightMap;
}

namespace anchor::unet {

struct LoadOptions {
    torch::ScalarType dtype = torch::kFloat; // compute dtype; fp16/bf16 files are converted at load
    bool text_encoder = true;                // both text encoders of SDXL
    bool unet = true;
    bool vae = true;
    // Attention arithmetic of the UNet and the VAE (kernels/attention.h). Unset: the model's own choice, the
    // "attention" of anchorcache.json in a diffusers folder (written for the models this project trains, which have
    // no reference outputs to match), else default_attention_kernel of the UNet's shapes (unet/model/unet_model.h).
    std::optional<kernels::AttentionKernel> attention;
    // Which library runs the UNet's and the VAE's linear layers and convolutions (kernels/onednn.h). Unset:
    // default_gemm_backend of the attention in effect (oneDNN with the fast attention kernels, LibTorch with exact).
    std::optional<kernels::GemmBackend> gemm;
    // LoRAs merged into the UNet and text encoder after loading, in order (unet/model/lora.h); ParamError("loras").
    std::vector<LoraSpec> loras;
    // What the UNet predicts. Unset ("auto"): a diffusers folder's scheduler_config.json, epsilon for SD 1.x single
    // files, and for SD 2.x single files the v-prediction test (v_prediction_test below). Set: this, whatever the
    // model says.
    std::optional<PredictionType> prediction;
    // A VAE replacing the model's (load_vae_file): a single file with original (LDM) or diffusers names, a diffusers
    // VAE folder or its weights file, or a pipeline folder (its vae/). Empty: the model's own VAE.
    std::string vae_file;
    // How Linear and Conv2d weights are kept in memory: float32 (the default), or float16 / bfloat16 with the
    // compute staying float32 (each weight upcast at use in kernels::linear and perf::conv2d, no float32 copy kept),
    // which halves their memory. Biases, GroupNorm/LayerNorm parameters and embeddings stay float32. Distinct from
    // `dtype` (the compute dtype): only with dtype float32.
    torch::ScalarType weights_dtype = torch::kFloat;
    // Where the networks run: the CPU, or a CUDA device of a CUDA build (batch::select_device picks one by MPI local
    // rank). The text encoders, the UNet and the VAE all move there; a pipeline's jobs run where its UNet is
    // (Txt2ImgParams::device).
    torch::Device device = torch::kCPU;
    // CUDA only (ParamError elsewhere). channels_last: the UNet's and the VAE's convolution weights kept in NHWC
    // order, so cuDNN runs its NHWC (tensor-core) convolutions and the activations follow that layout.
    // cudnn_benchmark: cuDNN times its convolution algorithms at each new shape and keeps the fastest (a
    // process-wide setting of LibTorch, switched on and never off by a load).
    bool channels_last = false;
    bool cudnn_benchmark = false;
    // The UNet's self-attention layers project through one fused QKV matrix (CrossAttentionImpl::set_fused_qkv):
    // the same products in one GEMM, float32 rounding may differ in the last bit. Any device.
    bool fused_qkv = false;

    // ParamError("weights_dtype") for a type other than f32/f16/bf16 or reduced-precision weights under a
    // reduced-precision compute dtype; ParamError("device") for a device this LibTorch does not have.
    void validate() const;
};

// The --weights-dtype choices: "f32", "f16", "bf16".
const EnumTable<torch::ScalarType>& weights_dtype_table();

// Stores the weight of every Linear and Conv2d of `m` as `dtype` (in place of the float32 one; see
// LoadOptions::weights_dtype). Float32: nothing changes.
void store_weights_as(torch::nn::Module& m, torch::ScalarType dtype);
// Bytes of all parameters and buffers of `m`, as stored.
int64_t parameter_bytes(const torch::nn::Module& m);

// The --prediction choices: "auto" (unset: the model decides), "eps", "v".
const EnumTable<std::optional<PredictionType>>& prediction_option_table();

// How the prediction type in effect was decided (recorded in the image sidecar).
enum class PredictionSource {
    SchedulerConfig, // a diffusers folder's scheduler/scheduler_config.json (or its default: epsilon)
    Sd1Default,      // an SD 1.x single file: epsilon, as every SD 1.x checkpoint
    Detected,        // an SD 2.x single file: v_prediction_test
    Option,          // LoadOptions::prediction
    OriginalConfig,  // a single file's original config (<stem>.yaml): parameterization "v" / VScaling
};
const EnumTable<PredictionSource>& prediction_source_table(); // "scheduler-config", "sd1-default", "detected", "option"

struct PredictionDecision {
    // Source SchedulerConfig: the scheduler config's own prediction_type is in effect, `type` is not used (see
    // Txt2ImgPipeline::scheduler_config).
    PredictionType type = PredictionType::Epsilon;
    PredictionSource source = PredictionSource::SchedulerConfig;
    std::optional<double> test_mean; // the v-prediction test's evidence, when it ran
};

// AUTOMATIC1111's test for SD 2.x checkpoints that come without a config (modules/sd_models_config.py,
// is_using_v_parameterization_for_sd2): one UNet evaluation at t = 999 on x = 0.5 everywhere [1, in, 8, 8] with a
// context of 0.5 everywhere [1, 2, cross_attention_dim]. At t = 999 alpha_bar is ~0 and x is almost pure noise: an
// epsilon model predicts ~x, a v model v = alpha x0 - sigma eps ~ -eps, so mean(out - x) < -1 means v-prediction.
// Returns mean(out - x) (computed in float32, whatever the UNet's dtype).
double v_prediction_test(UNet2DConditionModelImpl& unet);

// What a single-file checkpoint's original config says that its shapes cannot: `<stem>.yaml` next to the file (as
// A1111 looks for it), an LDM (model.params.unet_config) or SGM (model.params.network_config) config.
struct OriginalConfig {
    std::string path;                // empty: none found
    int num_head_channels = -1;      // heads = channels / num_head_channels (SD 2.x, SDXL)
    int num_heads = -1;              // or the same count everywhere (SD 1.x)
    int addition_time_embed_dim = 0; // SGM ConcatTimestepEmbedderND outdim (SDXL time ids)
    std::optional<double> scale_factor;
    std::optional<PredictionType> prediction; // parameterization "v" (LDM) / VScaling (SGM)
    // Heads and the VAE scaling factor into the configs detected from shapes.
    void apply(UNetConfig& unet, VaeConfig& vae) const;
};
// Throws anchor::Error naming the yaml file and field when it is malformed.
OriginalConfig read_original_config(const std::string& checkpoint);

// Engine settings a model folder asks for (anchorcache.json next to model_index.json); throws anchor::Error naming
// the file and field when it is malformed.
struct ModelHints {
    std::optional<kernels::AttentionKernel> attention;
};
ModelHints read_model_hints(const std::string& model_dir);

struct SDModels {
    std::string source; // the path given
    // The file that identifies the model (its SHA-256 is A1111's "Model hash"): the single-file checkpoint, or the
    // UNet's (first) weight file of a diffusers folder.
    std::string weights_file;
    std::string layout;              // "diffusers" | "single-file"
    SdFamily family = SdFamily::SD1; // from tensor shapes only (unet/model/sd_family.h)
    ClipTokenizer tokenizer;
    ClipTextModel text_encoder{nullptr};
    // SDXL: the second text encoder (OpenCLIP ViT-bigG's role, with text_projection) and its tokenizer, which pads
    // with "!" (id 0).
    ClipTokenizer tokenizer_2;
    ClipTextModel text_encoder_2{nullptr};
    // diffusers' force_zeros_for_empty_prompt (model_index.json; true for SDXL single files as for SDXL base): with
    // no negative prompt given, the negative conditioning is zeros instead of the encoding of "".
    bool force_zeros_for_empty_prompt = false;
    UNet2DConditionModel unet{nullptr};
    AutoencoderKL vae{nullptr};
    std::string scheduler_config_path; // diffusers scheduler/scheduler_config.json, empty when there is none
    kernels::AttentionKernel attention = kernels::AttentionKernel::Exact; // in effect (LoadOptions::attention)
    kernels::GemmBackend gemm = kernels::GemmBackend::Torch;              // in effect (LoadOptions::gemm)
    std::vector<LoraApplied> loras;                                       // merged into the weights (unet/model/lora.h)
    PredictionDecision prediction;                   // what the UNet predicts and why (the scheduler's prediction_type)
    std::string vae_file;                            // LoadOptions::vae_file when the VAE was replaced, else empty
    torch::ScalarType weights_dtype = torch::kFloat; // LoadOptions::weights_dtype
    // What Txt2ImgParams::free_params released ("text encoders", "UNet"); empty while every model can run.
    std::vector<std::string> released;
    int vae_scale_factor() const { return vae ? vae->config().spatial_factor() : 8; }
    // A tiny decoder (unet/model/taesd.h) for Txt2ImgParams::vae_decoder taesd and the previews; null when none.
    AutoencoderTiny taesd{nullptr};
};

// The parts Txt2ImgParams::free_params releases: the text encoders, the VAE encoder (txt2img never encodes an image),
// the UNet.
enum class ModelPart { TextEncoders, VaeEncoder, Unet };
// Frees the weights (every parameter and buffer) of `parts` and returns the freed heap to the system once; the
// modules keep their configurations, and `released` names what went.
void release_weights(SDModels& m, std::initializer_list<ModelPart> parts);

// `path`: a diffusers folder, a single-file checkpoint (.safetensors), or a folder holding exactly one single-file
// checkpoint. Throws anchor::Error naming the file and listing every missing tensor.
SDModels load_sd_models(const std::string& path, const LoadOptions& opts = {});

// One diffusers component folder (config.json + weights: an index, model.safetensors /
// diffusion_pytorch_model.safetensors, or their .fp16 variants).
UNet2DConditionModel load_unet_folder(const std::string& dir, torch::ScalarType dtype = torch::kFloat);
AutoencoderKL load_vae_folder(const std::string& dir, torch::ScalarType dtype = torch::kFloat);
ClipTextModel load_text_encoder_folder(const std::string& dir, torch::ScalarType dtype = torch::kFloat);

// A VAE from `path` (see LoadOptions::vae_file) through the one resolver (resolve_model) and the one name conversion
// (unet/model/name_conversion.h). Its config: the folder's config.json when it has one, else `base` (the model's VAE
// config), which its shapes must then fit. Throws anchor::Error naming the file with every missing, unexpected and
// wrong-shape tensor at once.
AutoencoderKL load_vae_file(const std::string& path, const VaeConfig& base, torch::ScalarType dtype = torch::kFloat);

} // namespace anchor::unet
