// AutoencoderKL (the SD first stage, Rombach et al. 2022) with diffusers module names: encoder.{conv_in, down_blocks,
// mid_block, conv_norm_out, conv_out}, quant_conv, post_quant_conv, decoder.{conv_in, mid_block, up_blocks,
// conv_norm_out, conv_out}. The mid-block attention is single-head with a residual connection.
#pragma once

#include "unet/model/unet_model.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <nlohmann/json_fwd.hpp>

#include <map>
#include <string>
#include <vector>

namespace anchor {
class WeightMap;
}

namespace anchor::unet {

struct VaeConfig {
    int in_channels = 3;
    int out_channels = 3;
    int latent_channels = 4;
    std::vector<int> block_out_channels{128, 256, 512, 512};
    int layers_per_block = 2;
    int norm_num_groups = 32;
    double scaling_factor = 0.18215;
    // SDXL's VAE overflows in float16: decode in float32 whatever the compute dtype (diffusers' force_upcast).
    bool force_upcast = false;
    // Per-channel latent statistics (diffusers latents_mean / latents_std, e.g. SDXL-derived VAEs that have them):
    // latents are denormalised as z * std / scaling_factor + mean before decoding. Empty: none.
    std::vector<double> latents_mean, latents_std;
    // SD 3's VAE (diffusers shift_factor): the sampler's latents are (z_vae - shift_factor) * scaling_factor, so the
    // decode input is z / scaling_factor + shift_factor. 0: none (SD 1.x / 2.x / XL).
    double shift_factor = 0.0;
    // diffusers use_quant_conv / use_post_quant_conv: the 1x1 convolutions around the latent (SD 3's VAE has neither).
    bool use_quant_conv = true;
    bool use_post_quant_conv = true;
    // The VAE-space latents of the sampler's latents (decode input): z / scaling_factor, or with the statistics
    // z * std / scaling_factor + mean; plus shift_factor.
    torch::Tensor unscale_latents(const torch::Tensor& z) const;

    static VaeConfig from_json(const nlohmann::json& j, const std::string& source = "VAE config");
    static VaeConfig from_json_file(const std::string& path);
    // The diffusers config.json of this config (what from_json reads back), its plain fields through the binding
    // from_json reads. `sample_size`: the training resolution diffusers records (the VAE itself is size-free).
    nlohmann::json to_json(int sample_size) const;
    // From diffusers-named shapes; the scaling factor cannot be seen in shapes: 0.18215 (SD 1.x/2.x).
    static VaeConfig detect_from_weights(const WeightMap& w);
    // Image pixels per latent pixel: 2^(levels-1) (8 for SD).
    int spatial_factor() const { return 1 << (int(block_out_channels.size()) - 1); }
};

// Shapes-only detection for either naming: resnet j of level i is `<down><i><resnets><j>.conv1.weight`
// (diffusers: "encoder.down_blocks.", ".resnets."; original LDM: "encoder.down.", ".block.").
VaeConfig detect_vae_config(const WeightMap& w, const std::string& down, const std::string& resnets);

struct VaeAttentionImpl : torch::nn::Module, perf::FastPaths {
    VaeAttentionImpl(int64_t channels, int64_t groups);
    torch::Tensor forward(const torch::Tensor& x);
    torch::nn::GroupNorm group_norm{nullptr};
    torch::nn::Linear to_q{nullptr}, to_k{nullptr}, to_v{nullptr}, out_linear{nullptr};
    torch::nn::ModuleList to_out;
    kernels::AttentionKernel kernel = kernels::AttentionKernel::Exact;
};
TORCH_MODULE(VaeAttention);

struct VaeMidBlockImpl : torch::nn::Module {
    VaeMidBlockImpl(int64_t channels, int64_t groups);
    torch::Tensor forward(const torch::Tensor& x);
    torch::nn::ModuleList resnets, attentions;
    std::vector<ResnetBlock2D> res;
    VaeAttention attn{nullptr};
};
TORCH_MODULE(VaeMidBlock);

struct VaeBlockImpl : torch::nn::Module { // DownEncoderBlock2D / UpDecoderBlock2D
    enum class Sampler { None, Down, Up };
    // n resnets (in -> out, then out -> out), then the sampler.
    VaeBlockImpl(int64_t in, int64_t out, int n, int64_t groups, Sampler sampler);
    torch::Tensor forward(torch::Tensor h);
    torch::nn::ModuleList resnets, samplers;
    std::vector<ResnetBlock2D> res;
    Downsample2D down{nullptr};
    Upsample2D up{nullptr};
};
TORCH_MODULE(VaeBlock);

using FeatureMap = std::map<std::string, torch::Tensor>;

// diffusers' Encoder and Decoder share one layout: conv_in, the blocks, the mid block, GroupNorm, SiLU, conv_out. The
// encoder's blocks (`down_blocks`) come before the mid block and halve the size; the decoder's (`up_blocks`, one
// resnet more each) come after it and double it.
struct VaeCoderImpl : torch::nn::Module, perf::FastPaths {
    VaeCoderImpl(const VaeConfig& c, bool decoder);
    // Features (when f is given) keyed "<prefix>conv_in", "<prefix>down_blocks.<i>" / "up_blocks.<i>", ...
    torch::Tensor forward(const torch::Tensor& x, FeatureMap* f, const std::string& prefix);
    bool decoder;
    torch::nn::Conv2d conv_in{nullptr}, conv_out{nullptr};
    torch::nn::ModuleList block_list;
    std::vector<VaeBlock> blocks;
    VaeMidBlock mid_block{nullptr};
    torch::nn::GroupNorm conv_norm_out{nullptr};
};
TORCH_MODULE(VaeCoder);

struct LatentDistribution {
    torch::Tensor moments, mean, logvar, std; // logvar clamped to [-30, 20], std = exp(logvar / 2)
    // mean + std * randn(mean.shape, gen) (diffusers DiagonalGaussianDistribution.sample).
    torch::Tensor sample(torch::Generator* gen) const;
};

// DiagonalGaussianDistribution(moments): mean, logvar clamped to [-30, 20], std (the plain and the tiled encode).
LatentDistribution latent_distribution(const torch::Tensor& moments);

class AutoencoderKLImpl : public torch::nn::Module, public perf::FastPaths {
public:
    explicit AutoencoderKLImpl(const VaeConfig& c);
    // Raw decoder output for latents z (no 1/scaling_factor, no clamp). Features keyed like the golden file
    // ("post_quant_conv", "decoder.conv_in", ...) when `f` is given, each prefixed with `prefix`.
    torch::Tensor decode(const torch::Tensor& z, FeatureMap* f = nullptr, const std::string& prefix = "");
    LatentDistribution encode(const torch::Tensor& image, FeatureMap* f = nullptr, const std::string& prefix = "");
    const VaeConfig& config() const { return cfg_; }
    void load(const WeightMap& w);
    void set_attention_kernel(kernels::AttentionKernel k); // kernels/attention.h; Exact by default
    void set_fast_paths(bool on);                          // unet_perf.h (every module)

    VaeCoder encoder{nullptr};
    VaeCoder decoder{nullptr};
    torch::nn::Conv2d quant_conv{nullptr}, post_quant_conv{nullptr};

private:
    torch::Tensor in_layout(const torch::Tensor& x) const; // channels-last on the oneDNN fast path
    VaeConfig cfg_;
};
TORCH_MODULE(AutoencoderKL);

} // namespace anchor::unet
