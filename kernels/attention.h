// Fused softmax attention for many small heads (CPU float32).
//
// Why: in a small UNet (the fashion demo: 8x8 latents, 32 channels, 4 heads of 8, batch 20 with guidance) each head's
// q k^T is a 64x8 by 8x77 product. torch::matmul turns the [B, H, N, D] x [B, H, D, M] product into a bmm that LibTorch
// 1.13 runs as one select + mm dispatch per (batch, head): 80 dispatches, then a softmax pass and a second bmm, plus
// the head permute copies. The arithmetic is a few tens of kFLOPs per head, so dispatch and copies are the cost; the
// shallow DeepCache/freq step pays it at full price (same head count, a seventh of the MACs). This kernel reads q, k, v
// in their [B, tokens, H*D] projection layout, keeps one head's K^T and V in a thread-local buffer, and computes
// scores, softmax and the weighted sum of V row by row, heads split over OpenMP threads.
//
// out[b, i, h*D + d] = sum_j softmax_j(scale * q[b,i,h,:] . k[b,j,h,:]) v[b, j, h*D + d]   (Vaswani et al. 2017, eq. 1)
//
// Large heads (SD 1.5 at 512x512: 4096x4096 scores of width 40) stay on BLAS: small_attention_applies() says which.
// The AVX2/FMA path (exp by a Cephes-style polynomial, ~1 ulp) is chosen at run time; the portable loop uses std::exp.
#pragma once

#include "cache/io/enum_table.h"

#include <torch/torch.h>

#include <cstdint>

namespace anchor::kernels {

// True where the fused kernel is used: float32 CPU, no autograd, at least kMinQueries queries, per-head work N*M*D at
// most kSmallAttentionWork (above it BLAS wins).
constexpr int64_t kSmallAttentionWork = int64_t(1) << 18;
constexpr int64_t kMinQueries = 8;
bool small_attention_applies(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t heads);

// q [B, N, H*D], k and v [B, M, H*D] (any strides with a unit last stride are copied as needed) -> [B, N, H*D].
// portable = true runs the plain-loop path even where AVX2 exists (tests check both).
torch::Tensor small_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t heads,
                              double scale, bool portable = false);
// The same through torch ops (permute, matmul, softmax, matmul): the reference tests compare against.
torch::Tensor attention_torch(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t heads,
                              double scale);

// ---- the entry point --------------------------------------------------------------------------------------------

// Which arithmetic attention() runs.
// * Exact: the reference's (attention_reference: diffusers' AttnProcessor on LibTorch), bit for bit, through
//   blas_attention where it is available. The tiny reference models amplify a last-bit difference ~1000x at their 1x1
//   levels (GroupNorm over 2 values), so only bit parity is inside their tolerance on every input.
// * Fused: the fused small-head kernel (small_attention) where it applies, else Exact. Other summation order and
//   exponential: within 2e-6 relative of the reference, faster for many small heads; for models whose outputs do
//   not hinge on the last bit.
// * Flash: the tiled online-softmax kernel (flash_attention) wherever it applies (>= 8 queries, any formulation and
//   layout, causal or no mask), else Exact. No N x M score buffer; within 2e-6 relative of the reference.
// * Reference: attention_reference itself (the module forwards' reference path).
// Fused is the fast choice: the small-head kernel where its heads are small, the tiled one elsewhere.
enum class AttentionKernel { Exact, Fused, Flash, Reference };

// Names for options and reports ("exact", "fused", "flash", "reference").
const EnumTable<AttentionKernel>& attention_kernel_table();

// Where the heads are.
enum class AttentionLayout {
    Projection, // q [B, N, H*D], k/v [B, M, H*D] -> [B, N, H*D]: heads side by side, as the projections give them
    Heads,      // q [B, H, N, D], k/v [B, H, M, D] -> [B, H, N, D]: GPT-2's KV cache, the MDLM block
};

// The arithmetic of the scores, one per model family, each reproducing that family's reference bit for bit (the
// products and roundings differ in order, so the last bits do too; the models' goldens hold to their own).
enum class ScoreFormula {
    // diffusers' AttnProcessor: baddbmm(q, k^T, beta 0, alpha = scale) into a zero-filled buffer, softmax, bmm. The
    // UNet and the VAE; the only formulation with the Fused kernel. Projection layout, no mask.
    Diffusers,
    // nanoGPT (GPT-2) and SEDD/MDLM: (q @ k^T) * scale, masked_fill(-inf) where masked, softmax, @ v.
    ScaleAfter,
    // Hugging Face CLIPAttention: (q * scale) @ k^T + additive mask, softmax, @ v (the query scaled before the heads
    // are split).
    PreScaledQuery,
};

