// Operations on a few rows of a long sequence: the work of a cached diffusion-LM step (text/diffusion/mdlm_cache.h), where a
// layer recomputes a handful of positions and reads every other position's keys and values from the cache.
//
// Why: at that size LibTorch's per-op cost (dispatch, allocation, a BLAS call that packs its operands) outweighs the
// arithmetic. The batched attention of 12 queries over 256 keys of 6 heads runs as two bmm calls plus a softmax, the
// norm-and-modulate of the adaLN block as five element-wise ops. These do each in one pass over raw float32 memory.
// Each has a reference through torch ops that the tests compare against (tests/test_row_ops.cpp).
#pragma once

#include "kernels/gemv.h" // SimdPath

#include <torch/torch.h>

#include <cstdint>

namespace anchor::kernels {

// out[i] = LayerNorm(x[rows[i]]) * weight * (1 + scale) + shift: the modulated norm of an adaLN block (DiT, Peebles &
// Xie 2023, eq. "adaLN"), without the norm's bias. x [L, D] with unit-stride rows; rows int64 [n] (undefined: every
// row); weight, scale and shift hold D values with a unit last stride (the [1, 1, D] chunks of a modulation). The norm
// is kernels::layer_norm_row's (mean and variance summed in double). Returns [n, D].
torch::Tensor modulated_norm_rows(const torch::Tensor& x, const torch::Tensor& rows, const torch::Tensor& weight,
                                  const torch::Tensor& scale, const torch::Tensor& shift, double eps);
// The same through torch ops (index_select, layer_norm, mul, add): the reference.
torch::Tensor modulated_norm_rows_torch(const torch::Tensor& x, const torch::Tensor& rows, const torch::Tensor& weight,
                                        const torch::Tensor& scale, const torch::Tensor& shift, double eps);

// out[i] = x[i] + gate * branch[rows[i]]: a gated residual of an adaLN block whose branch output is cached for the
// whole sequence and x holds some of its positions. x and out [u, D] contiguous (out may be x), gate D values with a
// unit last stride, branch [L, D] contiguous, rows int64 [u] (undefined: row i of branch, u = L). One pass instead of a
// gather, a product and a sum.
void gated_add_rows(const torch::Tensor& x, const torch::Tensor& gate, const torch::Tensor& branch,
                    const torch::Tensor& rows, const torch::Tensor& out);

// out[i, h*d : (h+1)*d] = sum_j softmax_j(scale * q[h, i] . k[h, j]) v[h, j] (Vaswani et al. 2017, eq. 1) for a few
// queries: q [H, n, d], k and v [H, M, d], each with a unit last stride; returns [n, H*d], the heads side by side as
// the output projection takes them. Bidirectional (no mask). The AVX2/FMA path scores eight keys per pass (one
// horizontal-add tree for the eight dot products) and uses the Cephes exponential of kernels/simd_math.h; the
// portable path plain loops. Float32 sums: within ~1e-6 relative of the matmul-softmax-matmul reference.
bool few_query_attention_applies(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v);
torch::Tensor few_query_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double scale,
                                  SimdPath path = SimdPath::Best);
// The reference: matmul, softmax, matmul, heads merged.
torch::Tensor few_query_attention_torch(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                        double scale);

} // namespace anchor::kernels
