// Training of the small SD-architecture demo model on Fashion-MNIST (assets/models/fashion-sd), in LibTorch:
//   1. train_vae:        AutoencoderKL (3x32x32 -> 4x8x8 latents), L2 reconstruction + beta * KL (beta 1e-6 as the
//                        SD first stage; no perceptual/GAN terms at this size), then scaling_factor = 1 / std(latents)
//                        (how the SD 1.x factor 0.18215 was chosen, Rombach et al. 2022, sec. 4.3.2 / appendix G).
//   2. train_unet:       UNet2DConditionModel + a tiny CLIP text encoder trained jointly from scratch with the
//                        epsilon-prediction objective of DDPM (Ho et al. 2020, eq. 14) on the frozen VAE's latents,
//                        SD 1.x noise schedule (scaled_linear 0.00085..0.012, 1000 steps), 10 % caption dropout so
//                        classifier-free guidance works (Ho & Salimans 2022).
//   3. train_classifier: a small CNN on the grey images, used only to measure prompt adherence of generations.
// All three use AdamW with linear warm-up and cosine decay, an EMA of the weights (used for the saved model),
// resumable checkpoints (<out>/checkpoint/) and a progress line with the running loss.
#pragma once

#include "unet/model/clip_text.h"
#include "unet/model/unet_model.h"
#include "unet/model/vae.h"
#include "unet/samplers/scheduler.h"

#include <torch/torch.h>

#include <functional>
#include <string>

namespace anchor::unet::train {

struct TrainOptions {
    std::string data_dir = "/usr/share/datasets/fashion-mnist";
    std::string out; // model folder (diffusers layout; train_unet reads <out>/vae)
    int steps = 1000;
    int batch = 64;
    double lr = 1e-3;
    int warmup = 100;
    double min_lr_fraction = 0.1; // cosine floor
    double weight_decay = 0.01;
    double ema = 0.999; // 0 disables the EMA
    double grad_clip = 1.0;
    int checkpoint_every = 200;
    int log_every = 20;
    bool resume = false;
    int64_t seed = 0;
    double caption_dropout = 0.1; // train_unet
    bool quiet = false;           // no progress line (tests)
};

struct TrainResult {
    int steps_done = 0;
    double first_loss = 0, final_loss = 0; // means over the first / last log_every steps
    double seconds = 0;
    std::string log_path; // <out>/train_<what>_log.txt: "step loss lr seconds" lines
    double metric = 0;    // classifier: test accuracy; vae: scaling factor; unet: 0
};

// Model shapes of the demo (also written as config.json).
VaeConfig fashion_vae_config();
UNetConfig fashion_unet_config();
ClipTextConfig fashion_text_config();
// The training schedule the UNet is trained on (SD's scaled-linear betas), run with DDIM by default.
SchedulerConfig fashion_scheduler_config();

TrainResult train_vae(const TrainOptions& o);
TrainResult train_unet(const TrainOptions& o);
TrainResult train_classifier(const TrainOptions& o); // writes <out>/classifier.safetensors

// The CNN of train_classifier: [B, 1, 32, 32] in [-1, 1] -> [B, 10] logits.
struct FashionClassifierImpl : torch::nn::Module {
    FashionClassifierImpl();
    torch::Tensor forward(const torch::Tensor& x);
    torch::nn::Conv2d conv1{nullptr}, conv2{nullptr}, conv3{nullptr};
    torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(FashionClassifier);
FashionClassifier load_fashion_classifier(const std::string& path);

} // namespace anchor::unet::train
