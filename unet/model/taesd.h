// AutoencoderTiny: TAESD / TAESDXL (madebyollin's tiny autoencoder distilled from the SD VAE), with diffusers 0.27's
// module names: encoder.layers.<i> and decoder.layers.<i>, each a Sequential of 3x3 convolutions and residual blocks
// (AutoencoderTinyBlock: conv, act, conv, act, conv, plus the input, then ReLU). The encoder halves the size at each
// level's first (stride 2, bias-free) convolution; the decoder clamps its input with tanh(x / 3) * 3 and doubles the
// size with a nearest upsample before each non-final level's convolution. Images are in [-1, 1] on both ends (TAESD
// itself works in [0, 1]; diffusers rescales at the edges, as here). The latents are those the UNet works on: TAESD is
// trained on SD's scaled latents, so its scaling_factor is 1.
//
// Two file layouts load: a diffusers folder (config.json + diffusion_pytorch_model.safetensors) or its weights file,
// and madebyollin's single files (taesd_encoder.safetensors / taesd_decoder.safetensors, taesdxl_* for SDXL), whose
// names are the bare Sequential indices ("1.conv.0.weight"); the decoder's index 0 there is the tanh clamp, so its
// layer i is diffusers' i - 1 (taesd_single_file_name).
#pragma once

#include "unet/model/unet_perf.h"

#include <torch/torch.h>

#include <nlohmann/json_fwd.hpp>

#include <string>
#include <vector>

namespace anchor {
class WeightMap;
}

namespace anchor::unet {

struct SDModels;

// Which decoder makes the final image (Txt2ImgParams::vae_decoder): the model's VAE, or its TAESD (SDModels::taesd).
enum class VaeDecoder { Full, Taesd };
// The option's value, parsed at the edge: "full", "taesd" (found next to the model) or "taesd:FILE".
struct VaeDecoderChoice {
    VaeDecoder kind = VaeDecoder::Full;
    std::string file; // taesd:FILE; empty: find_taesd
    // ParamError naming `field` for anything else.
    static VaeDecoderChoice parse(const std::string& text, const std::string& field);
};

// diffusers' get_activation names that AutoencoderTiny accepts.
enum class TinyActivation { Relu, Silu, Gelu, Mish };

struct TaesdConfig {
    int in_channels = 3;
    int out_channels = 3;
    int latent_channels = 4;
    std::vector<int> encoder_block_out_channels{64, 64, 64, 64};
    std::vector<int> decoder_block_out_channels{64, 64, 64, 64};
    std::vector<int> num_encoder_blocks{1, 3, 3, 3};
    std::vector<int> num_decoder_blocks{3, 3, 3, 1};
    int upsampling_scaling_factor = 2;
    TinyActivation act_fn = TinyActivation::Relu;
    // scale_latents / unscale_latents (latents <-> [0, 1], TAESD's latent images); not part of encode/decode.
    double latent_magnitude = 3.0, latent_shift = 0.5;
    // The pipelines decode vae.decode(latents / scaling_factor): 1 for every published TAESD.
    double scaling_factor = 1.0;