struct AttentionOptions {
    int64_t heads = 1; // projection layout (the heads layout has them in q)
    double scale = -1; // < 0: head_dim^-0.5
    AttentionKernel kernel = AttentionKernel::Exact;
    int64_t chunk_bytes = int64_t(16) << 20; // score-buffer bound of the reference path's query chunks
    AttentionLayout layout = AttentionLayout::Projection;
    ScoreFormula formula = ScoreFormula::Diffusers;
    // Causal, aligned to the last key: query i sees keys j <= i + (M - N), i.e. every key for the last query, so the
    // same mask serves a full forward (M = N) and new tokens after the M - N a KV cache holds. Masked scores are set
    // to -inf with masked_fill (nanoGPT); a single query masks nothing (no mask is built).
    bool causal = false;
    // Added to the scores when defined (broadcast to [B, H, N, M]; e.g. CLIP's 0 / -inf causal mask), before `causal`.
    torch::Tensor additive_mask;
    // The tiled kernel (Flash, and Fused where it takes the tiled path) multiplies bfloat16 operands summed in float32
    // - q, k, v and the probabilities rounded to bfloat16, scores and softmax in float32 - where flash_bf16_available;
    // elsewhere ignored. For models run with bf16 linear layers (the UNet's and VAE's --gemm bf16).
    bool bf16_products = false;
};

// softmax(scores) @ v for q, k, v in `opts.layout`, with the formulation, mask and kernel of `opts`.
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const AttentionOptions& opts);

// The ScaleAfter and PreScaledQuery formulations (attention() runs these for them; matmul, softmax, matmul in torch
// ops, which is each family's reference arithmetic): `opts.formula` must be one of the two.
torch::Tensor attention_matmul(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const AttentionOptions& opts);

// ---- LibTorch's fused operator (kernels/attention_sdpa.cpp) ---------------------------------------------------------

// at::scaled_dot_product_attention (FlashAttention-2 / memory-efficient kernels on CUDA), chosen at compile time:
// available with LibTorch >= 2.1, never with 1.13. attention() runs it for the Fused and Flash choices where
// sdpa_applies(): tensors on a CUDA device, every formulation, layout and mask (the causal mask aligned to the last
// key, as `causal` says). Within rounding of the reference (another summation order; reduced precision is not upcast).
bool sdpa_available();
bool sdpa_applies(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const AttentionOptions& opts);
// The operator itself, on any device (tests run it on the CPU); an error naming the LibTorch version without it.
torch::Tensor sdpa_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const AttentionOptions& opts);

// ---- tiled online-softmax attention (kernels/flash_attention.cpp) -------------------------------------------------

// FlashAttention's tiling (Dao et al. 2022, Alg. 1) on the CPU: for each block of 64 queries and 192 keys, scores in a
// register tile, the running maximum and sum of the online softmax (Milakov & Gimelshein 2018), the output rescaled
// by e^(m_old - m_new) and P V added; float32 throughout, K^T and V packed once per head.
enum class FlashIsa { Avx512, Avx2, Portable };
const EnumTable<FlashIsa>& flash_isa_table();
FlashIsa flash_best_isa(); // what flash_attention runs by default on this CPU
bool flash_isa_available(FlashIsa isa);
// Whether opts.bf16_products takes effect: the AVX-512 path on a CPU with AVX512-BF16.
bool flash_bf16_available();
// float32 CPU tensors outside autograd, >= kMinQueries queries, no additive mask, in opts.layout.
bool flash_attention_applies(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const AttentionOptions& opts);
// softmax(scale q k^T [causal]) v in opts.layout (opts.formula only decides whether q is scaled before the product).
torch::Tensor flash_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const AttentionOptions& opts, FlashIsa isa = flash_best_isa());

// ---- exact paths ------------------------------------------------------------------------------------------------

// The reference: diffusers' AttnProcessor on LibTorch (heads folded into the batch, baddbmm(q, k^T, beta 0, alpha =
// scale) into a zero-filled buffer, softmax, bmm), queries chunked so the score buffer stays below `chunk_bytes`.
// q [B, N, H*D], k/v [B, M, H*D]; reduced precision is upcast to float32 for scores and softmax.
torch::Tensor attention_reference(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t heads,
                                  double scale, int64_t chunk_bytes = int64_t(256) << 20);
// The same arithmetic without the per-head dispatch (kernels/blas_attention.cpp): bit-identical to
// attention_reference where LibTorch's bmm runs on the BLAS sgemm this process resolved. Available when that sgemm
// is found and LibTorch does not use MKL; applies to float32 CPU tensors outside autograd.
bool blas_attention_available();
bool blas_attention_applies(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t heads);
torch::Tensor blas_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t heads,
                             double scale);

namespace detail {
// The checks every projection-layout kernel makes (TORCH_CHECK naming `kernel`): q [B, N, C], k and v [B, M, C],
// float32, C divisible by `heads`.
void check_projection_layout(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t heads,
                             const char* kernel);
// t itself when its rows are unit-stride and do not overlap, else a contiguous copy.
torch::Tensor unit_last(const torch::Tensor& t);
} // namespace detail

} // namespace anchor::kernels
