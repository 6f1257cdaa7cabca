// LibTorch's fused attention operator behind attention() (kernels/attention.h, sdpa_attention).
//
// Why: on a GPU, at::scaled_dot_product_attention (LibTorch >= 2.1) picks FlashAttention-2 (Dao 2023) or the
// memory-efficient kernel (Rabe & Staats 2021) for the shape and dtype; neither writes the N x M score matrix to
// global memory, where the reference path writes, soft-maxes and re-reads it (4096 x 4096 per head at SD 1.5's
// 512x512). Its formula is the same softmax(scale q k^T + mask) v (Vaswani et al. 2017, eq. 1); only the summation
// order differs, so it serves the Fused and Flash choices (not Exact). LibTorch 1.13 has no such operator: there this
// file compiles to sdpa_available() == false and attention() keeps its own paths.
#include "kernels/attention.h"

#include <torch/version.h>

#include <cmath>
#include <optional>

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
#define ANCHOR_HAVE_SDPA 1
#else
#define ANCHOR_HAVE_SDPA 0
#endif

namespace anchor::kernels {

bool sdpa_available() {
    return ANCHOR_HAVE_SDPA;
}

bool sdpa_applies(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                  const AttentionOptions& o) {
    if (!sdpa_available()) return false;
    if (o.kernel != AttentionKernel::Fused && o.kernel != AttentionKernel::Flash) return false;
    const int64_t rank = o.layout == AttentionLayout::Projection ? 3 : 4;
    if (q.dim() != rank || k.dim() != rank || v.dim() != rank) return false;
    if (rank == 3 && (o.heads < 1 || q.size(2) % o.heads != 0)) return false;
    if (q.device() != k.device() || q.device() != v.device()) return false;
    if (q.scalar_type() != k.scalar_type() || q.scalar_type() != v.scalar_type()) return false;
    // The CPU keeps the project's kernels: small_attention and the tiled flash_attention measured faster than
    // LibTorch's CPU operator on the UNet's and GPT-2's main shapes (anchor_tests "[.sdpa-perf]"; the operator won
    // only on one-head 512-wide VAE mid-block attention, which is not switched: its goldens are checked as they are).
    // tests/test_attention_sdpa.cpp checks the operator on the CPU against the reference all the same.
    return q.is_cuda();
}

torch::Tensor sdpa_attention(const torch::Tensor& q_in, const torch::Tensor& k_in, const torch::Tensor& v_in,
                             const AttentionOptions& o) {
#if ANCHOR_HAVE_SDPA
    const bool projection = o.layout == AttentionLayout::Projection;
    const int64_t rank = projection ? 3 : 4;
    TORCH_CHECK(q_in.dim() == rank && k_in.dim() == rank && v_in.dim() == rank, "sdpa_attention: q, k, v must be ",
                projection ? "[B, tokens, heads * head_dim]" : "[B, heads, tokens, head_dim]", ", got q ", q_in.sizes(),
                ", k ", k_in.sizes(), ", v ", v_in.sizes());
    const int64_t B = q_in.size(0), N = q_in.size(rank - 2), M = k_in.size(rank - 2);
    const int64_t H = projection ? o.heads : q_in.size(1);
    TORCH_CHECK(H >= 1 && (!projection || q_in.size(2) % H == 0), "sdpa_attention: width ", q_in.size(-1),
                " not divisible by ", H, " heads");
    const int64_t D = projection ? q_in.size(2) / H : q_in.size(3);
    const double scale = o.scale >= 0 ? o.scale : 1.0 / std::sqrt(double(D));
    auto heads = [&](const torch::Tensor& t, int64_t n) {
        return projection ? t.reshape({B, n, H, D}).transpose(1, 2) : t;
    };
    const auto q = heads(q_in, N), k = heads(k_in, M), v = heads(v_in, M);
    // The operator's is_causal aligns the mask to the first key (query i sees j <= i); ours aligns it to the last
    // (j <= i + M - N, new tokens after a KV cache), the same only when N == M. A single query masks nothing.
    bool is_causal = false;
    torch::Tensor mask = o.additive_mask;
    if (o.causal && N > 1) {
        if (N == M && !mask.defined()) {
            is_causal = true;
        } else {
            auto key = torch::arange(M, torch::kLong).view({1, M});
            auto last = (torch::arange(N, torch::kLong) + (M - N)).view({N, 1});
            auto blocked = (key > last).to(q.device());
            auto additive = torch::zeros({N, M}, q.options()).masked_fill(blocked, -INFINITY);
            mask = mask.defined() ? mask.to(q.scalar_type()) + additive : additive;
        }
    }
    if (mask.defined()) mask = mask.to(q.device(), q.scalar_type());
    // The PreScaledQuery formulation scales q before the product and the others the product: the same value up to
    // rounding, which the Fused / Flash choices allow.
    // No mask is an empty optional: an undefined tensor in it is refused as a mask of no dtype.
    const auto attn_mask = mask.defined() ? std::optional<torch::Tensor>(mask) : std::nullopt;
    auto out = at::scaled_dot_product_attention(q, k, v, attn_mask, 0.0, is_causal, scale);
    return projection ? out.transpose(1, 2).reshape({B, N, H * D}) : out;
#else
    (void)q_in, (void)k_in, (void)v_in, (void)o;
    TORCH_CHECK(false, "sdpa_attention: this LibTorch (", TORCH_VERSION, ") has no scaled_dot_product_attention");
#endif
}

} // namespace anchor::kernels
