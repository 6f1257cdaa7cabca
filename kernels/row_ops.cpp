#include "kernels/row_ops.h"

#include "kernels/decode_ops.h"
#include "kernels/simd_math.h"

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace anchor::kernels {

namespace {

// D values of a [..., D] tensor with a unit last stride (a modulation chunk [1, 1, D] is a view into [1, 1, kD]).
const float* vector_of(const torch::Tensor& t, int64_t D, const char* what) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat && t.numel() == D && t.stride(-1) == 1,
                "row ops: ", what, " must hold ", D, " float32 values with a unit last stride, got ", t.sizes(), " ",
                t.scalar_type());
    return t.data_ptr<float>();
}

} // namespace

torch::Tensor modulated_norm_rows(const torch::Tensor& x, const torch::Tensor& rows, const torch::Tensor& weight,
                                  const torch::Tensor& scale, const torch::Tensor& shift, double eps) {
    TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.scalar_type() == torch::kFloat && x.stride(1) == 1,
                "modulated_norm_rows: x must be float32 [L, D] with unit-stride rows, got ", x.sizes());
    const int64_t L = x.size(0), D = x.size(1);
    const bool all = !rows.defined();
    TORCH_CHECK(all || (rows.dim() == 1 && rows.scalar_type() == torch::kInt64 && rows.is_contiguous()),
                "modulated_norm_rows: rows must be int64 [n]");
    const int64_t n = all ? L : rows.size(0);
    const float *w = vector_of(weight, D, "weight"), *sc = vector_of(scale, D, "scale"),
                *sh = vector_of(shift, D, "shift");
    const int64_t* idx = all ? nullptr : rows.data_ptr<int64_t>();
    auto out = torch::empty({n, D}, x.options());
    const float* xp = x.data_ptr<float>();
    float* op = out.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) {
        const int64_t r = all ? i : idx[i];
        TORCH_CHECK(r >= 0 && r < L, "modulated_norm_rows: row ", r, " out of range [0, ", L, ")");
        float* o = op + i * D;
        layer_norm_row(xp + r * x.stride(0), w, nullptr, o, D, static_cast<float>(eps));
        for (int64_t c = 0; c < D; ++c) o[c] = o[c] * (1.f + sc[c]) + sh[c];
    }
    return out;
}

torch::Tensor modulated_norm_rows_torch(const torch::Tensor& x, const torch::Tensor& rows, const torch::Tensor& weight,
                                        const torch::Tensor& scale, const torch::Tensor& shift, double eps) {
    const int64_t D = x.size(1);
    auto xr = rows.defined() ? x.index_select(0, rows) : x;
    return torch::layer_norm(xr, {D}, weight.reshape({D}), {}, eps) * (1 + scale.reshape({D})) + shift.reshape({D});
}

void gated_add_rows(const torch::Tensor& x, const torch::Tensor& gate, const torch::Tensor& branch,
                    const torch::Tensor& rows, const torch::Tensor& out) {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat && x.device().is_cpu() &&
                    out.sizes() == x.sizes() && out.is_contiguous() && out.scalar_type() == torch::kFloat &&
                    branch.dim() == 2 && branch.is_contiguous() && branch.scalar_type() == torch::kFloat &&
                    branch.size(1) == x.size(1),
                "gated_add_rows: x and out [u, D], branch [L, D], contiguous float32, got x ", x.sizes(), ", out ",
                out.sizes(), ", branch ", branch.sizes());
    const int64_t u = x.size(0), D = x.size(1), L = branch.size(0);
    const bool all = !rows.defined();
    TORCH_CHECK(
        all ? u == L
            : (rows.dim() == 1 && rows.size(0) == u && rows.scalar_type() == torch::kInt64 && rows.is_contiguous()),
        "gated_add_rows: rows must be int64 [", u, "]");
    const float* g = vector_of(gate, D, "gate");
    const float *xp = x.data_ptr<float>(), *bp = branch.data_ptr<float>();
    const int64_t* rp = all ? nullptr : rows.data_ptr<int64_t>();
    float* op = out.data_ptr<float>();
    for (int64_t i = 0; i < u; ++i) {
        const int64_t r = all ? i : rp[i];
        TORCH_CHECK(r >= 0 && r < L, "gated_add_rows: row ", r, " out of range [0, ", L, ")");
        const float *xi = xp + i * D, *bi = bp + r * D;
        float* oi = op + i * D;
        for (int64_t c = 0; c < D; ++c) oi[c] = xi[c] + g[c] * bi[c];
    }
}

