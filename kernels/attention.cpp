#include "kernels/attention.h"

#include "kernels/cpu_features.h"
#include "kernels/simd_math.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace anchor::kernels {

namespace {

struct HeadArgs {
    const float* q; // row i at q + i * qs, D values
    const float* k;
    const float* v;
    float* o;
    int64_t qs, ks, vs, os;
    int64_t N, M, D;
    float scale;
};

// Query rows per AVX2 tile (rows_avx2 below).
constexpr int kRows = 8;

// One head's K^T [D, Mp] and V [M, Dp], zero-padded to multiples of 8 so the vector loops need no tails.
struct HeadBuffers {
    std::vector<float> kt, vb, s;
    int64_t Mp = 0, Dp = 0;
    void fill(const HeadArgs& a) {
        Mp = (a.M + 7) / 8 * 8, Dp = (a.D + 7) / 8 * 8;
        kt.assign(size_t(a.D * Mp), 0.f);
        vb.assign(size_t(a.M * Dp), 0.f);
        if (s.size() < size_t(kRows * Mp)) s.resize(size_t(kRows * Mp));
        for (int64_t j = 0; j < a.M; ++j) {
            const float* kr = a.k + j * a.ks;
            const float* vr = a.v + j * a.vs;
            for (int64_t d = 0; d < a.D; ++d) kt[size_t(d * Mp + j)] = kr[d], vb[size_t(j * Dp + d)] = vr[d];
        }
    }
};

// Portable path (and the non-AVX2 fallback): the same formulas in scalar loops (std::exp, no e^-60 cut-off).
void head_plain(const HeadArgs& a, HeadBuffers& b) {
    float* s = b.s.data();
    for (int64_t i = 0; i < a.N; ++i) {
        const float* qi = a.q + i * a.qs;
        std::fill(s, s + a.M, 0.f);
        for (int64_t d = 0; d < a.D; ++d) {
            const float qd = qi[d];
            const float* kd = b.kt.data() + d * b.Mp;
            for (int64_t j = 0; j < a.M; ++j) s[j] += qd * kd[j];
        }
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < a.M; ++j) s[j] *= a.scale, mx = std::max(mx, s[j]);
        float sum = 0.f;
        for (int64_t j = 0; j < a.M; ++j) s[j] = std::exp(s[j] - mx), sum += s[j];
        const float inv = 1.f / sum;
        float* oi = a.o + i * a.os;
        std::fill(oi, oi + a.D, 0.f);
        for (int64_t j = 0; j < a.M; ++j) {
            const float p = s[j] * inv;
            const float* vj = b.vb.data() + j * b.Dp;
            for (int64_t d = 0; d < a.D; ++d) oi[d] += p * vj[d];
        }
    }
}

#if defined(__x86_64__)
// R query rows at once: R independent FMA chains hide the 4-cycle FMA latency that one row's chain of D (scores) or
// M (weighted sum) dependent FMAs would expose; with one row at a time the kernel ran at a quarter of this speed.
template <int R> __attribute__((target("avx2,fma"))) void rows_avx2(const HeadArgs& a, HeadBuffers& b, int64_t i0) {
    const int64_t Mp = b.Mp, Dp = b.Dp;
    float* s = b.s.data(); // R rows of Mp scores
    const float* q[R];
    for (int r = 0; r < R; ++r) q[r] = a.q + (i0 + r) * a.qs;
    const __m256 scale = _mm256_set1_ps(a.scale);
    // scores s_r = scale * (q_r K^T), 8 keys per vector
    for (int64_t j = 0; j < Mp; j += 8) {
        __m256 acc[R];
        for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
        for (int64_t d = 0; d < a.D; ++d) {
            const __m256 kv = _mm256_loadu_ps(b.kt.data() + d * Mp + j);
            for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(q[r][d]), kv, acc[r]);
        }
        for (int r = 0; r < R; ++r) _mm256_storeu_ps(s + r * Mp + j, _mm256_mul_ps(acc[r], scale));
    }
    // softmax per row; padded keys (j >= M) get -inf before the max and exactly 0 after the exp
    for (int r = 0; r < R; ++r) {
        float* sr = s + r * Mp;
        for (int64_t j = a.M; j < Mp; ++j) sr[j] = -std::numeric_limits<float>::infinity();
        __m256 vmax = _mm256_loadu_ps(sr);
        for (int64_t j = 8; j < Mp; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(sr + j));
        const __m256 mx = _mm256_set1_ps(simd::hmax8(vmax));
        __m256 vsum = _mm256_setzero_ps();
        for (int64_t j = 0; j < Mp; j += 8) {
            const __m256 e = simd::exp_ps(_mm256_sub_ps(_mm256_loadu_ps(sr + j), mx));
            _mm256_storeu_ps(sr + j, e);
            vsum = _mm256_add_ps(vsum, e);
        }
        const float sum = simd::hsum8(vsum); // padded keys: exp(-inf - max) is exactly 0 (below -60)
        const __m256 inv = _mm256_set1_ps(1.f / sum);
        for (int64_t j = 0; j < Mp; j += 8) _mm256_storeu_ps(sr + j, _mm256_mul_ps(_mm256_loadu_ps(sr + j), inv));
    }
    // o_r = sum_j p_rj v_j, 8 output channels per vector
    alignas(32) float tmp[8];
    for (int64_t d0 = 0; d0 < Dp; d0 += 8) {
        __m256 acc[R];
        for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
        const float* vcol = b.vb.data() + d0;
        for (int64_t j = 0; j < a.M; ++j) {
            const __m256 vv = _mm256_loadu_ps(vcol + j * Dp);
            for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(s[r * Mp + j]), vv, acc[r]);
        }
        for (int r = 0; r < R; ++r) {
            float* o = a.o + (i0 + r) * a.os;
            if (d0 + 8 <= a.D) {
                _mm256_storeu_ps(o + d0, acc[r]);
            } else {
                _mm256_store_ps(tmp, acc[r]);
                for (int64_t d = d0; d < a.D; ++d) o[d] = tmp[d - d0];
            }
        }
    }
}

