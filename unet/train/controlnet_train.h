// A ControlNet (Zhang et al. 2023, "Adding Conditional Control to Text-to-Image Diffusion Models") for the demo model
// fashion-sd (assets/models/fashion-sd), trained by the project on Fashion-MNIST with Canny edge maps as the control:
//   * initialised from the UNet's encoder as diffusers' ControlNetModel.from_unet: a copy of the time embedding,
//     conv_in, the down blocks and the mid block; zero-initialised 1x1 convolutions on every skip and on the mid
//     block, and a zero-initialised last convolution of the hint encoder (sec. 3.1: the ControlNet adds exactly
//     nothing before training, so the frozen model's quality is the starting point);
//   * trained on the epsilon-prediction loss of the frozen UNet with the ControlNet's residuals added (sec. 3.3, the
//     loss of the diffusion model itself), the VAE, text encoder and UNet frozen, the control image the Canny edges of
//     the training image (OpenCV, as `--control-preprocess canny`), the prompt the class caption fashion-sd was
//     trained with, replaced by the empty prompt with a probability (sec. 3.3: 50 %, so that the ControlNet learns
//     to read the control image without the prompt's help);
//   * saved as a diffusers ControlNetModel folder (config.json + diffusion_pytorch_model.safetensors) that
//     load_controlnet and diffusers' ControlNetModel.from_pretrained read.
// eval_control_following measures whether it steers: the Canny edges of generated images against the control edges.
#pragma once

#include "unet/model/controlnet.h"
#include "unet/pipeline/control_preprocess.h"
#include "unet/samplers/scheduler.h"
#include "unet/train/sd_train.h"

#include <nlohmann/json_fwd.hpp>
#include <torch/torch.h>

#include <string>
#include <vector>

namespace anchor::unet::train {

// The edge detector of training and evaluation: Canny with A1111's default thresholds (100, 200).
ControlPreprocessSpec fashion_canny_spec();

// Fashion-MNIST images [N, 28, 28] uint8 -> their control images: the padded 32x32 image (black border, as the model
// was trained on) copied to RGB, Canny edges, uint8 [N, 32, 32, 3] (255 on 0).
torch::Tensor fashion_control_edges(const torch::Tensor& u8, const ControlPreprocessSpec& spec);

// The ControlNet config diffusers' ControlNetModel.from_unet makes of `unet` with these hint-encoder channels
// (conditioning_embedding_out_channels; one stride-2 convolution between consecutive entries, so 3 entries map a
// 32x32 image to the 8x8 latents of the demo model).
ControlNetConfig controlnet_config_from_unet(const UNetConfig& unet, const std::vector<int>& hint_channels,
                                             int conditioning_channels = 3);
// A ControlNet of that config with the UNet's encoder weights copied and the zero convolutions (and the hint
// encoder's conv_out) zeroed, as from_unet(load_weights_from_unet=True). anchor::Error naming a tensor the UNet lacks.
ControlNetModel controlnet_from_unet(UNet2DConditionModelImpl& unet, const std::vector<int>& hint_channels,
                                     int conditioning_channels = 3);
// diffusers 0.27.2's ControlNetModel config.json of `c` (only keys its __init__ takes).
nlohmann::json controlnet_config_json(const ControlNetConfig& c);

struct ControlNetTrainOptions {
    TrainOptions train;                         // train.out: the ControlNet folder written
    std::string model = "assets/models/fashion-sd"; // the frozen pipeline (unet/, vae/, text_encoder/)
    std::vector<int> hint_channels{16, 32, 64};
    ControlPreprocessSpec canny = fashion_canny_spec();
    double max_seconds = 0; // > 0: stop (and save) once this much training time has passed
};

// Trains and writes <train.out>/config.json, diffusion_pytorch_model.safetensors (fp16, the EMA weights) and
// train_controlnet_log.txt; checkpoints in <train.out>/checkpoint/controlnet/ (train.resume continues from them).
TrainResult train_controlnet(const ControlNetTrainOptions& o);

// Whether generated images follow the control: `images` held-out test-set images (the first `images / 10` of each
// class, rounded up, in class order), each prompted with its class caption (fashion_prompt(c, 0)) and controlled by
// its Canny edges, generated in one batch with and without the ControlNet (the same seed, so the same initial noise).
// Per image the Canny edges E of the generated image against the control edges C: F1 with a one-pixel tolerance
// (precision = share of E within one pixel of C, recall = share of C within one pixel of E) and the plain IoU.
struct ControlFollowParams {
    std::string model = "assets/models/fashion-sd";
    std::string controlnet; // folder or file (load_controlnet)
    std::string data_dir = "/usr/share/datasets/fashion-mnist";
    int images = 20;
    int steps = 20;
    double cfg = 5.0;
    double scale = 1.0; // controlnet_conditioning_scale
    SamplerKind sampler = SamplerKind::DDIM;
    int64_t seed = 4242;
    ControlPreprocessSpec canny = fashion_canny_spec();
    std::string sheet; // when set: a PNG with one column per image, rows control edges / with / without
    bool overwrite = false;
};

struct ControlFollowResult {
    std::vector<int> test_index, label;
    std::vector<double> f1_with, f1_without, iou_with, iou_without;
    double mean_f1_with = 0, mean_f1_without = 0, mean_iou_with = 0, mean_iou_without = 0;
    std::string table() const; // per image and the means, plain text
};
ControlFollowResult eval_control_following(const ControlFollowParams& p);

// The control image of the `nth` (0-based) test-set image of class `label`: its Canny edges, uint8 [32, 32, 3].
torch::Tensor fashion_test_edges(const std::string& data_dir, int label, int nth, const ControlPreprocessSpec& spec);

} // namespace anchor::unet::train
