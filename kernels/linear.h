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

// A weight stored in reduced precision (float16/bfloat16, SD's --weights-dtype) under a float32 input is upcast here,
// at use: the model keeps no float32 copy. Float32 weights take the plain call, as before.
inline torch::Tensor linear(const torch::nn::Linear& m, const torch::Tensor& x) {
    const auto bias = m->bias.defined() ? c10::optional<torch::Tensor>(m->bias) : c10::nullopt;
    const auto w = m->weight.scalar_type();
    if (x.scalar_type() == torch::kFloat && (w == torch::kHalf || w == torch::kBFloat16))
        return at::linear(x, m->weight.to(torch::kFloat), bias);
    return at::linear(x, m->weight, bias);
}

} // namespace anchor::kernels
