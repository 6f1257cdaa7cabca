#include "kernels/gemv.h"
#include "kernels/gemv_packed.h"

#include "cache/io/error.h"
#include "kernels/cpu_features.h"

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#if defined(_OPENMP)
#include <omp.h>
#endif

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace anchor::kernels {

namespace {

inline float half_to_float(uint16_t h) {
    return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}
inline uint16_t float_to_half(float f) {
    return c10::Half(f).x;
}

// Thread ranges are multiples of this many rows (whole cache lines of y per thread for the usual shapes).
constexpr int64_t kRowGroup = 16;

// Splits [0, rows) into one contiguous range per thread (multiples of kRowGroup, so each thread streams one
// sequential stretch of the weights and the hardware prefetcher sees one stream) and runs range(r0, r1) on each.
template <class Range> void run_rows(int64_t rows, int64_t cols, Range range) {
    // Small products (GPT-2 tiny, a 64-wide layer) are not worth waking the thread pool for.
    const bool parallel = rows * cols >= (1 << 16) && rows >= 2 * kRowGroup;
#if defined(_OPENMP)
#pragma omp parallel if (parallel)
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t per = (rows + nt * kRowGroup - 1) / (nt * kRowGroup) * kRowGroup;
        const int64_t r0 = std::min(rows, t * per), r1 = std::min(rows, r0 + per);
        if (r0 < r1) range(r0, r1);
    }
#else
    (void)parallel;
    range(0, rows);
#endif
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_hadd_ps(lo, lo);
    lo = _mm_hadd_ps(lo, lo);
    return _mm_cvtss_f32(lo);
}

// ---- AVX2 / FMA (F16C) -----------------------------------------------------------------------------------------

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

// ---- AVX-512 ----------------------------------------------------------------------------------------------------
// One row at a time, front to back: the weights are read as one sequential stream, which the L2 streamer prefetches
// (interleaving several short rows puts several streams into one 4 KiB page, and the prefetcher follows one per page
// direction). Four independent FMA chains per row hide the FMA latency; x stays in L1. The row tail is one masked
// load, so any column count takes the vector path.

template <class Load>
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) inline float dot_avx512(const float* x,
                                                                                            int64_t cols, Load load) {
    const int64_t full = cols & ~int64_t(15);
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 64 <= full; c += 64) {
        a0 = _mm512_fmadd_ps(load(c), _mm512_loadu_ps(x + c), a0);
        a1 = _mm512_fmadd_ps(load(c + 16), _mm512_loadu_ps(x + c + 16), a1);
        a2 = _mm512_fmadd_ps(load(c + 32), _mm512_loadu_ps(x + c + 32), a2);
        a3 = _mm512_fmadd_ps(load(c + 48), _mm512_loadu_ps(x + c + 48), a3);
    }
    for (; c < full; c += 16) a0 = _mm512_fmadd_ps(load(c), _mm512_loadu_ps(x + c), a0);
    if (c < cols) {
        const __mmask16 tail = static_cast<__mmask16>((1u << (cols - c)) - 1);
        a1 = _mm512_fmadd_ps(load(c, tail), _mm512_maskz_loadu_ps(tail, x + c), a1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

struct LoadF32 {
    const float* w;
    __attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) __m512 operator()(int64_t c) const {
        return _mm512_loadu_ps(w + c);
    }
    __attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) __m512 operator()(int64_t c,
                                                                                          __mmask16 m) const {
        return _mm512_maskz_loadu_ps(m, w + c);
    }
};

struct LoadF16 {
    const uint16_t* w;
    __attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) __m512 operator()(int64_t c) const {
        return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c)));
    }
    __attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) __m512 operator()(int64_t c,
                                                                                          __mmask16 m) const {
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, w + c));
    }
};

__attribute__((target("avx512f,avx512bw,avx512vl"))) void
rows_f32_avx512(const float* w, const float* x, const float* b, float* y, int64_t r0, int64_t r1, int64_t cols) {
    for (int64_t r = r0; r < r1; ++r) y[r] = dot_avx512(x, cols, LoadF32{w + r * cols}) + (b ? b[r] : 0.f);
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) void
rows_f16_avx512(const uint16_t* w, const float* x, const float* b, float* y, int64_t r0, int64_t r1, int64_t cols) {
    for (int64_t r = r0; r < r1; ++r) y[r] = dot_avx512(x, cols, LoadF16{w + r * cols}) + (b ? b[r] : 0.f);
}

// ---- few rows -----------------------------------------------------------------------------------------------------
// n input rows against the same weights (a cached diffusion step computes a handful of positions): four weight rows
// at a time, each read from memory once and from L1 for the other input rows, so the weights stream once per call
// whatever n is. A BLAS GEMM packs the whole weight matrix first, which at a few rows costs more than the product.
// The first pass over a group of four rows also prefetches the group kPrefetchGroups on: with more than a few input
// rows a group computes long enough that the stream would otherwise wait on memory between groups (measured at 4-12 rows;
// one group ahead measured best of 0, 1, 2, 3 and 8 with kjv-mdlm's layers, tests/bench/linear_rows_bench).
constexpr int64_t kPrefetchGroups = 1;

// Where the first pass over rows [r, r + 4) prefetches from (null past the range's end).
inline const float* prefetch_target(const float* w, int64_t r, int64_t r1, int64_t cols) {
    return r + 4 * (kPrefetchGroups + 1) <= r1 ? w + (r + 4 * kPrefetchGroups) * cols : nullptr;
}

// The driver of a tile: groups of four weight rows, MAXR input rows per tile and the remainder in one narrower tile,
// the weight rows past the last whole group one at a time (DOT: one row's dot with x row j).
#define ANCHOR_ROWS_MULTI(TARGET, NAME, TILE, MAXR, DOT)                                                               \
    __attribute__((target(TARGET))) void NAME(const float* w, const float* x, const float* b, float* y, int64_t n,     \
                                              int64_t rows, int64_t r0, int64_t r1, int64_t cols) {                    \
        int64_t r = r0;                                                                                                \
        for (; r + 4 <= r1; r += 4) {                                                                                  \
            const __m128 bias = b ? _mm_loadu_ps(b + r) : _mm_setzero_ps();                                            \
            const float* ahead = prefetch_target(w, r, r1, cols);                                                      \
            const float* wr = w + r * cols;                                                                            \
            int64_t j = 0;                                                                                             \
            for (; j + MAXR <= n; j += MAXR, ahead = nullptr)                                                          \
                TILE<MAXR>(wr, x + j * cols, bias, y + j * rows + r, rows, cols, ahead);                               \
            const int64_t rest = n - j;                                                                                \
            if constexpr (MAXR > 3)                                                                                    \
                if (rest == 3) TILE<3>(wr, x + j * cols, bias, y + j * rows + r, rows, cols, ahead);                   \
            if constexpr (MAXR > 2)                                                                                    \
                if (rest == 2) TILE<2>(wr, x + j * cols, bias, y + j * rows + r, rows, cols, ahead);                   \
            if (rest == 1) TILE<1>(wr, x + j * cols, bias, y + j * rows + r, rows, cols, ahead);                       \
        }                                                                                                              \
        for (; r < r1; ++r)                                                                                            \
            for (int64_t j = 0; j < n; ++j) y[j * rows + r] = DOT + (b ? b[r] : 0.f);                                  \
    }