// ---- attention ------------------------------------------------------------------------------------------------------

namespace {

// Below this many queries the scores take the horizontal-add loop, from it on the product kernel.
constexpr int64_t kFewQueries = 4;

struct HeadArgs {
    const float *q, *k, *v; // q [n, d] and k [M, d] contiguous; v rows vs apart
    int64_t vs;
    float* o; // output row i at o + i * os
    int64_t os, n, M, d;
    float scale;
};

// Scores s [n, M] = scale * q k^T: the products through kernels::gemm_few_rows_f32 (the keys play the weight rows: each
// read once for all the queries), then the scale.
void scores(const HeadArgs& a, float* s, SimdPath path) {
    gemm_few_rows_f32(a.k, a.q, nullptr, s, a.n, a.M, a.d, path);
    for (int64_t i = 0; i < a.n * a.M; ++i) s[i] *= a.scale;
}

// Softmax of each score row in place, unnormalised: s = e^(s - max); returns nothing, writes the row sums to `sums`.
void softmax_rows_portable(float* s, float* sums, int64_t n, int64_t M) {
    for (int64_t i = 0; i < n; ++i) {
        float* r = s + i * M;
        const float mx = *std::max_element(r, r + M);
        float sum = 0.f;
        for (int64_t j = 0; j < M; ++j) sum += (r[j] = std::exp(r[j] - mx));
        sums[i] = sum;
    }
}

// o = (e v) / sum, one query at a time.
void weighted_sum_portable(const HeadArgs& a, const float* s, const float* sums) {
    for (int64_t i = 0; i < a.n; ++i) {
        float* o = a.o + i * a.os;
        std::fill(o, o + a.d, 0.f);
        for (int64_t j = 0; j < a.M; ++j) {
            const float e = s[i * a.M + j];
            const float* vj = a.v + j * a.vs;
            for (int64_t c = 0; c < a.d; ++c) o[c] += e * vj[c];
        }
        const float inv = 1.f / sums[i];
        for (int64_t c = 0; c < a.d; ++c) o[c] *= inv;
    }
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) void softmax_rows_avx2(float* s, float* sums, int64_t n, int64_t M) {
    for (int64_t i = 0; i < n; ++i) {
        float* r = s + i * M;
        int64_t j = 0;
        __m256 vmax = _mm256_set1_ps(-INFINITY);
        for (; j + 8 <= M; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(r + j));
        float mx = simd::hmax8(vmax);
        for (; j < M; ++j) mx = std::max(mx, r[j]);
        const __m256 vm = _mm256_set1_ps(mx);
        __m256 vsum = _mm256_setzero_ps();
        for (j = 0; j + 8 <= M; j += 8) {
            const __m256 e = simd::exp_ps(_mm256_sub_ps(_mm256_loadu_ps(r + j), vm));
            _mm256_storeu_ps(r + j, e);
            vsum = _mm256_add_ps(vsum, e);
        }
        float sum = simd::hsum8(vsum);
        for (; j < M; ++j) sum += (r[j] = std::exp(r[j] - mx));
        sums[i] = sum;
    }
}

// Scores for one or two queries (d a multiple of 8): eight keys per pass, their eight dot products reduced by one
// horizontal-add tree, in key order. Below four queries the product kernel's per-output reductions cost more.
__attribute__((target("avx2,fma"))) void scores_hadd_avx2(const HeadArgs& a, float* s) {
    const __m256 vscale = _mm256_set1_ps(a.scale);
    for (int64_t i = 0; i < a.n; ++i) {
        const float* qi = a.q + i * a.d;
        float* r = s + i * a.M;
        int64_t j = 0;
        for (; j + 8 <= a.M; j += 8) {
            __m256 acc[8];
            for (auto& x : acc) x = _mm256_setzero_ps();
            const float* kj = a.k + j * a.d;
            for (int64_t c = 0; c < a.d; c += 8) {
                const __m256 qv = _mm256_loadu_ps(qi + c);
                for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kj + u * a.d + c), acc[u]);
            }
            const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
            const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
            const __m256 dots =
                _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
            _mm256_storeu_ps(r + j, _mm256_mul_ps(dots, vscale));
        }
        for (; j < a.M; ++j) {
            const float* kj = a.k + j * a.d;
            __m256 acc = _mm256_setzero_ps();
            for (int64_t c = 0; c < a.d; c += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(qi + c), _mm256_loadu_ps(kj + c), acc);
            r[j] = simd::hsum8(acc) * a.scale;
        }
    }
}

