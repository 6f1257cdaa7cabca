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

inline torch::Tensor linear(const torch::nn::Linear& m, const torch::Tensor& x) {
    return at::linear(x, m->weight, m->bias.defined() ? c10::optional<torch::Tensor>(m->bias) : c10::nullopt);
}

} // namespace anchor::kernels