// AVX2 / FMA: the same tile eight columns wide, up to two input rows (sixteen registers: 8 accumulators, 4 weight
// vectors, the input), the column tail through a lane mask.
template <int XR>
__attribute__((target("avx2,fma"), always_inline)) inline void
multi_tile_avx2(const float* w0, const float* x, const __m128 bias, float* y, int64_t rows, int64_t cols,
                const float* pf) {
    const int64_t full = cols & ~int64_t(7);
    const float *w1 = w0 + cols, *w2 = w1 + cols, *w3 = w2 + cols;
    __m256 a[XR][4];
    for (int j = 0; j < XR; ++j)
        for (int k = 0; k < 4; ++k) a[j][k] = _mm256_setzero_ps();
#define ANCHOR_FMA4(J, XV)                                                                                             \
    do {                                                                                                               \
        const __m256 xv_ = (XV);                                                                                       \
        a[J][0] = _mm256_fmadd_ps(v0, xv_, a[J][0]);                                                                   \
        a[J][1] = _mm256_fmadd_ps(v1, xv_, a[J][1]);                                                                   \
        a[J][2] = _mm256_fmadd_ps(v2, xv_, a[J][2]);                                                                   \
        a[J][3] = _mm256_fmadd_ps(v3, xv_, a[J][3]);                                                                   \
    } while (0)
    for (int64_t c = 0; c < full; c += 8) {
        if (pf && c % 16 == 0) // one cache line of each of the four rows a later pass reads
            for (int k = 0; k < 4; ++k) _mm_prefetch(reinterpret_cast<const char*>(pf + k * cols + c), _MM_HINT_T0);
        const __m256 v0 = _mm256_loadu_ps(w0 + c), v1 = _mm256_loadu_ps(w1 + c), v2 = _mm256_loadu_ps(w2 + c),
                     v3 = _mm256_loadu_ps(w3 + c);
        for (int j = 0; j < XR; ++j) ANCHOR_FMA4(j, _mm256_loadu_ps(x + j * cols + c));
    }
    if (full < cols) {
        alignas(32) int32_t lanes[8];
        for (int i = 0; i < 8; ++i) lanes[i] = full + i < cols ? -1 : 0;
        const __m256i m = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
        const __m256 v0 = _mm256_maskload_ps(w0 + full, m), v1 = _mm256_maskload_ps(w1 + full, m),
                     v2 = _mm256_maskload_ps(w2 + full, m), v3 = _mm256_maskload_ps(w3 + full, m);
        for (int j = 0; j < XR; ++j) ANCHOR_FMA4(j, _mm256_maskload_ps(x + j * cols + full, m));
    }
#undef ANCHOR_FMA4
    for (int j = 0; j < XR; ++j) {
        const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[j][0], a[j][1]), _mm256_hadd_ps(a[j][2], a[j][3]));
        _mm_storeu_ps(y + j * rows,
                      _mm_add_ps(_mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)), bias));
    }
}

ANCHOR_ROWS_MULTI("avx2,fma", rows_multi_f32_avx2, multi_tile_avx2, 2, dot_f32_avx2(x + j * cols, w + r * cols, cols))

__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) inline __m256 hi256(__m512 v) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

// Sums of four accumulators, in one vector: lane k of the result is the total of a_k (a transpose-and-add tree, three
// levels instead of four full reductions).
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) inline __m128 reduce4_avx512(__m512 a0, __m512 a1,
                                                                                                 __m512 a2, __m512 a3) {
    // 512 -> 256: add the halves of each.
    const __m256 h0 = _mm256_add_ps(_mm512_castps512_ps256(a0), hi256(a0));
    const __m256 h1 = _mm256_add_ps(_mm512_castps512_ps256(a1), hi256(a1));
    const __m256 h2 = _mm256_add_ps(_mm512_castps512_ps256(a2), hi256(a2));
    const __m256 h3 = _mm256_add_ps(_mm512_castps512_ps256(a3), hi256(a3));
    // Pairwise: hadd(h0, h1) holds partial sums of h0 and h1 interleaved per 128-bit lane.
    const __m256 s01 = _mm256_hadd_ps(h0, h1), s23 = _mm256_hadd_ps(h2, h3);
    const __m256 s = _mm256_hadd_ps(s01, s23); // per 128-bit lane: [a0 a1 a2 a3] partials
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// XR input rows against four weight rows per pass: 4 * XR accumulators; per 16 columns 4 + XR loads for 4 * XR FMAs
// (with 4 input rows, one load per two FMAs: the rate at which cores that split 512-bit loads can feed them).
template <int XR>
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) inline void
multi_tile_avx512(const float* w0, const float* x, const __m128 bias, float* y, int64_t rows, int64_t cols,
                  const float* pf) {
    const int64_t full = cols & ~int64_t(15);
    const __mmask16 tail = static_cast<__mmask16>((1u << (cols - full)) - 1);
    const float *w1 = w0 + cols, *w2 = w1 + cols, *w3 = w2 + cols;
    __m512 a[XR][4];
    for (int j = 0; j < XR; ++j)
        for (int k = 0; k < 4; ++k) a[j][k] = _mm512_setzero_ps();
    for (int64_t c = 0; c < full; c += 16) {
        if (pf) // one cache line of each of the four rows a later pass reads
            for (int k = 0; k < 4; ++k) _mm_prefetch(reinterpret_cast<const char*>(pf + k * cols + c), _MM_HINT_T0);
        const __m512 v0 = _mm512_loadu_ps(w0 + c), v1 = _mm512_loadu_ps(w1 + c), v2 = _mm512_loadu_ps(w2 + c),
                     v3 = _mm512_loadu_ps(w3 + c);
        for (int j = 0; j < XR; ++j) {
            const __m512 xv = _mm512_loadu_ps(x + j * cols + c);
            a[j][0] = _mm512_fmadd_ps(v0, xv, a[j][0]);
            a[j][1] = _mm512_fmadd_ps(v1, xv, a[j][1]);
            a[j][2] = _mm512_fmadd_ps(v2, xv, a[j][2]);
            a[j][3] = _mm512_fmadd_ps(v3, xv, a[j][3]);
        }
    }
    if (tail) {
        const __m512 v0 = _mm512_maskz_loadu_ps(tail, w0 + full), v1 = _mm512_maskz_loadu_ps(tail, w1 + full),
                     v2 = _mm512_maskz_loadu_ps(tail, w2 + full), v3 = _mm512_maskz_loadu_ps(tail, w3 + full);
        for (int j = 0; j < XR; ++j) {
            const __m512 xv = _mm512_maskz_loadu_ps(tail, x + j * cols + full);
            a[j][0] = _mm512_fmadd_ps(v0, xv, a[j][0]);
            a[j][1] = _mm512_fmadd_ps(v1, xv, a[j][1]);
            a[j][2] = _mm512_fmadd_ps(v2, xv, a[j][2]);
            a[j][3] = _mm512_fmadd_ps(v3, xv, a[j][3]);
        }
    }
    for (int j = 0; j < XR; ++j)
        _mm_storeu_ps(y + j * rows, _mm_add_ps(reduce4_avx512(a[j][0], a[j][1], a[j][2], a[j][3]), bias));
}

