// Multi-head attention that performs exactly the arithmetic of the reference path (attention_reference), without
// its per-head tensor dispatch.
//
// attention_reference is diffusers' AttnProcessor on LibTorch: heads folded into the batch, baddbmm for the scores,
// softmax, bmm. LibTorch runs baddbmm/bmm as one BLAS sgemm per (batch, head) (or, when the product has fewer than
// 400 multiply-adds, as a naive triple loop), each behind a select(), an addmm dispatch and the head permute copies.
// For many small heads that overhead is most of the time. This kernel makes the same sgemm calls itself (the same
// BLAS symbol LibTorch resolved, the same transpose flags, alpha, beta and sizes; only the leading dimensions differ,
// because it reads q/k/v in their [B, tokens, H*D] projection layout and writes the output there) and runs the same
// softmax operator once over every head's scores. So its result is bit-identical to the reference path wherever
// LibTorch's bmm goes to that sgemm (tests/test_kernels.cpp checks it on random shapes), and the tiny reference
// models, whose 1x1 levels amplify a last-bit difference about 1000x, see no difference at all.
#include "kernels/attention.h"
#include "kernels/op_timing.h"

#include <ATen/Context.h>

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace anchor::kernels {

namespace {

// Fortran BLAS sgemm, as LibTorch's cpublas::gemm calls it (column-major).
using SgemmFn = void (*)(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                         const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                         const float* beta, float* c, const int* ldc);

SgemmFn resolve_sgemm() {
    // LibTorch links the system BLAS (Debian: libblas.so.3, OpenBLAS); its symbols are in the global scope. A LibTorch
    // with MKL runs bmm through MKL's batched gemm instead, so there the kernel would not be the reference's.
    if (at::hasMKL()) return nullptr;
    return reinterpret_cast<SgemmFn>(dlsym(RTLD_DEFAULT, "sgemm_"));
}

SgemmFn sgemm() {
    static const SgemmFn f = resolve_sgemm();
    return f;
}

// LibTorch's bmm/baddbmm use a naive loop instead of BLAS below this many multiply-adds per (batch, head) product
// (aten/src/ATen/native/LinearAlgebra.cpp, bmm_out_or_baddbmm_).
constexpr int64_t kNaiveBmmWork = 400;

// The naive kernel's arithmetic: baddbmm with beta 0 into a zero-filled result accumulates alpha * a * b term by term;
// bmm accumulates a * b. No fused multiply-add: LibTorch compiles that loop for baseline x86-64. GCC takes the
// optimize attribute; clang ignores it and takes the fp pragma in the body.
#if defined(__clang__)
#define ANCHOR_NO_FP_CONTRACT
#define ANCHOR_NO_FP_CONTRACT_BODY _Pragma("clang fp contract(off)")
#else
#define ANCHOR_NO_FP_CONTRACT __attribute__((optimize("fp-contract=off")))
#define ANCHOR_NO_FP_CONTRACT_BODY
#endif
ANCHOR_NO_FP_CONTRACT void naive_scores(const float* q, int64_t qs, const float* k, int64_t ks, float* s, int64_t N,
                                        int64_t M, int64_t D, float alpha) {
    ANCHOR_NO_FP_CONTRACT_BODY
    for (int64_t i = 0; i < N; ++i)
        for (int64_t j = 0; j < M; ++j) {
            float r = 0.f;
            for (int64_t d = 0; d < D; ++d) r += alpha * q[i * qs + d] * k[j * ks + d];
            s[i * M + j] = r;
        }
}

ANCHOR_NO_FP_CONTRACT void naive_output(const float* p, const float* v, int64_t vs, float* o, int64_t os, int64_t N,
                                        int64_t M, int64_t D) {
    ANCHOR_NO_FP_CONTRACT_BODY
    for (int64_t i = 0; i < N; ++i)
        for (int64_t d = 0; d < D; ++d) {
            float r = 0.f;
            for (int64_t j = 0; j < M; ++j) r += p[i * M + j] * v[j * vs + d];
            o[i * os + d] = r;
        }
}
#undef ANCHOR_NO_FP_CONTRACT
#undef ANCHOR_NO_FP_CONTRACT_BODY

} // namespace

bool blas_attention_available() {
    return sgemm() != nullptr;
}

bool blas_attention_applies(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t heads) {
    if (!blas_attention_available() || q.dim() != 3 || k.dim() != 3 || v.dim() != 3 || heads < 1 ||
        q.size(2) % heads != 0)
        return false;
    for (const auto* t : {&q, &k, &v})
        if (!t->device().is_cpu() || t->scalar_type() != torch::kFloat) return false;
    if (torch::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad())) return false;
    // Head width 1: OpenBLAS' SkylakeX/Cooperlake kernels take a K = 1 product on another path than the one
    // LibTorch's baddbmm call reaches, so the bits differ; the reference runs it.
    if (q.size(2) / heads == 1) return false;
    // BLAS sizes are Fortran ints.
    const int64_t lim = int64_t(1) << 30;
    return q.size(1) < lim && k.size(1) < lim && q.size(2) < lim && q.size(0) * heads < lim;
}