// o = (e v) / sum on AVX2/FMA (d a multiple of 8): one query, 8 vectors (64 columns) of its output in registers while
// the keys pass.
template <int NV>
__attribute__((target("avx2,fma"))) void weighted_cols_avx2(const HeadArgs& a, const float* e, float inv, float* o,
                                                            int64_t c0) {
    __m256 acc[NV];
    for (int u = 0; u < NV; ++u) acc[u] = _mm256_setzero_ps();
    for (int64_t j = 0; j < a.M; ++j) {
        const __m256 p = _mm256_set1_ps(e[j]);
        const float* vj = a.v + j * a.vs + c0;
        for (int u = 0; u < NV; ++u) acc[u] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 8 * u), acc[u]);
    }
    const __m256 vi = _mm256_set1_ps(inv);
    for (int u = 0; u < NV; ++u) _mm256_storeu_ps(o + c0 + 8 * u, _mm256_mul_ps(acc[u], vi));
}

__attribute__((target("avx2,fma"))) void weighted_sum_avx2(const HeadArgs& a, const float* s, const float* sums) {
    for (int64_t i = 0; i < a.n; ++i) {
        const float* e = s + i * a.M;
        float* o = a.o + i * a.os;
        const float inv = 1.f / sums[i];
        int64_t c0 = 0;
        for (; c0 + 64 <= a.d; c0 += 64) weighted_cols_avx2<8>(a, e, inv, o, c0);
        for (; c0 + 8 <= a.d; c0 += 8) weighted_cols_avx2<1>(a, e, inv, o, c0);
    }
}

// The same on AVX-512 (d a multiple of 16): four queries share each load of a value row, 4 x 4 accumulators (64
// columns of four output rows).
template <int NQ, int NV>
__attribute__((target("avx512f"))) void weighted_block_avx512(const HeadArgs& a, const float* s, const float* sums,
                                                              int64_t i0, int64_t c0) {
    __m512 acc[NQ][NV];
    for (int q = 0; q < NQ; ++q)
        for (int u = 0; u < NV; ++u) acc[q][u] = _mm512_setzero_ps();
    for (int64_t j = 0; j < a.M; ++j) {
        const float* vj = a.v + j * a.vs + c0;
        __m512 vr[NV];
        for (int u = 0; u < NV; ++u) vr[u] = _mm512_loadu_ps(vj + 16 * u);
        for (int q = 0; q < NQ; ++q) {
            const __m512 p = _mm512_set1_ps(s[(i0 + q) * a.M + j]);
            for (int u = 0; u < NV; ++u) acc[q][u] = _mm512_fmadd_ps(p, vr[u], acc[q][u]);
        }
    }
    for (int q = 0; q < NQ; ++q) {
        const __m512 vi = _mm512_set1_ps(1.f / sums[i0 + q]);
        for (int u = 0; u < NV; ++u)
            _mm512_storeu_ps(a.o + (i0 + q) * a.os + c0 + 16 * u, _mm512_mul_ps(acc[q][u], vi));
    }
}

template <int NQ>
__attribute__((target("avx512f"))) void weighted_rows_avx512(const HeadArgs& a, const float* s, const float* sums,
                                                             int64_t i0) {
    int64_t c0 = 0;
    for (; c0 + 64 <= a.d; c0 += 64) weighted_block_avx512<NQ, 4>(a, s, sums, i0, c0);
    for (; c0 + 16 <= a.d; c0 += 16) weighted_block_avx512<NQ, 1>(a, s, sums, i0, c0);
}