ANCHOR_ROWS_MULTI("avx512f,avx512bw,avx512vl", rows_multi_f32_avx512, multi_tile_avx512, 4,
                  dot_avx512(x + j * cols, cols, LoadF32{w + r * cols}))
#undef ANCHOR_ROWS_MULTI

// ---- q8_0 ---------------------------------------------------------------------------------------------------------
// Per block: |w| (unsigned) times x with w's sign moved onto it (the sign trick of llama.cpp's AVX2 q8_0 dot), summed
// in int32 (vpdpbusd with VNNI; maddubs + madd on plain AVX2 - no saturation, |w| <= 127 so pairs stay < 2^15),
// converted once and scaled by d_w * d_x. One row at a time, front to back, as the f32/f16 kernels.

#define ANCHOR_Q8_ROWS(TARGET, NAME, DOT)                                                                              \
    __attribute__((target(TARGET))) void NAME(const BlockQ8_0* w, const float* xd, const int8_t* xq, const float* b,   \
                                              float* y, int64_t r0, int64_t r1, int64_t nb) {                          \
        for (int64_t r = r0; r < r1; ++r) {                                                                            \
            const BlockQ8_0* wr = w + r * nb;                                                                          \
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();                                                 \
            int64_t i = 0;                                                                                             \
            for (; i + 2 <= nb; i += 2) {                                                                              \
                a0 = DOT(wr[i], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * kQ8Block)), xd[i], a0);   \
                a1 = DOT(wr[i + 1], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (i + 1) * kQ8Block)),     \
                         xd[i + 1], a1);                                                                               \
            }                                                                                                          \
            if (i < nb)                                                                                                \
                a0 = DOT(wr[i], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * kQ8Block)), xd[i], a0);   \
            y[r] = hsum(_mm256_add_ps(a0, a1)) + (b ? b[r] : 0.f);                                                     \
        }                                                                                                              \
    }

__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni"))) inline __m256
dot_block_vnni(const BlockQ8_0& blk, __m256i xv, float dx, __m256 acc) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.q));
    const __m256i s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(_cvtsh_ss(blk.d) * dx), acc);
}

__attribute__((target("avx2,fma,f16c"))) inline __m256 dot_block_avx2(const BlockQ8_0& blk, __m256i xv, float dx,
                                                                      __m256 acc) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.q));
    const __m256i p16 = _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv));
    const __m256i s = _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(_cvtsh_ss(blk.d) * dx), acc);
}

ANCHOR_Q8_ROWS("avx2,fma,f16c,avx512f,avx512vl,avx512vnni", rows_q8_vnni, dot_block_vnni)
ANCHOR_Q8_ROWS("avx2,fma,f16c", rows_q8_avx2, dot_block_avx2)
#undef ANCHOR_Q8_ROWS

// ---- q4_0 ---------------------------------------------------------------------------------------------------------
// The 4-bit codes c in [0, 15] widened to one byte each (low nibbles: values 0-15, high nibbles: 16-31, the block's
// order), multiplied unsigned by the signed activation quants and summed in int32; the offset is applied per block
// as sum((c - 8) x) = sum(c x) - 8 sum(x), with sum(x) of each activation block computed once per product.
__attribute__((target("avx2"))) inline __m256i q4_codes(const BlockQ4_0& blk) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.qs));
    const __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
    return _mm256_set_m128i(hi, lo);
}

#define ANCHOR_Q4_ROWS(TARGET, NAME, DOT)                                                                              \
    __attribute__((target(TARGET))) void NAME(const BlockQ4_0* w, const float* xd, const int8_t* xq,                   \
                                              const int32_t* xs, const float* b, float* y, int64_t r0, int64_t r1,     \
                                              int64_t nb) {                                                            \
        for (int64_t r = r0; r < r1; ++r) {                                                                            \
            const BlockQ4_0* wr = w + r * nb;                                                                          \
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();                                                 \
            int64_t i = 0;                                                                                             \
            for (; i + 2 <= nb; i += 2) {                                                                              \
                a0 = DOT(wr[i], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * kQ4Block)), xs[i], xd[i], \
                         a0);                                                                                          \
                a1 = DOT(wr[i + 1], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (i + 1) * kQ4Block)),     \
                         xs[i + 1], xd[i + 1], a1);                                                                    \
            }                                                                                                          \
            if (i < nb)                                                                                                \
                a0 = DOT(wr[i], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * kQ4Block)), xs[i], xd[i], \
                         a0);                                                                                          \
            y[r] = hsum(_mm256_add_ps(a0, a1)) + (b ? b[r] : 0.f);                                                     \
        }                                                                                                              \
    }

// One block's contribution, all in the first lane: the int32 lanes' sum minus 8 * sum(x) is added to lane 0 before
// the conversion, so the block's integer dot stays exact.
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni"))) inline __m256
dot_q4_block_vnni(const BlockQ4_0& blk, __m256i xv, int32_t xsum, float dx, __m256 acc) {
    __m256i s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q4_codes(blk), xv);
    s = _mm256_sub_epi32(s, _mm256_setr_epi32(8 * xsum, 0, 0, 0, 0, 0, 0, 0));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(_cvtsh_ss(blk.d) * dx), acc);
}

__attribute__((target("avx2,fma,f16c"))) inline __m256 dot_q4_block_avx2(const BlockQ4_0& blk, __m256i xv,
                                                                         int32_t xsum, float dx, __m256 acc) {
    // codes <= 15 and |x| <= 127: each pair of products stays below 2^15 (no saturation in maddubs)
    const __m256i p16 = _mm256_maddubs_epi16(q4_codes(blk), xv);
    __m256i s = _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
    s = _mm256_sub_epi32(s, _mm256_setr_epi32(8 * xsum, 0, 0, 0, 0, 0, 0, 0));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(_cvtsh_ss(blk.d) * dx), acc);
}

ANCHOR_Q4_ROWS("avx2,fma,f16c,avx512f,avx512vl,avx512vnni", rows_q4_vnni, dot_q4_block_vnni)
ANCHOR_Q4_ROWS("avx2,fma,f16c", rows_q4_avx2, dot_q4_block_avx2)
#undef ANCHOR_Q4_ROWS
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

