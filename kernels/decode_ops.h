// The non-matrix operations of a batch-1 transformer decode step on raw float32 rows: layer norm, GELU and one query
// attending over a KV buffer. At batch 1 each is a few thousand flops, so the LibTorch dispatch, allocation and view
// bookkeeping of the tensor forms (~10 ops per layer norm + attention) cost more than the arithmetic; these run the
// arithmetic in place. AVX-512 where the CPU has it (exponential: kernels/simd_math.h), else plain loops; the
// `_ref` forms are the plain loops, which tests compare against the tensor operations and the fast forms.
#pragma once

#include <cstdint>

namespace anchor::kernels {

// y = (x - mean) / sqrt(var + eps) * g + b over n values (biased variance, as torch::layer_norm). y may be x; b may
// be null (no bias).
void layer_norm_row(const float* x, const float* g, const float* b, float* y, int64_t n, float eps);

// In place: GELU with the tanh approximation (Hendrycks & Gimpel 2016; GPT-2's gelu_new) or the erf form.
void gelu_tanh_row(float* x, int64_t n);
void gelu_tanh_row_ref(float* x, int64_t n);
void gelu_erf_row(float* x, int64_t n);

// One query per head over `len` cached keys/values: out[h*D + d] = sum_j softmax_j(scale * q_h . k_hj) v_hj[d], with
// q and out [heads * head_dim] and k, v holding head h's slot j at h * head_stride + j * head_dim (a [heads, slots,
// head_dim] buffer of which the first `len` slots are attended). Heads split over OpenMP threads when the work is
// large enough to pay for the fork.
void attend_one_query(const float* q, const float* k, const float* v, float* out, int64_t heads, int64_t head_dim,
                      int64_t len, int64_t head_stride, float scale);
void attend_one_query_ref(const float* q, const float* k, const float* v, float* out, int64_t heads, int64_t head_dim,
                          int64_t len, int64_t head_stride, float scale);

} // namespace anchor::kernels
