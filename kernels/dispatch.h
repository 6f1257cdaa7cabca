// Torch-facing entry points of the custom kernels: the plain-CUDA path (kernels/cuda/) runs only when the library
// was built with ANCHOR_WITH_CUDA (LibTorch with CUDA + nvcc) and the tensors are on a CUDA device; everything else
// goes to the CPU references (kernels/dct_energy.h, kernels/ring_write.h).
#pragma once

#include <torch/torch.h>

#include <cstdint>

namespace anchor::kernels {

// True when the CUDA kernels are compiled into this binary.
bool cuda_kernels_built();

// Per-coefficient orthonormal DCT-II energies of x [.., H, W]; float32 result on x's device.
torch::Tensor dct_energy(const torch::Tensor& x);

// Writes one token's K and V rows ([B, H, D] or [B, H, 1, D]) into slot `slot` of the [B, H, C, D] caches.
void ring_write(torch::Tensor& k_buf, torch::Tensor& v_buf, const torch::Tensor& k, const torch::Tensor& v,
                int64_t slot);

} // namespace anchor::kernels
