// GEGLU's gate in one pass (Shazeer 2020, "GLU Variants Improve Transformer"; diffusers' GEGLU, the feed-forward of
// every SD transformer block): for h [..., 2F], out [..., F] = h[..., :F] * GELU(h[..., F:]) with the erf form
// GELU(x) = x / 2 (1 + erf(x / sqrt 2)).
//
// Why: LibTorch runs it as chunk, gelu and mul: its erf (Sleef's) costs ~10 ns a value on this machine and the
// product is a third full-size tensor, ~4 % of an SD 1.5 step at 256x256 (anchor-sd bench --op-table). Here erf is
// Abramowitz & Stegun 7.1.26, 1 - erf|z| = P(t) e^(-z^2) with t = 1 / (1 + p|z|), absolute error <= 1.5e-7 (one
// float32 ulp near 1 is 6e-8), the exponential kernels/simd_math.h's; 1 + erf(z) is formed as P e^(-z^2) for z < 0,
// so GELU of a large negative x goes smoothly to 0. tests/test_kernels.cpp checks it against geglu_torch.
#pragma once

#include <torch/torch.h>

namespace anchor::kernels {

// float32, contiguous, CPU, an even last dimension, no autograd.
bool geglu_applies(const torch::Tensor& h);
torch::Tensor geglu(const torch::Tensor& h);
// chunk(2, -1), gelu, mul through LibTorch: the reference.
torch::Tensor geglu_torch(const torch::Tensor& h);

} // namespace anchor::kernels