    // diffusers' config.json (a legacy block_out_channels stands for both coders when they are not given).
    static TaesdConfig from_json(const nlohmann::json& j, const std::string& source = "TAESD config");
    static TaesdConfig from_json_file(const std::string& path);
    // From the shapes of diffusers-named weights (encoder.layers.* and/or decoder.layers.*); the coder whose weights
    // are absent keeps the published TAESD shape. The scaling numbers cannot be seen in shapes: the defaults.
    static TaesdConfig detect_from_weights(const WeightMap& w);
    // Image pixels per latent pixel of the encoder (2 ^ (levels - 1)) and of the decoder (factor ^ (levels - 1)).
    int encoder_factor() const;
    int decoder_factor() const;
};

// Every TAESD module starts on the reference path (LibTorch's modules, diffusers' bits); set_fast_paths moves its
// convolutions to perf::conv2d (oneDNN's kernels with the model's GEMM backend, unet/model/unet_perf.h).
struct AutoencoderTinyBlockImpl : torch::nn::Module, perf::FastPaths {
    AutoencoderTinyBlockImpl(int64_t in, int64_t out, TinyActivation act);
    torch::Tensor forward(const torch::Tensor& x);
    torch::nn::Sequential conv{nullptr};
    torch::nn::Conv2d skip{nullptr}; // only when in != out (a 1x1 bias-free convolution)
    TinyActivation act;
};
TORCH_MODULE(AutoencoderTinyBlock);

struct TinyCoderImpl : torch::nn::Module, perf::FastPaths { // EncoderTiny / DecoderTiny: `layers` as diffusers numbers them
    TinyCoderImpl(const TaesdConfig& c, bool decoder);
    torch::Tensor forward(const torch::Tensor& x);
    bool decoder;
    TinyActivation act;
    int upsample; // the decoder's upsampling factor
    torch::nn::Sequential layers{nullptr};
};
TORCH_MODULE(TinyCoder);

class AutoencoderTinyImpl : public torch::nn::Module, public perf::FastPaths {
public:
    // A model of the coders asked for (madebyollin's files hold one each): the other stays absent.
    explicit AutoencoderTinyImpl(const TaesdConfig& c, bool with_encoder = true, bool with_decoder = true);
    // Image [B, 3, H, W] in [-1, 1] -> latents [B, latent_channels, H / 8, W / 8] (diffusers' encode().latents).
    torch::Tensor encode(const torch::Tensor& image);
    // Latents -> image in [-1, 1] (raw: no clamp), diffusers' decode().sample.
    torch::Tensor decode(const torch::Tensor& latents);
    // The UNet's latents -> image, as the diffusers pipelines call it: decode(latents / scaling_factor).
    torch::Tensor decode_latents(const torch::Tensor& latents);
    torch::Tensor scale_latents(const torch::Tensor& x) const;   // raw latents -> [0, 1]
    torch::Tensor unscale_latents(const torch::Tensor& x) const; // [0, 1] -> raw latents
    const TaesdConfig& config() const { return cfg_; }
    bool has_encoder() const { return !encoder.is_empty(); }
    bool has_decoder() const { return !decoder.is_empty(); }
    // Every weight of the present coders from diffusers-named `w` (all missing / unexpected names in one error).
    void load(const WeightMap& w);
    // Every module's paths: on = perf::conv2d with `gemm` (channels-last on oneDNN), off = the reference modules.
    void set_fast_paths(bool on, kernels::GemmBackend gemm = kernels::GemmBackend::Torch);
    std::string source; // the folder or file(s) it was loaded from

    TinyCoder encoder{nullptr};
    TinyCoder decoder{nullptr};

private:
    TaesdConfig cfg_;
};
TORCH_MODULE(AutoencoderTiny);

// The name-conversion table of madebyollin's single files: layer `index` of an encoder file is diffusers'
// encoder.layers.<index>; of a decoder file decoder.layers.<index - 1> (index 0 is the weightless clamp). Returns the
// diffusers name of `name` ("3.conv.0.weight" -> "decoder.layers.2.conv.0.weight"), or "" for a name outside the
// layout.
std::string taesd_single_file_name(const std::string& name, bool decoder);

// Loads a TAESD: a diffusers AutoencoderTiny folder, its weights file (config.json beside it, else the shapes), one
// of madebyollin's single files (its partner taesd*_encoder / taesd*_decoder beside it is loaded too when present),
// or a folder holding those. Throws anchor::Error naming the file, listing every missing tensor at once.
AutoencoderTiny load_taesd(const std::string& path);

// Where a TAESD for `model_path` may be, in the order they are tried: beside the model (the folder itself for a
// diffusers folder, the file's folder for a single file), a `taesd` (SD 1.x/2.x) or `taesdxl` (SDXL) folder, then
// madebyollin's <name>_decoder.safetensors.
std::vector<std::string> taesd_candidates(const std::string& model_path, bool sdxl);
// The first candidate that exists, "" when none.
std::string find_taesd(const std::string& model_path, bool sdxl);

// Loads the TAESD `file` (empty: find_taesd next to `model_path`, an error naming every place looked at when there is
// none) and sets models.taesd on the model's fast paths and GEMM backend; its latent channel count must be the UNet's (an error naming the file, expected and
// actual).
void attach_taesd(SDModels& models, const std::string& file, const std::string& model_path);

} // namespace anchor::unet
