// Bandwidth-bound matrix-vector product for batch-1 decoding: y = W x + b with W row-major [rows, cols] in float32 or
// float16. At batch 1 every weight byte is read once per token, so decode speed is memory bandwidth / weight bytes;
// the kernel streams rows with AVX2/FMA (F16C widening for f16 weights) and splits rows over OpenMP threads.
// The AVX2 path is chosen at run time (kernels/cpu_features.h); the portable reference path is always available.
#pragma once

#include <torch/torch.h>

#include <cstdint>

namespace anchor::kernels {

// Plain loops (double accumulation): the reference the fast path is tested against.
void gemv_ref_f32(const float* w, const float* x, const float* b, float* y, int64_t rows, int64_t cols);
void gemv_ref_f16(const uint16_t* w, const float* x, const float* b, float* y, int64_t rows, int64_t cols);
// Fast path (AVX2 when the CPU has it, else the portable loop), OpenMP over rows. `b` may be null.
void gemv_f32(const float* w, const float* x, const float* b, float* y, int64_t rows, int64_t cols);
void gemv_f16(const uint16_t* w, const float* x, const float* b, float* y, int64_t rows, int64_t cols);
bool gemv_uses_avx2();

// Tensor form: w [rows, cols] contiguous CPU float32/float16, x [cols] float32, bias [rows] or undefined.
// Other dtypes/devices fall back to torch::addmv. Returns y [rows] float32.
torch::Tensor gemv(const torch::Tensor& w, const torch::Tensor& x, const torch::Tensor& bias = {});
// The same through torch::mv / addmv (reference for tests and benchmarks).
torch::Tensor gemv_torch(const torch::Tensor& w, const torch::Tensor& x, const torch::Tensor& bias = {});

} // namespace anchor::kernels
