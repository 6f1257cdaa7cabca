#include "kernels/geglu.h"

#include "kernels/cpu_features.h"
#include "kernels/simd_math.h"

#include <ATen/Parallel.h>

#include <cmath>

namespace anchor::kernels {
namespace {

// Abramowitz & Stegun 7.1.26.
constexpr float kP = 0.3275911f;
constexpr float kA1 = 0.254829592f, kA2 = -0.284496736f, kA3 = 1.421413741f, kA4 = -1.453152027f,
                kA5 = 1.061405429f;
constexpr float kInvSqrt2 = 0.70710678118654752f;

inline float geglu_one(float a, float x) {
    const float z = std::fabs(x * kInvSqrt2);
    const float t = 1.f / (1.f + kP * z);
    const float q = t * (kA1 + t * (kA2 + t * (kA3 + t * (kA4 + t * kA5)))) * std::exp(-z * z); // 1 - erf|z|
    return a * (0.5f * x * (x >= 0.f ? 2.f - q : q));
}

void rows_scalar(const float* h, float* out, int64_t rows, int64_t F) {
    for (int64_t r = 0; r < rows; ++r, h += 2 * F, out += F)
        for (int64_t j = 0; j < F; ++j) out[j] = geglu_one(h[j], h[F + j]);
}

#if defined(__x86_64__)
__attribute__((target("avx512f"))) void rows_avx512(const float* h, float* out, int64_t rows, int64_t F) {
    const __m512 p = _mm512_set1_ps(kP), one = _mm512_set1_ps(1.f), two = _mm512_set1_ps(2.f),
                 half = _mm512_set1_ps(0.5f), inv_sqrt2 = _mm512_set1_ps(kInvSqrt2);
    for (int64_t r = 0; r < rows; ++r, h += 2 * F, out += F) {
        int64_t j = 0;
        for (; j + 16 <= F; j += 16) {
            const __m512 a = _mm512_loadu_ps(h + j), x = _mm512_loadu_ps(h + F + j);
            const __m512 z = _mm512_abs_ps(_mm512_mul_ps(x, inv_sqrt2));
            const __m512 t = _mm512_div_ps(one, _mm512_fmadd_ps(p, z, one));
            __m512 poly = _mm512_fmadd_ps(t, _mm512_set1_ps(kA5), _mm512_set1_ps(kA4));
            poly = _mm512_fmadd_ps(t, poly, _mm512_set1_ps(kA3));
            poly = _mm512_fmadd_ps(t, poly, _mm512_set1_ps(kA2));
            poly = _mm512_fmadd_ps(t, poly, _mm512_set1_ps(kA1));
            const __m512 q = _mm512_mul_ps(_mm512_mul_ps(t, poly), simd::exp_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), z), z)));
            const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
            const __m512 s = _mm512_mask_blend_ps(neg, _mm512_sub_ps(two, q), q); // 1 + erf(x / sqrt 2)
            _mm512_storeu_ps(out + j, _mm512_mul_ps(a, _mm512_mul_ps(_mm512_mul_ps(half, x), s)));
        }
        for (; j < F; ++j) out[j] = geglu_one(h[j], h[F + j]);
    }
}

__attribute__((target("avx2,fma"))) void rows_avx2(const float* h, float* out, int64_t rows, int64_t F) {
    const __m256 p = _mm256_set1_ps(kP), one = _mm256_set1_ps(1.f), two = _mm256_set1_ps(2.f),
                 half = _mm256_set1_ps(0.5f), inv_sqrt2 = _mm256_set1_ps(kInvSqrt2),
                 sign = _mm256_set1_ps(-0.f);
    for (int64_t r = 0; r < rows; ++r, h += 2 * F, out += F) {
        int64_t j = 0;
        for (; j + 8 <= F; j += 8) {
            const __m256 a = _mm256_loadu_ps(h + j), x = _mm256_loadu_ps(h + F + j);
            const __m256 z = _mm256_andnot_ps(sign, _mm256_mul_ps(x, inv_sqrt2));
            const __m256 t = _mm256_div_ps(one, _mm256_fmadd_ps(p, z, one));
            __m256 poly = _mm256_fmadd_ps(t, _mm256_set1_ps(kA5), _mm256_set1_ps(kA4));
            poly = _mm256_fmadd_ps(t, poly, _mm256_set1_ps(kA3));
            poly = _mm256_fmadd_ps(t, poly, _mm256_set1_ps(kA2));
            poly = _mm256_fmadd_ps(t, poly, _mm256_set1_ps(kA1));
            const __m256 q = _mm256_mul_ps(_mm256_mul_ps(t, poly), simd::exp_ps(_mm256_mul_ps(_mm256_xor_ps(z, sign), z)));
            const __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
            const __m256 s = _mm256_blendv_ps(_mm256_sub_ps(two, q), q, neg); // 1 + erf(x / sqrt 2)
            _mm256_storeu_ps(out + j, _mm256_mul_ps(a, _mm256_mul_ps(_mm256_mul_ps(half, x), s)));
        }
        for (; j < F; ++j) out[j] = geglu_one(h[j], h[F + j]);
    }
}
#endif

} // namespace

bool geglu_applies(const torch::Tensor& h) {
    return h.defined() && h.dim() >= 1 && h.device().is_cpu() && h.scalar_type() == torch::kFloat &&
           h.is_contiguous() && h.size(-1) % 2 == 0 && !(torch::GradMode::is_enabled() && h.requires_grad());
}

torch::Tensor geglu(const torch::Tensor& h) {
    TORCH_CHECK(geglu_applies(h), "geglu: ", h.sizes(), " ", h.scalar_type(),
                " is not a contiguous float32 CPU tensor with an even last dimension outside autograd");
    const int64_t F = h.size(-1) / 2, rows = F == 0 ? 0 : h.numel() / (2 * F);
    auto sizes = h.sizes().vec();
    sizes.back() = F;
    auto out = torch::empty(sizes, h.options());
    if (rows == 0) return out;
    const float* hp = h.data_ptr<float>();
    float* op = out.data_ptr<float>();
    auto run = rows_scalar;
#if defined(__x86_64__)
    const auto& cpu = cpu_features();
    if (cpu.avx512f)
        run = rows_avx512;
    else if (cpu.avx2 && cpu.fma)
        run = rows_avx2;
#endif
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(F, 1));
    at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) { run(hp + r0 * 2 * F, op + r0 * F, r1 - r0, F); });
    return out;
}

torch::Tensor geglu_torch(const torch::Tensor& h) {
    const auto hg = h.chunk(2, -1);
    return hg[0] * torch::gelu(hg[1]);
}

} // namespace anchor::kernels