__attribute__((target("avx2,fma"))) void head_avx2(const HeadArgs& a, HeadBuffers& b) {
    int64_t i = 0;
    for (; i + kRows <= a.N; i += kRows) rows_avx2<kRows>(a, b, i);
    for (; i < a.N; ++i) rows_avx2<1>(a, b, i);
}
#endif

bool use_avx2() {
#if defined(__x86_64__)
    static const bool on = cpu_features().avx2 && cpu_features().fma;
    return on;
#else
    return false;
#endif
}

} // namespace

namespace detail {

void check_projection_layout(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t heads,
                             const char* kernel) {
    TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, kernel, ": q, k, v must be [B, tokens, C]");
    TORCH_CHECK(q.scalar_type() == torch::kFloat && k.scalar_type() == torch::kFloat &&
                    v.scalar_type() == torch::kFloat,
                kernel, ": float32 only");
    const int64_t B = q.size(0), C = q.size(2), M = k.size(1);
    TORCH_CHECK(heads >= 1 && C % heads == 0, kernel, ": width ", C, " not divisible by ", heads, " heads");
    TORCH_CHECK(k.size(0) == B && v.size(0) == B && k.size(2) == C && v.size(2) == C && v.size(1) == M, kernel, ": k ",
                k.sizes(), " and v ", v.sizes(), " do not match q ", q.sizes());
}

torch::Tensor unit_last(const torch::Tensor& t) {
    return t.stride(2) == 1 && t.stride(1) >= t.size(2) ? t : t.contiguous();
}

} // namespace detail

bool small_attention_applies(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t heads) {
    if (q.dim() != 3 || k.dim() != 3 || v.dim() != 3 || heads < 1 || q.size(2) % heads != 0) return false;
    for (const auto* t : {&q, &k, &v})
        if (!t->device().is_cpu() || t->scalar_type() != torch::kFloat) return false;
    // No autograd here: training keeps the differentiable torch path.
    if (torch::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad())) return false;
    const int64_t D = q.size(2) / heads;
    // Fewer queries than one 8-row tile: the torch path. Those are the 1x1 / 2x2 levels of small UNets, where GroupNorm
    // over 2-4 values per group amplifies rounding ~1000x (tests/golden/sd/README.md); there the golden features'
    // 1e-4 tolerance has room for torch's summation order but not for a second one (measured: 1.3e-4 with the kernel
    // on every level, 3.7e-5 with it on levels of >= 8 queries, 5.6e-5 with it nowhere).
    if (q.size(1) < kMinQueries) return false;
    return q.size(1) * k.size(1) * D <= kSmallAttentionWork;
}

