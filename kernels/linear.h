// y = x W^T + b exactly as PyTorch's Python `F.linear` computes it (at::linear).
//
// Why not `torch::nn::Linear::forward`: LibTorch's C++ functional `linear` (torch/nn/functional/linear.h, 1.13) fuses
// the bias only for 2-D inputs and otherwise runs matmul, then adds the bias, while at::linear also fuses it for
// contiguous 3-D inputs (addmm with C = bias). Where BLAS splits the inner dimension into blocks the two round
// differently, and the reference implementations (diffusers, nanoGPT) run in Python: every module forward that must
// match them goes through this.
#pragma once

#include <torch/torch.h>

namespace anchor::kernels {

// A weight stored in reduced precision (float16/bfloat16, SD's --weights-dtype) under a float32 input is upcast at
// use: the model keeps no float32 copy.
inline bool upcast_at_use(const torch::Tensor& w, const torch::Tensor& x) {
    return x.scalar_type() == torch::kFloat && (w.scalar_type() == torch::kHalf || w.scalar_type() == torch::kBFloat16);
}

// The weight a computation on x reads: w, or its float32 upcast (upcast_at_use).
inline torch::Tensor weight_for(const torch::Tensor& w, const torch::Tensor& x) {
    return upcast_at_use(w, x) ? w.to(torch::kFloat) : w;
}

// Float32 weights take the plain call; reduced-precision ones are upcast here (upcast_at_use).
inline torch::Tensor linear(const torch::nn::Linear& m, const torch::Tensor& x) {
    const auto bias = m->bias.defined() ? c10::optional<torch::Tensor>(m->bias) : c10::nullopt;
    return at::linear(x, weight_for(m->weight, x), bias);
}

} // namespace anchor::kernels