// One block's exact int32 dot with the activation quants of the same 32 positions (q8_0: q * x; q4_0: (c - 8) * x).
inline int32_t block_dot_int(const BlockQ8_0& blk, const int8_t* x) {
    int32_t s = 0;
    for (int64_t i = 0; i < kQ8Block; ++i) s += int32_t(blk.q[i]) * int32_t(x[i]);
    return s;
}

// Value j of a q4_0 block, in [-8, 7].
inline int32_t q4_value(const BlockQ4_0& blk, int64_t j) {
    const uint8_t byte = blk.qs[j % (kQ4Block / 2)];
    return int32_t(j < kQ4Block / 2 ? byte & 0x0F : byte >> 4) - 8;
}

inline int32_t block_dot_int(const BlockQ4_0& blk, const int8_t* x) {
    int32_t s = 0;
    for (int64_t j = 0; j < kQ4Block; ++j) s += q4_value(blk, j) * int32_t(x[j]);
    return s;
}

// The portable rows of a block-format product (q8_0, q4_0; both 32 values per block): per block the int32 dot
// scaled by d_w * d_x, summed in float.
template <class Block>
void rows_blocks_plain(const Block* w, const float* xd, const int8_t* xq, const float* b, float* y, int64_t r0,
                       int64_t r1, int64_t nb) {
    for (int64_t r = r0; r < r1; ++r) {
        const Block* wr = w + r * nb;
        float s = 0.f;
        for (int64_t i = 0; i < nb; ++i)
            s += float(block_dot_int(wr[i], xq + i * kQ8Block)) * (half_to_float(wr[i].d) * xd[i]);
        y[r] = s + (b ? b[r] : 0.f);
    }
}

// The reference of a block-format product: x quantised to q8_0 blocks, each block's int32 dot times d_w * d_x,
// summed in double.
template <class Block>
void gemv_ref_blocks(const Block* w, const float* x, const float* b, float* y, int64_t rows, int64_t cols) {
    const int64_t nb = q8_0_blocks(cols);
    std::vector<float> xd(static_cast<size_t>(nb));
    std::vector<int8_t> xq(static_cast<size_t>(nb * kQ8Block));
    quantize_activation_q8_0(x, xd.data(), xq.data(), cols);
    for (int64_t r = 0; r < rows; ++r) {
        double s = b ? b[r] : 0.0;
        for (int64_t i = 0; i < nb; ++i)
            s += double(block_dot_int(w[r * nb + i], xq.data() + i * kQ8Block)) * half_to_float(w[r * nb + i].d) *
                 xd[i];
        y[r] = static_cast<float>(s);
    }
}

template <class T, class Dot>
void gemv_rows(const T* w, const float* x, const float* b, float* y, int64_t rows, int64_t cols, Dot dot) {
    run_rows(rows, cols, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) y[r] = dot(w + r * cols, x, cols) + (b ? b[r] : 0.f);
    });
}

// Block scale and quants of n <= 32 values (the rest of the block zero): ggml's quantize_row_q8_0_ref.
float quantize_block(const float* v, int64_t n, int8_t* q) {
    float amax = 0.f;
    for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    for (int64_t i = 0; i < kQ8Block; ++i) q[i] = i < n ? static_cast<int8_t>(std::lround(v[i] * id)) : 0;
    return d;
}

#if defined(__x86_64__)
// quantize_block for whole rows, 16 values per step, bit-identical to it: the same amax, d = amax / 127 and
// 1 / d, the same float product, and roundf's rounding (half away from zero) as trunc plus a step where the
// remainder is >= 0.5 in magnitude (the remainder x - trunc(x) is exact).
__attribute__((target("avx512f,avx512bw,avx512vl"))) void quantize_activation_avx512(const float* x, float* d,
                                                                                     int8_t* q, int64_t n) {
    const int64_t nb = q8_0_blocks(n);
    for (int64_t i = 0; i < nb; ++i) {
        const int64_t c0 = i * kQ8Block, m = std::min(kQ8Block, n - c0);
        const __mmask16 k0 = m >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << m) - 1);
        const __mmask16 k1 = m >= 32 ? __mmask16(0xFFFF) : m > 16 ? __mmask16((1u << (m - 16)) - 1) : __mmask16(0);
        const __m512 v0 = _mm512_maskz_loadu_ps(k0, x + c0), v1 = _mm512_maskz_loadu_ps(k1, x + c0 + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float dd = amax / 127.f, id = dd != 0.f ? 1.f / dd : 0.f;
        d[i] = dd;
        const __m512 idv = _mm512_set1_ps(id), half = _mm512_set1_ps(0.5f);
        for (int h = 0; h < 2; ++h) {
            const __m512 p = _mm512_mul_ps(h ? v1 : v0, idv);
            __m512 t = _mm512_roundscale_ps(p, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            const __mmask16 up = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(p, t)), half, _CMP_GE_OQ);
            const __m512 sign = _mm512_castsi512_ps(
                _mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(p), _mm512_set1_epi32(INT32_MIN)),
                                _mm512_castps_si512(_mm512_set1_ps(1.f))));
            t = _mm512_mask_add_ps(t, up, t, sign);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(q + c0 + 16 * h),
                             _mm512_cvtsepi32_epi8(_mm512_cvttps_epi32(t)));
        }
    }
}
#endif

} // namespace

bool gemv_uses_avx2() {
    const auto& f = cpu_features();
    return f.avx2 && f.fma && f.f16c;
}

bool gemv_uses_avx512() {
    const auto& f = cpu_features();
    return gemv_uses_avx2() && f.avx512f && f.avx512bw && f.avx512vl;
}

std::string gemv_isa() {
    return gemv_uses_avx512() ? "AVX-512 gemv" : gemv_uses_avx2() ? "AVX2/FMA gemv" : "portable gemv";
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
    if (gemv_uses_avx512())
        return run_rows(rows, cols, [&](int64_t r0, int64_t r1) { rows_f32_avx512(w, x, b, y, r0, r1, cols); });
    if (gemv_uses_avx2()) return gemv_rows(w, x, b, y, rows, cols, dot_f32_avx2);
#endif
    gemv_rows(w, x, b, y, rows, cols, dot_f32_plain);
}

void gemm_few_rows_f32(const float* w, const float* x, const float* b, float* y, int64_t n, int64_t rows, int64_t cols,
                       SimdPath path) {
#if defined(__x86_64__)
    if (path == SimdPath::Best && gemv_uses_avx512())
        return run_rows(rows, cols * n,
                        [&](int64_t r0, int64_t r1) { rows_multi_f32_avx512(w, x, b, y, n, rows, r0, r1, cols); });
    if (path != SimdPath::Portable && gemv_uses_avx2())
        return run_rows(rows, cols * n,
                        [&](int64_t r0, int64_t r1) { rows_multi_f32_avx2(w, x, b, y, n, rows, r0, r1, cols); });
#endif
    run_rows(rows, cols * n, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r)
            for (int64_t j = 0; j < n; ++j)
                y[j * rows + r] = dot_f32_plain(w + r * cols, x + j * cols, cols) + (b ? b[r] : 0.f);
    });
}

