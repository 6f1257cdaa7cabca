// Small layer constructors shared by the image models (UNet parts, ControlNet, VAE, TAESD).
#pragma once

#include "cache/io/deferred_weights.h"

#include <torch/torch.h>

namespace anchor::unet {

// A 3x3 convolution with padding 1 (the "same" size at stride 1), as diffusers' nn.Conv2d(in, out, 3, padding=1);
// built deferred under a DeferredWeights scope (a model about to be loaded).
inline torch::nn::Conv2d conv3x3(int64_t in, int64_t out, int64_t stride = 1, bool bias = true) {
    return make_conv2d(torch::nn::Conv2dOptions(in, out, 3).stride(stride).padding(1).bias(bias));
}

} // namespace anchor::unet
