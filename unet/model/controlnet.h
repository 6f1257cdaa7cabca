// ControlNet (Zhang et al. 2023, "Adding Conditional Control to Text-to-Image Diffusion Models"), laid out exactly like
// diffusers' ControlNetModel so that registered module names equal the checkpoint names: a trainable copy of the
// UNet's encoder (time embedding, conv_in, down blocks, mid block: UNet2DConditionModelImpl built without its decoder,
// the same block code), a small convolutional encoder of the control image added to conv_in's output (sec. 3.2,
// "condition encoder" E), and one zero-initialised 1x1 convolution per skip connection and for the mid block whose
// outputs are added to the UNet's skips (SkipResiduals).
#pragma once

#include "unet/model/unet_model.h"

#include <nlohmann/json_fwd.hpp>

#include <memory>
#include <string>
#include <vector>

namespace anchor {
class WeightMap;
}

namespace anchor::unet {

struct ControlNetConfig {
    UNetConfig unet;                                      // the encoder's blocks (up_block_types unused)
    int conditioning_channels = 3;                        // channels of the control image
    std::vector<int> embedding_channels{16, 32, 96, 256}; // conditioning_embedding_out_channels
    bool bgr = false;                                     // controlnet_conditioning_channel_order "bgr"
    bool global_pool_conditions = false;                  // residuals averaged over space (shuffle models)

    // diffusers' ControlNetModel config.json; anchor::Error naming `source` and the field.
    static ControlNetConfig from_json(const nlohmann::json& j, const std::string& source = "ControlNet config");
    static ControlNetConfig from_json_file(const std::string& path);
    // From diffusers-named tensor shapes (a single .safetensors without config; heads as UNetConfig's detector).
    static ControlNetConfig detect_from_weights(const WeightMap& w);
};

// diffusers' ControlNetConditioningEmbedding: conv_in, then per channel step a 3x3 conv and a stride-2 3x3 conv, SiLU
// after each, and conv_out to the UNet's first width (no activation).
struct ControlNetConditioningEmbeddingImpl : torch::nn::Module, perf::FastPaths {
    ControlNetConditioningEmbeddingImpl(int64_t conditioning_channels, const std::vector<int>& channels,
                                        int64_t out_channels);
    torch::Tensor forward(const torch::Tensor& image);
    torch::nn::Conv2d conv_in{nullptr}, conv_out{nullptr};
    torch::nn::ModuleList blocks;
    std::vector<torch::nn::Conv2d> convs;
};
TORCH_MODULE(ControlNetConditioningEmbedding);

class ControlNetModelImpl : public UNet2DConditionModelImpl {
public:
    explicit ControlNetModelImpl(const ControlNetConfig& cfg);

    // diffusers ControlNetModel.forward: `sample`, `timestep` and `cond` as the UNet gets them, `image` the prepared
    // control image [B, conditioning_channels, 2^k h, 2^k w] in [0, 1]; the residuals times `scale`, in guess mode
    // times logspace(-1, 0, skips + 1) * scale (skip k gets entry k, the mid block the last; Zhang et al. 2023 sec.
    // 4.2). Only the first `skips` down residuals (-1: all) and the mid one when `mid` are computed: a DeepCache
    // shallow step of the UNet consumes no more.
    SkipResiduals residuals(const torch::Tensor& sample, const torch::Tensor& timestep, const UNetCond& cond,
                            const torch::Tensor& image, double scale, bool guess_mode, int skips = -1, bool mid = true);
    const ControlNetConfig& control_config() const { return ccfg_; }

    ControlNetConditioningEmbedding controlnet_cond_embedding{nullptr};
    torch::nn::ModuleList controlnet_down_blocks;
    std::vector<torch::nn::Conv2d> zero_convs;
    torch::nn::Conv2d controlnet_mid_block{nullptr};

private:
    ControlNetConfig ccfg_;
};
TORCH_MODULE(ControlNetModel);

// A diffusers ControlNet folder (config.json + diffusion_pytorch_model.safetensors), its weights file, or a single
// .safetensors with diffusers names (config from shapes) or with the original ControlNet names (control_model.*:
// input_blocks / zero_convs / input_hint_block / middle_block_out, converted through unet/model/name_conversion.h).
// anchor::Error naming the file and every missing / unexpected tensor.
ControlNetModel load_controlnet(const std::string& path, torch::ScalarType dtype = torch::kFloat);

// Whether `net` fits `unet` (its residuals have the shapes of the UNet's skips): the same block widths, layers,
// cross-attention width and added conditioning. Empty when it does, else what differs ("block_out_channels
// [320, 640, 1280, 1280] (the UNet's) vs [32, 64] (the ControlNet's)").
std::string controlnet_mismatch(const ControlNetModelImpl& net, const UNetConfig& unet);

} // namespace anchor::unet