void gemv_f16(const uint16_t* w, const float* x, const float* b, float* y, int64_t rows, int64_t cols) {
#if defined(__x86_64__)
    if (gemv_uses_avx512())
        return run_rows(rows, cols, [&](int64_t r0, int64_t r1) { rows_f16_avx512(w, x, b, y, r0, r1, cols); });
    if (gemv_uses_avx2()) return gemv_rows(w, x, b, y, rows, cols, dot_f16_avx2);
#endif
    gemv_rows(w, x, b, y, rows, cols, dot_f16_plain);
}

// ---- q8_0 -----------------------------------------------------------------------------------------------------------

void quantize_row_q8_0(const float* v, BlockQ8_0* out, int64_t n) {
    for (int64_t i = 0; i < q8_0_blocks(n); ++i) {
        const int64_t c0 = i * kQ8Block;
        out[i].d = float_to_half(quantize_block(v + c0, std::min(kQ8Block, n - c0), out[i].q));
    }
}

void dequantize_row_q8_0(const BlockQ8_0* in, float* v, int64_t n) {
    for (int64_t c0 = 0; c0 < n; c0 += kQ8Block) {
        const BlockQ8_0& blk = in[c0 / kQ8Block];
        const float d = half_to_float(blk.d);
        const int64_t m = std::min(kQ8Block, n - c0);
        for (int64_t j = 0; j < m; ++j) v[c0 + j] = d * float(blk.q[j]);
    }
}

void quantize_activation_q8_0(const float* x, float* d, int8_t* q, int64_t n) {
#if defined(__x86_64__)
    if (gemv_uses_avx512()) return quantize_activation_avx512(x, d, q, n);
#endif
    for (int64_t i = 0; i < q8_0_blocks(n); ++i) {
        const int64_t c0 = i * kQ8Block;
        d[i] = quantize_block(x + c0, std::min(kQ8Block, n - c0), q + c0);
    }
}

void gemv_ref_q8_0(const BlockQ8_0* w, const float* x, const float* b, float* y, int64_t rows, int64_t cols) {
    gemv_ref_blocks(w, x, b, y, rows, cols);
}

void gemv_q8_0(const BlockQ8_0* w, const float* x, const float* b, float* y, int64_t rows, int64_t cols) {
    const int64_t nb = q8_0_blocks(cols);
    // x is quantised once per product (cols values), then read by every row from L1.
    alignas(64) float xd_stack[256];
    alignas(64) int8_t xq_stack[256 * kQ8Block];
    std::vector<float> xd_heap;
    std::vector<int8_t> xq_heap;
    float* xd = xd_stack;
    int8_t* xq = xq_stack;
    if (nb > 256) {
        xd_heap.resize(static_cast<size_t>(nb));
        xq_heap.resize(static_cast<size_t>(nb * kQ8Block));
        xd = xd_heap.data();
        xq = xq_heap.data();
    }
    quantize_activation_q8_0(x, xd, xq, cols);
#if defined(__x86_64__)
    const auto& f = cpu_features();
    if (gemv_uses_avx2() && f.avx512f && f.avx512vl && f.avx512vnni)
        return run_rows(rows, cols, [&](int64_t r0, int64_t r1) { rows_q8_vnni(w, xd, xq, b, y, r0, r1, nb); });
    if (gemv_uses_avx2())
        return run_rows(rows, cols, [&](int64_t r0, int64_t r1) { rows_q8_avx2(w, xd, xq, b, y, r0, r1, nb); });
#endif
    run_rows(rows, cols, [&](int64_t r0, int64_t r1) { rows_blocks_plain(w, xd, xq, b, y, r0, r1, nb); });
}


namespace {
// The bias of a tensor-form gemv as contiguous float32 [rows] (undefined when there is none); anchor::Error naming
// `who` when its length is not the row count.
torch::Tensor float_bias(const torch::Tensor& bias, int64_t rows, const char* who) {
    if (!bias.defined()) return {};
    if (bias.numel() != rows)
        throw Error(std::string(who) + ": bias has " + std::to_string(bias.numel()) + " values for " +
                    std::to_string(rows) + " rows");
    return bias.to(torch::kFloat32).contiguous();
}
} // namespace

namespace {
// The tensor forms of a block format (q8_0, q4_0): rows of w quantised into `Block`s by `row`, and the product of such
// rows with x through `gemv`; `who` names the function in errors.
template <class Block>
torch::Tensor quantize_block_rows(const torch::Tensor& w_in, const char* who, int64_t block_values,
                                  void (*row)(const float*, Block*, int64_t)) {
    if (w_in.dim() != 2)
        throw Error(std::string(who) + ": weight must be 2-D, got " + std::to_string(w_in.dim()) + "-D");
    auto w = w_in.detach().to(torch::kCPU).to(torch::kFloat32).contiguous();
    const int64_t rows = w.size(0), cols = w.size(1), nb = (cols + block_values - 1) / block_values;
    auto out = torch::empty({rows, nb * int64_t(sizeof(Block))}, torch::kUInt8);
    const float* src = w.data_ptr<float>();
    auto* dst = reinterpret_cast<Block*>(out.data_ptr<uint8_t>());
    at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) row(src + r * cols, dst + r * nb, cols);
    });
    return out;
}

template <class Block>
torch::Tensor gemv_block_rows(const torch::Tensor& wq, const torch::Tensor& x_in, const torch::Tensor& bias,
                              const char* who, const char* format, int64_t block_values,
                              void (*gemv)(const Block*, const float*, const float*, float*, int64_t, int64_t)) {
    const int64_t cols = x_in.numel(), row_bytes = (cols + block_values - 1) / block_values * int64_t(sizeof(Block));
    if (wq.dim() != 2 || wq.scalar_type() != torch::kUInt8 || !wq.is_contiguous() || !wq.device().is_cpu() ||
        wq.size(1) != row_bytes)
        throw Error(std::string(who) + ": weight must be contiguous CPU uint8 [rows, " + std::to_string(row_bytes) +
                    "] " + format + " blocks for " + std::to_string(cols) + " inputs");
    const int64_t rows = wq.size(0);
    auto x = x_in.reshape({cols}).to(torch::kFloat32).contiguous();
    const torch::Tensor b = float_bias(bias, rows, who);
    auto y = torch::empty({rows}, torch::kFloat32);
    gemv(reinterpret_cast<const Block*>(wq.data_ptr<uint8_t>()), x.data_ptr<float>(),
         b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>(), rows, cols);
    return y;
}
} // namespace