__attribute__((target("avx512f"))) void weighted_sum_avx512(const HeadArgs& a, const float* s, const float* sums) {
    int64_t i = 0;
    for (; i + 4 <= a.n; i += 4) weighted_rows_avx512<4>(a, s, sums, i);
    for (; i + 2 <= a.n; i += 2) weighted_rows_avx512<2>(a, s, sums, i);
    for (; i < a.n; ++i) weighted_rows_avx512<1>(a, s, sums, i);
}
#endif

} // namespace

bool few_query_attention_applies(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
    for (const auto* t : {&q, &k, &v})
        if (t->dim() != 3 || !t->device().is_cpu() || t->scalar_type() != torch::kFloat || t->stride(2) != 1)
            return false;
    if (torch::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad())) return false;
    return k.sizes() == v.sizes() && q.size(0) == k.size(0) && q.size(2) == k.size(2) && k.size(1) > 0;
}

torch::Tensor few_query_attention(const torch::Tensor& q_in, const torch::Tensor& k_in, const torch::Tensor& v,
                                  double scale, SimdPath path) {
    TORCH_CHECK(few_query_attention_applies(q_in, k_in, v), "few_query_attention: q [H, n, d], k and v [H, M, d] ",
                "float32 CPU tensors with a unit last stride (M > 0, no autograd), got q ", q_in.sizes(), ", k ",
                k_in.sizes(), ", v ", v.sizes());
    const int64_t H = q_in.size(0), n = q_in.size(1), d = q_in.size(2), M = k_in.size(1);
    auto out = torch::empty({n, H * d}, q_in.options());
    if (n == 0 || H == 0 || d == 0) return out;
    // The score product reads each head's queries and keys as contiguous [rows, d] matrices.
    const auto rows_contiguous = [](const torch::Tensor& t) {
        return t.stride(1) == t.size(2) || t.size(1) == 1 ? t : t.contiguous();
    };
    const torch::Tensor q = rows_contiguous(q_in), k = rows_contiguous(k_in);
    const bool avx2 = path != SimdPath::Portable && d % 8 == 0 && gemv_uses_avx2();
    const bool avx512 = avx2 && path == SimdPath::Best && d % 16 == 0 && gemv_uses_avx512();
    const bool parallel = H > 1 && H * n * M * d >= (int64_t(1) << 18);
#pragma omp parallel if (parallel)
    {
        std::vector<float> s(static_cast<size_t>(n * M)), sums(static_cast<size_t>(n));
#pragma omp for schedule(static)
        for (int64_t h = 0; h < H; ++h) {
            const HeadArgs a{q.data_ptr<float>() + h * q.stride(0),
                             k.data_ptr<float>() + h * k.stride(0),
                             v.data_ptr<float>() + h * v.stride(0),
                             v.stride(1),
                             out.data_ptr<float>() + h * d,
                             H * d,
                             n,
                             M,
                             d,
                             float(scale)};
#if defined(__x86_64__)
            if (avx2) {
                if (n < kFewQueries)
                    scores_hadd_avx2(a, s.data());
                else
                    scores(a, s.data(), path);
                softmax_rows_avx2(s.data(), sums.data(), n, M);
                if (avx512)
                    weighted_sum_avx512(a, s.data(), sums.data());
                else
                    weighted_sum_avx2(a, s.data(), sums.data());
                continue;
            }
#endif
            scores(a, s.data(), SimdPath::Portable);
            softmax_rows_portable(s.data(), sums.data(), n, M);
            weighted_sum_portable(a, s.data(), sums.data());
        }
    }
    (void)avx512;
    return out;
}

torch::Tensor few_query_attention_torch(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                        double scale) {
    auto p = torch::softmax(torch::matmul(q, k.transpose(1, 2)) * scale, -1); // [H, n, M]
    return torch::matmul(p, v).permute({1, 0, 2}).reshape({q.size(1), q.size(0) * q.size(2)});
}

} // namespace anchor::kernels
