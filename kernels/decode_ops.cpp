#include "kernels/decode_ops.h"

#include "kernels/cpu_features.h"
#include "kernels/simd_math.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace anchor::kernels {

namespace {

bool use_avx512() {
    static const bool on = cpu_features().avx512f && cpu_features().fma;
    return on;
}

constexpr float kGeluC = 0.7978845608028654f; // sqrt(2 / pi)
constexpr float kGeluA = 0.044715f;

// The attention arithmetic of one head, plain loops (the scores buffer holds len values).
void attend_head_plain(const float* q, const float* k, const float* v, float* out, int64_t d, int64_t len, float scale,
                       float* scores) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < len; ++j) {
        float s = 0.f;
        for (int64_t i = 0; i < d; ++i) s += q[i] * k[j * d + i];
        scores[j] = s * scale;
        m = std::max(m, scores[j]);
    }
    float sum = 0.f;
    for (int64_t j = 0; j < len; ++j) sum += (scores[j] = std::exp(scores[j] - m));
    const float inv = 1.f / sum;
    for (int64_t i = 0; i < d; ++i) out[i] = 0.f;
    for (int64_t j = 0; j < len; ++j) {
        const float p = scores[j] * inv;
        for (int64_t i = 0; i < d; ++i) out[i] += p * v[j * d + i];
    }
}

#if defined(__x86_64__)
__attribute__((target("avx512f,fma"))) void gelu_tanh_avx512(float* x, int64_t n) {
    const __m512 c = _mm512_set1_ps(kGeluC), a = _mm512_set1_ps(kGeluA), half = _mm512_set1_ps(0.5f),
                 one = _mm512_set1_ps(1.f), m2 = _mm512_set1_ps(-2.f);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
        const __m512 v = _mm512_maskz_loadu_ps(m, x + i);
        const __m512 u = _mm512_mul_ps(c, _mm512_fmadd_ps(_mm512_mul_ps(a, v), _mm512_mul_ps(v, v), v));
        // tanh(u) = sign(u) (1 - e) / (1 + e) with e = exp(-2|u|) <= 1: the exponential's argument stays <= 0.
        const __m512 au = _mm512_abs_ps(u);
        const __m512 e = simd::exp_ps(_mm512_mul_ps(m2, au));
        __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
        t = _mm512_castsi512_ps(_mm512_or_si512(
            _mm512_castps_si512(t), _mm512_and_si512(_mm512_castps_si512(u), _mm512_set1_epi32(INT32_MIN))));
        _mm512_mask_storeu_ps(x + i, m, _mm512_mul_ps(_mm512_mul_ps(half, v), _mm512_add_ps(one, t)));
    }
}

__attribute__((target("avx512f,fma"))) void attend_head_avx512(const float* q, const float* k, const float* v,
                                                               float* out, int64_t d, int64_t len, float scale,
                                                               float* scores) {
    // Head widths that are a multiple of 16 (GPT-2: 64) take the vector path; others the plain loops.
    if (d % 16 != 0 || d > 256) return attend_head_plain(q, k, v, out, d, len, scale, scores);
    const int64_t nv = d / 16;
    __m512 qv[16];
    for (int64_t i = 0; i < nv; ++i) qv[i] = _mm512_loadu_ps(q + i * 16);
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < len; ++j) {
        const float* kj = k + j * d;
        __m512 s = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kj));
        for (int64_t i = 1; i < nv; ++i) s = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(kj + i * 16), s);
        scores[j] = _mm512_reduce_add_ps(s) * scale;
        m = std::max(m, scores[j]);
    }
    __m512 sumv = _mm512_setzero_ps();
    const __m512 mv = _mm512_set1_ps(m);
    for (int64_t j = 0; j < len; j += 16) {
        const __mmask16 mk = len - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (len - j)) - 1);
        const __m512 e = simd::exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, scores + j), mv));
        _mm512_mask_storeu_ps(scores + j, mk, e);
        sumv = _mm512_add_ps(sumv, _mm512_maskz_mov_ps(mk, e));
    }
    const float inv = 1.f / _mm512_reduce_add_ps(sumv);
    __m512 acc[16];
    for (int64_t i = 0; i < nv; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < len; ++j) {
        const __m512 p = _mm512_set1_ps(scores[j] * inv);
        const float* vj = v + j * d;
        for (int64_t i = 0; i < nv; ++i) acc[i] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vj + i * 16), acc[i]);
    }
    for (int64_t i = 0; i < nv; ++i) _mm512_storeu_ps(out + i * 16, acc[i]);
}
#endif

template <class Head>
void attend_heads(const float* q, const float* k, const float* v, float* out, int64_t heads, int64_t d, int64_t len,
                  int64_t head_stride, float scale, bool threads, Head head) {
    const bool parallel = threads && heads > 1 && heads * len * d >= (int64_t(1) << 16);
#pragma omp parallel if (parallel)
    {
        std::vector<float> scores(static_cast<size_t>(len));
#pragma omp for schedule(static)
        for (int64_t h = 0; h < heads; ++h)
            head(q + h * d, k + h * head_stride, v + h * head_stride, out + h * d, d, len, scale, scores.data());
    }
}

} // namespace

void layer_norm_row(const float* x, const float* g, const float* b, float* y, int64_t n, float eps) {
    // Two passes in double: the mean, then the centred variance (no cancellation); n is a few thousand at most.
    double mean = 0.0;
    for (int64_t i = 0; i < n; ++i) mean += x[i];
    mean /= double(n);
    double var = 0.0;
    for (int64_t i = 0; i < n; ++i) var += (x[i] - mean) * (x[i] - mean);
    var /= double(n);
    const float inv = static_cast<float>(1.0 / std::sqrt(var + eps)), mf = static_cast<float>(mean);
    if (b)
        for (int64_t i = 0; i < n; ++i) y[i] = (x[i] - mf) * inv * g[i] + b[i];
    else
        for (int64_t i = 0; i < n; ++i) y[i] = (x[i] - mf) * inv * g[i];
}

void gelu_tanh_row_ref(float* x, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        const float v = x[i];
        x[i] = 0.5f * v * (1.f + std::tanh(kGeluC * (v + kGeluA * v * v * v)));
    }
}

void gelu_tanh_row(float* x, int64_t n) {
#if defined(__x86_64__)
    if (use_avx512()) return gelu_tanh_avx512(x, n);
#endif
    gelu_tanh_row_ref(x, n);
}

void gelu_erf_row(float* x, int64_t n) {
    for (int64_t i = 0; i < n; ++i) x[i] = 0.5f * x[i] * (1.f + std::erf(x[i] * 0.70710678118654752f));
}

void attend_one_query_ref(const float* q, const float* k, const float* v, float* out, int64_t heads, int64_t head_dim,
                          int64_t len, int64_t head_stride, float scale) {
    attend_heads(q, k, v, out, heads, head_dim, len, head_stride, scale, false, attend_head_plain);
}

void attend_one_query(const float* q, const float* k, const float* v, float* out, int64_t heads, int64_t head_dim,
                      int64_t len, int64_t head_stride, float scale) {
#if defined(__x86_64__)
    if (use_avx512())
        return attend_heads(q, k, v, out, heads, head_dim, len, head_stride, scale, true, attend_head_avx512);
#endif
    attend_heads(q, k, v, out, heads, head_dim, len, head_stride, scale, true, attend_head_plain);
}

} // namespace anchor::kernels
