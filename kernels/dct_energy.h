// CPU reference for the batched 2-D DCT energy kernel (kernels/cuda/dct_energy.cu): per-coefficient energies
// E(u, v) = X(u, v)^2 of the orthonormal DCT-II of each [H, W] map, computed in float64 with the DCT basis matrices
// built from their definition (an independent method from the GPU's FFT route, so the two check each other).
#pragma once

#include <torch/torch.h>

namespace anchor::kernels {

// x [.., H, W] (any floating dtype, CPU) -> float32 energies of the same shape.
torch::Tensor dct_energy_cpu(const torch::Tensor& x);

} // namespace anchor::kernels