torch::Tensor blas_attention(const torch::Tensor& q_, const torch::Tensor& k_, const torch::Tensor& v_, int64_t heads,
                             double scale) {
    TORCH_CHECK(blas_attention_available(), "blas_attention: no BLAS sgemm shared with LibTorch");
    detail::check_projection_layout(q_, k_, v_, heads, "blas_attention");
    const int64_t B = q_.size(0), N = q_.size(1), C = q_.size(2), M = k_.size(1);
    const auto q = detail::unit_last(q_), k = detail::unit_last(k_), v = detail::unit_last(v_);
    auto out = torch::empty({B, N, C}, q.options().memory_format(torch::MemoryFormat::Contiguous));
    if (B == 0 || N == 0) return out;
    if (M == 0) return out.zero_(); // bmm over an empty contraction
    const int64_t D = C / heads, BH = B * heads;
    const bool naive = N * M * D < kNaiveBmmWork;
    // Heads are processed in groups whose scores fit a few MiB (they are written, soft-maxed and read back).
    const int64_t group = std::max<int64_t>(1, std::min<int64_t>(BH, (int64_t(4) << 20) / (4 * N * M)));
    auto scores = torch::empty({std::min(group, BH), N, M}, q.options());
    auto probs = torch::empty_like(scores);
    const float* qp = q.data_ptr<float>();
    const float* kp = k.data_ptr<float>();
    const float* vp = v.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const SgemmFn gemm = sgemm();
    const float alpha = float(scale), one = 1.f, zero = 0.f;
    const int iN = int(N), iM = int(M), iD = int(D), ldq = int(q.stride(1)), ldk = int(k.stride(1)),
              ldv = int(v.stride(1)), ldo = int(C);
    for (int64_t g0 = 0; g0 < BH; g0 += group) {
        const int64_t gn = std::min(group, BH - g0);
        // One head after another, as LibTorch's bmm does: OpenBLAS splits a product over its threads the same way
        // for the same call only, and how it splits decides which edge kernels sum which elements. (Inside an OpenMP
        // region it would run single-threaded: other bits for the products it would have split.)
        float* sp = scores.data_ptr<float>();
        for (int64_t g = 0; g < gn; ++g) {
            const int64_t bi = (g0 + g) / heads, h = (g0 + g) % heads;
            const float* qh = qp + bi * q.stride(0) + h * D;
            const float* kh = kp + bi * k.stride(0) + h * D;
            float* s = sp + g * N * M;
            // Column-major view of row-major S [N, M] = q k^T: S^T (M x N) = (k [M,D] as D x M)^T (q as D x N).
            if (naive)
                naive_scores(qh, ldq, kh, ldk, s, N, M, D, alpha);
            else
                gemm("T", "N", &iM, &iN, &iD, &alpha, kh, &ldk, qh, &ldq, &zero, s, &iM);
        }
        auto s_view = scores.narrow(0, 0, gn), p_view = probs.narrow(0, 0, gn);
        at::_softmax_out(p_view, s_view, -1, false);
        const float* pp = probs.data_ptr<float>();
        for (int64_t g = 0; g < gn; ++g) {
            const int64_t bi = (g0 + g) / heads, h = (g0 + g) % heads;
            const float* vh = vp + bi * v.stride(0) + h * D;
            const float* p = pp + g * N * M;
            float* o = op + bi * N * C + h * D;
            // O^T (D x N) = V^T (D x M, column-major view of v [M, D]) P^T (M x N).
            if (naive)
                naive_output(p, vh, ldv, o, ldo, N, M, D);
            else
                gemm("N", "N", &iD, &iN, &iM, &one, vh, &ldv, p, &iM, &zero, o, &ldo);
        }
    }
    return out;
}

const EnumTable<AttentionKernel>& attention_kernel_table() {
    static const EnumTable<AttentionKernel> t = {{"exact", AttentionKernel::Exact},
                                                 {"fused", AttentionKernel::Fused},
                                                 {"flash", AttentionKernel::Flash},
                                                 {"reference", AttentionKernel::Reference}};
    return t;
}

torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const AttentionOptions& o) {
    ScopedOpTime timed("attention", [&](std::string& shape, double& macs) {
        // q k^T and p v; [B, N, H*D] (projection) or [B, H, N, D] (heads).
        const bool proj = o.layout == AttentionLayout::Projection;
        const int64_t B = q.size(0), H = proj ? o.heads : q.size(1), N = q.size(proj ? 1 : 2),
                      D = proj ? q.size(2) / std::max<int64_t>(o.heads, 1) : q.size(3), M = k.size(proj ? 1 : 2);
        shape = std::to_string(B) + "x" + std::to_string(H) + " heads, " + std::to_string(N) + " x " +
                std::to_string(M) + " tokens, head " + std::to_string(D);
        macs = 2.0 * double(B) * double(H) * double(N) * double(M) * double(D);
    });
    const bool tiled = o.kernel == AttentionKernel::Fused || o.kernel == AttentionKernel::Flash;
    if (tiled && sdpa_applies(q, k, v, o)) return sdpa_attention(q, k, v, o);
    if (o.formula != ScoreFormula::Diffusers)
        return tiled && flash_attention_applies(q, k, v, o) ? flash_attention(q, k, v, o)
                                                            : attention_matmul(q, k, v, o);
    TORCH_CHECK(o.layout == AttentionLayout::Projection && !o.causal && !o.additive_mask.defined(),
                "attention: the diffusers formulation takes the projection layout and no mask");
    TORCH_CHECK(q.dim() == 3 && o.heads >= 1 && q.size(2) % o.heads == 0, "attention: q ", q.sizes(),
                " is not [B, tokens, heads * head_dim] for ", o.heads, " heads");
    const double scale = o.scale >= 0 ? o.scale : 1.0 / std::sqrt(double(q.size(2) / o.heads));
    if (o.kernel == AttentionKernel::Fused && small_attention_applies(q, k, v, o.heads))
        return small_attention(q, k, v, o.heads, scale);
    if (tiled && flash_attention_applies(q, k, v, o)) {
        AttentionOptions f = o;
        f.scale = scale;
        return flash_attention(q, k, v, f);
    }
    if (o.kernel != AttentionKernel::Reference && blas_attention_applies(q, k, v, o.heads))
        return blas_attention(q, k, v, o.heads, scale);
    return attention_reference(q, k, v, o.heads, scale, o.chunk_bytes);
}

torch::Tensor attention_reference(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t heads,
                                  double scale, int64_t chunk_bytes) {
    const int64_t B = q.size(0), N = q.size(1), C = q.size(2), M = k.size(1);
    TORCH_CHECK(heads >= 1 && C % heads == 0, "attention: width ", C, " not divisible by ", heads, " heads");
    const int64_t D = C / heads;
    const bool reduced = q.scalar_type() != torch::kFloat && q.scalar_type() != torch::kDouble;
    auto to_heads = [&](const torch::Tensor& t, int64_t n) {
        return t.reshape({B, n, heads, D}).permute({0, 2, 1, 3}).reshape({B * heads, n, D});
    };
    auto qh = to_heads(q, N), kh = to_heads(k, M), vh = to_heads(v, M);
    if (reduced) { // upcast scores and softmax, as diffusers' upcast_attention / upcast_softmax do
        qh = qh.to(torch::kFloat);
        kh = kh.to(torch::kFloat);
    }
    auto probs_of = [&](const torch::Tensor& qc) {
        // beta = 0 into a zero-filled result: LibTorch 1.13's naive small-matrix baddbmm does not ignore NaN in an
        // uninitialised output buffer.
        auto s = torch::zeros({qc.size(0), qc.size(1), M}, qc.options());
        s.baddbmm_(qc, kh.transpose(1, 2), /*beta=*/0.0, /*alpha=*/scale);
        auto p = s.softmax(-1);
        return reduced ? p.to(v.scalar_type()) : p;
    };
    auto merge_heads = [&](const torch::Tensor& o) { // [B*H, N, D] -> [B, N, H*D]
        return o.reshape({B, heads, N, D}).permute({0, 2, 1, 3}).reshape({B, N, C});
    };
    const int64_t per_query = B * heads * M * 4;
    const int64_t chunk = std::max<int64_t>(1, chunk_bytes / std::max<int64_t>(per_query, 1));
    if (chunk >= N) return merge_heads(torch::bmm(probs_of(qh), vh));
    auto out = torch::empty({B * heads, N, D}, v.options());
    for (int64_t s = 0; s < N; s += chunk) {
        const int64_t n = std::min(chunk, N - s);
        out.narrow(1, s, n).copy_(torch::bmm(probs_of(qh.narrow(1, s, n)), vh));
    }
    return merge_heads(out);
}

} // namespace anchor::kernels