torch::Tensor small_attention(const torch::Tensor& q_, const torch::Tensor& k_, const torch::Tensor& v_, int64_t heads,
                              double scale, bool portable) {
    detail::check_projection_layout(q_, k_, v_, heads, "small_attention");
    const int64_t B = q_.size(0), N = q_.size(1), C = q_.size(2), M = k_.size(1);
    const auto q = detail::unit_last(q_), k = detail::unit_last(k_), v = detail::unit_last(v_);
    auto out = torch::empty({B, N, C}, q.options().memory_format(torch::MemoryFormat::Contiguous));
    if (B == 0 || N == 0) return out;
    TORCH_CHECK(M > 0, "small_attention: no keys");
    const int64_t D = C / heads, BH = B * heads;
    const float* qp = q.data_ptr<float>();
    const float* kp = k.data_ptr<float>();
    const float* vp = v.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const bool avx2 = use_avx2() && !portable;
    (void)avx2; // unused off x86
    // A few kFLOPs per head: below ~32k MACs in all, waking the thread pool costs more than it saves.
    const bool parallel = BH > 1 && BH * N * M * D >= (int64_t(1) << 15);
#pragma omp parallel if (parallel)
    {
        HeadBuffers buf;
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < BH; ++bh) {
            const int64_t bi = bh / heads, h = bh % heads;
            HeadArgs a{qp + bi * q.stride(0) + h * D,
                       kp + bi * k.stride(0) + h * D,
                       vp + bi * v.stride(0) + h * D,
                       op + bi * N * C + h * D,
                       q.stride(1),
                       k.stride(1),
                       v.stride(1),
                       C,
                       N,
                       M,
                       D,
                       float(scale)};
            buf.fill(a);
#if defined(__x86_64__)
            if (avx2) {
                head_avx2(a, buf);
                continue;
            }
#endif
            head_plain(a, buf);
        }
    }
    return out;
}

torch::Tensor attention_matmul(const torch::Tensor& q_in, const torch::Tensor& k_in, const torch::Tensor& v_in,
                               const AttentionOptions& o) {
    TORCH_CHECK(o.formula == ScoreFormula::ScaleAfter || o.formula == ScoreFormula::PreScaledQuery,
                "attention_matmul: takes the ScaleAfter and PreScaledQuery formulations");
    const bool projection = o.layout == AttentionLayout::Projection;
    const int64_t rank = projection ? 3 : 4;
    TORCH_CHECK(q_in.dim() == rank && k_in.dim() == rank && v_in.dim() == rank, "attention: q, k, v must be ",
                projection ? "[B, tokens, heads * head_dim]" : "[B, heads, tokens, head_dim]", ", got q ", q_in.sizes(),
                ", k ", k_in.sizes(), ", v ", v_in.sizes());
    const int64_t B = q_in.size(0), N = q_in.size(projection ? 1 : 2), M = k_in.size(projection ? 1 : 2);
    const int64_t H = projection ? o.heads : q_in.size(1);
    TORCH_CHECK(H >= 1 && (!projection || q_in.size(2) % H == 0), "attention: width ", q_in.size(-1),
                " not divisible by ", H, " heads");
    const int64_t D = projection ? q_in.size(2) / H : q_in.size(3);
    TORCH_CHECK(k_in.size(0) == B && v_in.size(0) == B && v_in.size(projection ? 1 : 2) == M &&
                    (projection ? k_in.size(2) == H * D && v_in.size(2) == H * D
                                : k_in.size(1) == H && v_in.size(1) == H && k_in.size(3) == D && v_in.size(3) == D),
                "attention: k ", k_in.sizes(), " and v ", v_in.sizes(), " do not match q ", q_in.sizes());
    const double scale = o.scale >= 0 ? o.scale : 1.0 / std::sqrt(double(D));
    const bool prescaled = o.formula == ScoreFormula::PreScaledQuery;
    // CLIP scales the projected query before splitting the heads; elementwise, so the layout does not change a bit.
    const torch::Tensor q_scaled = prescaled ? q_in * scale : q_in;
    auto heads = [&](const torch::Tensor& t, int64_t n) {
        return projection ? t.reshape({B, n, H, D}).transpose(1, 2) : t;
    };
    const auto q = heads(q_scaled, N), k = heads(k_in, M), v = heads(v_in, M);
    auto scores = torch::matmul(q, k.transpose(-2, -1)); // [B, H, N, M]
    if (!prescaled) scores = scores * scale;
    if (o.additive_mask.defined()) scores.add_(o.additive_mask);
    if (o.causal && N > 1) {
        auto key = torch::arange(M, torch::kLong).view({1, M});
        auto last = (torch::arange(N, torch::kLong) + (M - N)).view({N, 1});
        scores = scores.masked_fill((key > last).to(scores.device()), -std::numeric_limits<float>::infinity());
    }
    auto out = torch::matmul(scores.softmax(-1), v); // [B, H, N, D]
    return projection ? out.transpose(1, 2).reshape({B, N, H * D}) : out;
}

torch::Tensor attention_torch(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t heads,
                              double scale) {
    const int64_t B = q.size(0), N = q.size(1), C = q.size(2), M = k.size(1), D = C / heads;
    auto qh = q.reshape({B, N, heads, D}).permute({0, 2, 1, 3});
    auto kt = k.reshape({B, M, heads, D}).permute({0, 2, 3, 1});
    auto vh = v.reshape({B, M, heads, D}).permute({0, 2, 1, 3});
    auto s = torch::matmul(qh, kt);
    s.mul_(scale);
    return torch::matmul(s.softmax(-1), vh).permute({0, 2, 1, 3}).reshape({B, N, C});
}

} // namespace anchor::kernels