torch::Tensor quantize_q8_0(const torch::Tensor& w) {
    return quantize_block_rows<BlockQ8_0>(w, "quantize_q8_0", kQ8Block, quantize_row_q8_0);
}

torch::Tensor gemv_q8_0(const torch::Tensor& wq, const torch::Tensor& x, const torch::Tensor& bias) {
    return gemv_block_rows<BlockQ8_0>(wq, x, bias, "gemv_q8_0", "q8_0", kQ8Block, gemv_q8_0);
}

torch::Tensor quantize_q4_0(const torch::Tensor& w) {
    return quantize_block_rows<BlockQ4_0>(w, "quantize_q4_0", kQ4Block, quantize_row_q4_0);
}

torch::Tensor gemv_q4_0(const torch::Tensor& wq, const torch::Tensor& x, const torch::Tensor& bias) {
    return gemv_block_rows<BlockQ4_0>(wq, x, bias, "gemv_q4_0", "q4_0", kQ4Block, gemv_q4_0);
}


// ---- q4_0 -----------------------------------------------------------------------------------------------------------

void quantize_row_q4_0(const float* v, BlockQ4_0* out, int64_t n) {
    for (int64_t i = 0; i < q4_0_blocks(n); ++i) {
        const int64_t c0 = i * kQ4Block, m = std::min(kQ4Block, n - c0);
        // The value of largest magnitude keeps its sign: it maps to code 0 (-8 d), the others into [0, 15].
        float amax = 0.f, vmax = 0.f;
        for (int64_t j = 0; j < m; ++j)
            if (amax < std::fabs(v[c0 + j])) amax = std::fabs(v[c0 + j]), vmax = v[c0 + j];
        const float d = vmax / -8.f, id = d != 0.f ? 1.f / d : 0.f;
        out[i].d = float_to_half(d);
        for (int64_t j = 0; j < kQ4Block / 2; ++j) {
            const float x0 = j < m ? v[c0 + j] * id : 0.f, x1 = j + kQ4Block / 2 < m ? v[c0 + j + 16] * id : 0.f;
            const auto code = [](float x) { return uint8_t(std::min(15, int(int8_t(x + 8.5f)))); };
            out[i].qs[j] = uint8_t(code(x0) | (code(x1) << 4));
        }
    }
}

void dequantize_row_q4_0(const BlockQ4_0* in, float* v, int64_t n) {
    for (int64_t c = 0; c < n; ++c) {
        const BlockQ4_0& blk = in[c / kQ4Block];
        v[c] = float(q4_value(blk, c % kQ4Block)) * half_to_float(blk.d);
    }
}

void gemv_ref_q4_0(const BlockQ4_0* w, const float* x, const float* b, float* y, int64_t rows, int64_t cols) {
    gemv_ref_blocks(w, x, b, y, rows, cols);
}

void gemv_q4_0(const BlockQ4_0* w, const float* x, const float* b, float* y, int64_t rows, int64_t cols) {
    static_assert(kQ4Block == kQ8Block, "q4_0 weights pair with q8_0 activation blocks");
    const int64_t nb = q4_0_blocks(cols);
    std::vector<float> xd(static_cast<size_t>(nb));
    std::vector<int8_t> xq(static_cast<size_t>(nb * kQ4Block));
    quantize_activation_q8_0(x, xd.data(), xq.data(), cols);
#if defined(__x86_64__)
    const auto& f = cpu_features();
    if (gemv_uses_avx2()) {
        std::vector<int32_t> xs(static_cast<size_t>(nb), 0);
        for (int64_t i = 0; i < nb; ++i)
            for (int64_t j = 0; j < kQ4Block; ++j) xs[size_t(i)] += xq[size_t(i * kQ4Block + j)];
        if (f.avx512f && f.avx512vl && f.avx512vnni)
            return run_rows(rows, cols, [&](int64_t r0, int64_t r1) {
                rows_q4_vnni(w, xd.data(), xq.data(), xs.data(), b, y, r0, r1, nb);
            });
        return run_rows(rows, cols, [&](int64_t r0, int64_t r1) {
            rows_q4_avx2(w, xd.data(), xq.data(), xs.data(), b, y, r0, r1, nb);
        });
    }
#endif
    run_rows(rows, cols, [&](int64_t r0, int64_t r1) { rows_blocks_plain(w, xd.data(), xq.data(), b, y, r0, r1, nb); });
}



torch::Tensor huge_page_copy(const torch::Tensor& t_in) {
    auto t = t_in.detach().to(torch::kCPU).contiguous();
    constexpr size_t kHuge = size_t(2) << 20;
    const size_t bytes = t.nbytes();
#if defined(__linux__)
    if (bytes >= kHuge) {
        const size_t alloc = (bytes + kHuge - 1) / kHuge * kHuge;
        void* p = std::aligned_alloc(kHuge, alloc);
        if (!p) throw Error("huge_page_copy: cannot allocate " + std::to_string(alloc) + " bytes");
        madvise(p, alloc, MADV_HUGEPAGE);    // advisory: without THP the copy is still correct, on 4 KiB pages
        std::memcpy(p, t.data_ptr(), bytes); // first touch after the advice: the faults map huge pages
        return torch::from_blob(
            p, t.sizes(), [](void* q) { std::free(q); }, t.options());
    }
#endif
    return t.clone();
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
    const torch::Tensor b = float_bias(bias, rows, "gemv");
    auto y = torch::empty({rows}, torch::kFloat32);
    const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
    if (w.scalar_type() == torch::kFloat32)
        gemv_f32(w.data_ptr<float>(), x.data_ptr<float>(), bp, y.data_ptr<float>(), rows, cols);
    else
        gemv_f16(reinterpret_cast<const uint16_t*>(w.data_ptr<at::Half>()), x.data_ptr<float>(), bp,
                 y.data_ptr<float>(), rows, cols);
    return y;
}

bool few_rows_linear_applies(const torch::Tensor& x, const torch::Tensor& w, int64_t max_rows) {
    if (!gemv_uses_avx2() || x.dim() < 1 || w.dim() != 2 || !x.device().is_cpu() || !w.device().is_cpu() ||
        x.scalar_type() != torch::kFloat32 || w.scalar_type() != torch::kFloat32 || !w.is_contiguous())
        return false;
    // No autograd graph through the raw kernel: training keeps LibTorch's op.
    if (torch::GradMode::is_enabled() && (x.requires_grad() || w.requires_grad())) return false;
    const int64_t cols = w.size(1);
    return x.size(-1) == cols && cols > 0 && x.numel() / cols <= max_rows;
}

torch::Tensor few_rows_linear(const torch::Tensor& x_in, const torch::Tensor& w, const torch::Tensor& bias,
                              SimdPath path) {
    const int64_t rows = w.size(0), cols = w.size(1), n = x_in.numel() / cols;
    auto x = x_in.contiguous();
    const torch::Tensor b = float_bias(bias, rows, "few_rows_linear");
    auto sizes = x.sizes().vec();
    sizes.back() = rows;
    auto y = torch::empty(sizes, torch::kFloat32);
    gemm_few_rows_f32(w.data_ptr<float>(), x.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr,
                      y.data_ptr<float>(), n, rows, cols, path);
    return y;
}

