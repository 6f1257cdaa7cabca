#include "kernels/gemv.h"

#include "cache/io/error.h"
#include "kernels/cpu_features.h"

#include <c10/util/Half.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace anchor::kernels {

namespace {

inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// Rows per OpenMP chunk: enough work per thread to amortise the fork, few enough to balance 50257-row LM heads.
constexpr int64_t kRowBlock = 16;

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_hadd_ps(lo, lo);
    lo = _mm_hadd_ps(lo, lo);
    return _mm_cvtss_f32(lo);
}

__attribute__((target("avx2,fma"))) float dot_f32_avx2(const float* w, const float* x, int64_t n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 16), _mm256_loadu_ps(x + i + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 24), _mm256_loadu_ps(x + i + 24), a3);
    }
    for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a0);
    float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; i < n; ++i) s += w[i] * x[i];
    return s;
}

__attribute__((target("avx2,fma,f16c"))) float dot_f16_avx2(const uint16_t* w, const float* x, int64_t n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 w0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i)));
        __m256 w1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i + 8)));
        a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + i + 8), a1);
    }
    for (; i + 8 <= n; i += 8)
        a0 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i))),
                             _mm256_loadu_ps(x + i), a0);
    float s = hsum(_mm256_add_ps(a0, a1));
    for (; i < n; ++i) s += half_to_float(w[i]) * x[i];
    return s;
}
#endif

float dot_f32_plain(const float* w, const float* x, int64_t n) {
    float s = 0.f;
    for (int64_t i = 0; i < n; ++i) s += w[i] * x[i];
    return s;
}

float dot_f16_plain(const uint16_t* w, const float* x, int64_t n) {
    float s = 0.f;
    for (int64_t i = 0; i < n; ++i) s += half_to_float(w[i]) * x[i];
    return s;
}

template <class T, class Dot>
void gemv_rows(const T* w, const float* x, const float* b, float* y, int64_t rows, int64_t cols, Dot dot) {
    // Small products (GPT-2 tiny, a 64-wide layer) are not worth waking the thread pool for.
    const bool parallel = rows * cols >= (1 << 16);
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
        const int64_t r1 = std::min(rows, r0 + kRowBlock);
        for (int64_t r = r0; r < r1; ++r) y[r] = dot(w + r * cols, x, cols) + (b ? b[r] : 0.f);
    }
}

} // namespace

bool gemv_uses_avx2() {
    const auto& f = cpu_features();
    return f.avx2 && f.fma && f.f16c;
}

void gemv_ref_f32(const float* w, const float* x, const float* b, float* y, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; ++r) {
        double s = b ? b[r] : 0.0;
        for (int64_t c = 0; c < cols; ++c) s += static_cast<double>(w[r * cols + c]) * x[c];
        y[r] = static_cast<float>(s);
    }
}

void gemv_ref_f16(const uint16_t* w, const float* x, const float* b, float* y, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; ++r) {
        double s = b ? b[r] : 0.0;
        for (int64_t c = 0; c < cols; ++c) s += static_cast<double>(half_to_float(w[r * cols + c])) * x[c];
        y[r] = static_cast<float>(s);
    }
}

void gemv_f32(const float* w, const float* x, const float* b, float* y, int64_t rows, int64_t cols) {
#if defined(__x86_64__)
    if (gemv_uses_avx2()) return gemv_rows(w, x, b, y, rows, cols, dot_f32_avx2);
#endif
    gemv_rows(w, x, b, y, rows, cols, dot_f32_plain);
}

void gemv_f16(const uint16_t* w, const float* x, const float* b, float* y, int64_t rows, int64_t cols) {
#if defined(__x86_64__)
    if (gemv_uses_avx2()) return gemv_rows(w, x, b, y, rows, cols, dot_f16_avx2);
#endif
    gemv_rows(w, x, b, y, rows, cols, dot_f16_plain);
}

torch::Tensor gemv_torch(const torch::Tensor& w, const torch::Tensor& x, const torch::Tensor& bias) {
    auto wf = w.to(torch::kFloat32);
    return bias.defined() ? torch::addmv(bias.to(torch::kFloat32), wf, x.to(torch::kFloat32))
                          : torch::mv(wf, x.to(torch::kFloat32));
}

torch::Tensor gemv(const torch::Tensor& w, const torch::Tensor& x_in, const torch::Tensor& bias) {
    const bool ok_w = w.dim() == 2 && w.device().is_cpu() && w.is_contiguous() &&
                      (w.scalar_type() == torch::kFloat32 || w.scalar_type() == torch::kHalf);
    if (!ok_w || x_in.numel() != (w.dim() == 2 ? w.size(1) : -1) || !x_in.device().is_cpu())
        return gemv_torch(w, x_in.reshape({-1}), bias);
    const int64_t rows = w.size(0), cols = w.size(1);
    auto x = x_in.reshape({cols}).to(torch::kFloat32).contiguous();
    torch::Tensor b;
    if (bias.defined()) {
        if (bias.numel() != rows)
            throw Error("gemv: bias has " + std::to_string(bias.numel()) + " values for " + std::to_string(rows) +
                        " rows");
        b = bias.to(torch::kFloat32).contiguous();
    }
    auto y = torch::empty({rows}, torch::kFloat32);
    const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
    if (w.scalar_type() == torch::kFloat32)
        gemv_f32(w.data_ptr<float>(), x.data_ptr<float>(), bp, y.data_ptr<float>(), rows, cols);
    else
        gemv_f16(reinterpret_cast<const uint16_t*>(w.data_ptr<at::Half>()), x.data_ptr<float>(), bp,
                 y.data_ptr<float>(), rows, cols);
    return y;
}

} // namespace anchor::kernels
