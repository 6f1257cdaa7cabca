// GroupNorm (Wu & He 2018) followed by SiLU, computed in the input's own storage: the statistics in one pass over x,
// then the per-channel affine map and SiLU in place. LibTorch's GroupNorm writes a new tensor of x's size (at SD's
// VAE decoder's 256-channel 512x512 level, 256 MiB live beside x) and, on channels-last input, sums in strided order.
#pragma once

#include <torch/torch.h>

namespace anchor::kernels {

// x <- silu(group_norm(x, groups, weight, bias, eps)) for a float32 CPU x [N, C, ...] that is contiguous or
// channels-last; weight and bias [C] (or undefined: no affine map). Sums in double; the result differs from
// LibTorch's GroupNorm in the last bits (another summation order; tests/test_onednn.cpp bounds it). Returns x.
torch::Tensor group_norm_silu_(torch::Tensor x, int64_t groups, const torch::Tensor& weight, const torch::Tensor& bias,
                               double eps);

} // namespace anchor::kernels