// ---- packed q8_0 / q4_0 rows (kernels/gemv_packed.h) ------------------------------------------------------------------

namespace {

constexpr int64_t kPkGroup = 8; // blocks per 256 columns: the unit a packed row is made of

// Where block `blk` of a row of `nb` blocks keeps its scale: chunks of 16 blocks store theirs in the kernel's lane order
// (lane 4k + j holds quad j's block k), a trailing chunk of 8 in the order of the lanes it fills (0, 1, 4, 5, ...).
inline int64_t pk_scale_slot(int64_t blk, int64_t nb) {
    const int64_t c = blk / 16, r = blk % 16, j = r / 4, k = r % 4;
    return 16 * c + (16 * c + 16 <= nb ? 4 * k + j : 2 * k + j);
}

// The kernel's lane of block `blk` in its chunk's vector of 16 block sums (the activation scales and sums are stored
// per lane, zero in the lanes a trailing chunk of 8 leaves empty).
inline int64_t pk_lane(int64_t blk) {
    return 16 * (blk / 16) + 4 * (blk % 4) + (blk % 16) / 4;
}

// Byte offset of value t of block `blk` in a row's quants: quad blk / 4, vector A (t < 16) or B, slot blk % 4.
inline int64_t pk_q8_offset(int64_t blk, int64_t t) {
    return blk / 4 * 128 + (t < 16 ? 0 : 64) + 16 * (blk % 4) + t % 16;
}

// The activations of one packed product: x quantised to q8_0 blocks and laid out as the weights' quads (A: values
// 0-15 of four blocks, B: 16-31), with per 16-block chunk the lane-ordered scales d_x and offset * sum(q_x).
struct PkActivation {
    std::vector<int8_t> q, xa;
    std::vector<float> d, xd;
    std::vector<int32_t> xs;
};

#if defined(__x86_64__)
// pk_prepare's lay-out of the quantised activations, a block per step: its two 16-byte halves to the quad slots and
// the sum of its 32 quants by vpsadbw on the quants biased to unsigned (minus 32 * 128).
__attribute__((target("avx2"))) void pk_scatter_avx2(PkActivation& a, int64_t nb, int32_t offset) {
    const __m256i bias = _mm256_set1_epi8(int8_t(0x80));
    for (int64_t blk = 0; blk < nb; ++blk) {
        const int8_t* qb = a.q.data() + blk * kQ8Block;
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(a.xa.data() + pk_q8_offset(blk, 0)), _mm256_castsi256_si128(v));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(a.xa.data() + pk_q8_offset(blk, 16)),
                         _mm256_extracti128_si256(v, 1));
        const __m256i sad = _mm256_sad_epu8(_mm256_xor_si256(v, bias), _mm256_setzero_si256());
        const __m128i s2 = _mm_add_epi64(_mm256_castsi256_si128(sad), _mm256_extracti128_si256(sad, 1));
        const int32_t s = int32_t(_mm_cvtsi128_si64(s2) + _mm_extract_epi64(s2, 1)) - 32 * 128;
        a.xs[size_t(pk_lane(blk))] = offset * s;
        a.xd[size_t(pk_lane(blk))] = a.d[size_t(blk)];
    }
}
#endif

void pk_prepare(const float* x, int64_t cols, int32_t offset, PkActivation& a) {
    const int64_t nb = cols / kQ8Block, nc = (nb + 15) / 16;
    a.q.resize(size_t(nb * kQ8Block));
    a.xa.resize(size_t(nb * kQ8Block));
    a.d.resize(size_t(nb));
    a.xd.assign(size_t(nc * 16), 0.f);
    a.xs.assign(size_t(nc * 16), 0);
    quantize_activation_q8_0(x, a.d.data(), a.q.data(), cols);
#if defined(__x86_64__)
    if (gemv_uses_avx2()) return pk_scatter_avx2(a, nb, offset);
#endif
    for (int64_t blk = 0; blk < nb; ++blk) {
        const int8_t* qb = a.q.data() + blk * kQ8Block;
        std::memcpy(a.xa.data() + pk_q8_offset(blk, 0), qb, 16);
        std::memcpy(a.xa.data() + pk_q8_offset(blk, 16), qb + 16, 16);
        int32_t s = 0;
        for (int64_t t = 0; t < kQ8Block; ++t) s += qb[t];
        a.xs[size_t(pk_lane(blk))] = offset * s;
        a.xd[size_t(pk_lane(blk))] = a.d[size_t(blk)];
    }
}

// Each thread keeps its activation buffers across products (no allocation per token).
PkActivation& pk_activation() {
    thread_local PkActivation a;
    return a;
}

// Portable loop over the packed layout: per block the exact int32 dot, scaled by d_w * d_x.
template <bool Q4>
void pk_rows_plain(const uint8_t* w, const PkActivation& a, const float* b, float* y, int64_t r0, int64_t r1,
                   int64_t nb) {
    const int64_t qbytes = nb * (Q4 ? 16 : 32), row_bytes = nb * (Q4 ? 18 : 34);
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* wr = w + r * row_bytes;
        const auto* sc = reinterpret_cast<const uint16_t*>(wr + qbytes);
        float s = 0.f;
        for (int64_t blk = 0; blk < nb; ++blk) {
            const int8_t* xq = a.q.data() + blk * kQ8Block;
            int32_t dot = 0;
            for (int64_t t = 0; t < kQ8Block; ++t) {
                int32_t v;
                if (Q4) {
                    const uint8_t byte = wr[blk / 4 * 64 + 16 * (blk % 4) + t % 16];
                    v = int32_t(t < 16 ? byte & 0x0F : byte >> 4) - 8;
                } else {
                    v = int32_t(wr[pk_q8_offset(blk, t)]) - 128;
                }
                dot += v * int32_t(xq[t]);
            }
            s += float(dot) * (half_to_float(sc[pk_scale_slot(blk, nb)]) * a.d[size_t(blk)]);
        }
        y[r] = s + (b ? b[r] : 0.f);
    }
}

#if defined(__x86_64__)
#define ANCHOR_PK_TARGET "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma"

// Quad `qd`'s four 128-bit lanes of int32 partial sums (lane k: block k of the quad).
template <bool Q4>
__attribute__((target(ANCHOR_PK_TARGET), always_inline)) inline __m512i pk_quad(const uint8_t* wq, const int8_t* xa,
                                                                                int64_t qd) {
    const __m512i xA = _mm512_loadu_si512(xa + qd * 128), xB = _mm512_loadu_si512(xa + qd * 128 + 64);
    if (Q4) {
        const __m512i v = _mm512_loadu_si512(wq + qd * 64), m = _mm512_set1_epi8(0x0F);
        const __m512i lo = _mm512_and_si512(v, m), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m);
        return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xA), hi, xB);
    }
    const __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(wq + qd * 128), xA);
    return _mm512_dpbusd_epi32(a, _mm512_loadu_si512(wq + qd * 128 + 64), xB);
}

template <bool Q4>
__attribute__((target(ANCHOR_PK_TARGET))) void pk_rows_vnni(const uint8_t* w, const PkActivation& a, const float* b,
                                                            float* y, int64_t r0, int64_t r1, int64_t nb) {
    const int64_t qbytes = nb * (Q4 ? 16 : 32), row_bytes = nb * (Q4 ? 18 : 34), full = nb / 16;
    const bool half = nb % 16 != 0;
    const int8_t* xa = a.xa.data();
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* wr = w + r * row_bytes;
        const auto* sc = reinterpret_cast<const uint16_t*>(wr + qbytes);
        __m512 acc = _mm512_setzero_ps();
        for (int64_t c = 0; c < full; ++c) {
            const __m512i a0 = pk_quad<Q4>(wr, xa, 4 * c), a1 = pk_quad<Q4>(wr, xa, 4 * c + 1),
                          a2 = pk_quad<Q4>(wr, xa, 4 * c + 2), a3 = pk_quad<Q4>(wr, xa, 4 * c + 3);
            // Per 128-bit lane k: [a0 a1 a2 a3] partial sums of block k -> lane 4k + j holds quad j's block k.
            const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
            const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
            __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
            u = _mm512_sub_epi32(u, _mm512_loadu_si512(a.xs.data() + 16 * c));
            const __m512 s = _mm512_mul_ps(
                _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 16 * c))),
                _mm512_loadu_ps(a.xd.data() + 16 * c));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(u), s, acc);
        }
        if (half) { // a trailing chunk of 8 blocks: quads 0 and 1 only, lanes 4k + {0, 1}
            const __m512i a0 = pk_quad<Q4>(wr, xa, 4 * full), a1 = pk_quad<Q4>(wr, xa, 4 * full + 1);
            const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
            const __m512i z = _mm512_setzero_si512();
            __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t0, z), _mm512_unpackhi_epi64(t0, z));
            u = _mm512_sub_epi32(u, _mm512_loadu_si512(a.xs.data() + 16 * full));
            const __m256 s8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 16 * full)));
            const __m512 s = _mm512_mul_ps(_mm512_maskz_expand_ps(0x3333, _mm512_castps256_ps512(s8)),
                                           _mm512_loadu_ps(a.xd.data() + 16 * full));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(u), s, acc);
        }
        y[r] = _mm512_reduce_add_ps(acc) + (b ? b[r] : 0.f);
    }
}
#undef ANCHOR_PK_TARGET
#endif

template <bool Q4>
void pk_gemv(const uint8_t* w, const float* x, const float* b, float* y, int64_t rows, int64_t cols, SimdPath path) {
    if (!packed_rows_apply(cols))
        throw Error(std::string(Q4 ? "gemv_q4_0_packed" : "gemv_q8_0_packed") + ": cols must be a multiple of 256, got " +
                    std::to_string(cols));
    const int64_t nb = cols / kQ8Block;
    PkActivation& a = pk_activation();
    pk_prepare(x, cols, Q4 ? 8 : 128, a);
#if defined(__x86_64__)
    if (path == SimdPath::Best && packed_rows_fast())
        return run_rows(rows, cols, [&](int64_t r0, int64_t r1) { pk_rows_vnni<Q4>(w, a, b, y, r0, r1, nb); });
#else
    (void)path;
#endif
    run_rows(rows, cols, [&](int64_t r0, int64_t r1) { pk_rows_plain<Q4>(w, a, b, y, r0, r1, nb); });
}

template <class Block, bool Q4>
torch::Tensor pk_pack(const torch::Tensor& wq, int64_t cols, const char* who) {
    const int64_t nb = cols / kQ8Block, row_bytes = nb * int64_t(sizeof(Block));
    if (!packed_rows_apply(cols) || wq.dim() != 2 || wq.scalar_type() != torch::kUInt8 || !wq.device().is_cpu() ||
        wq.size(1) != row_bytes)
        throw Error(std::string(who) + ": needs CPU uint8 [rows, " + std::to_string(row_bytes) +
                    "] blocks with cols a multiple of 256 (cols " + std::to_string(cols) + ")");
    auto src = wq.contiguous();
    const int64_t rows = src.size(0), qbytes = nb * (Q4 ? 16 : 32);
    auto out = torch::empty({rows, row_bytes}, torch::kUInt8);
    const auto* in = reinterpret_cast<const Block*>(src.data_ptr<uint8_t>());
    uint8_t* o = out.data_ptr<uint8_t>();
    at::parallel_for(0, rows, 64, [&](int64_t ra, int64_t rb) {
        for (int64_t r = ra; r < rb; ++r) {
            uint8_t* orow = o + r * row_bytes;
            auto* sc = reinterpret_cast<uint16_t*>(orow + qbytes);
            for (int64_t blk = 0; blk < nb; ++blk) {
                const Block& bl = in[r * nb + blk];
                sc[pk_scale_slot(blk, nb)] = bl.d;
                if constexpr (Q4) {
                    std::memcpy(orow + blk / 4 * 64 + 16 * (blk % 4), bl.qs, 16);
                } else {
                    for (int64_t t = 0; t < kQ8Block; ++t)
                        orow[pk_q8_offset(blk, t)] = uint8_t(int32_t(bl.q[t]) + 128);
                }
            }
        }
    });
    return out;
}

} // namespace

bool packed_rows_apply(int64_t cols) {
    return cols > 0 && cols % (kPkGroup * kQ8Block) == 0;
}

bool packed_rows_fast() {
    const auto& f = cpu_features();
    return f.avx512f && f.avx512bw && f.avx512vl && f.avx512vnni && f.f16c && f.fma;
}

torch::Tensor pack_q8_0_rows(const torch::Tensor& wq, int64_t cols) {
    return pk_pack<BlockQ8_0, false>(wq, cols, "pack_q8_0_rows");
}

torch::Tensor pack_q4_0_rows(const torch::Tensor& wq, int64_t cols) {
    return pk_pack<BlockQ4_0, true>(wq, cols, "pack_q4_0_rows");
}

void gemv_q8_0_packed(const uint8_t* w, const float* x, const float* b, float* y, int64_t rows, int64_t cols,
                      SimdPath path) {
    pk_gemv<false>(w, x, b, y, rows, cols, path);
}

void gemv_q4_0_packed(const uint8_t* w, const float* x, const float* b, float* y, int64_t rows, int64_t cols,
                      SimdPath path) {
    pk_gemv<true>(w, x, b, y, rows, cols, path);
}

} // namespace anchor::kernels
