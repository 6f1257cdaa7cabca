// Vector exponential and horizontal reductions shared by the CPU attention kernels (kernels/attention.cpp,
// kernels/flash_attention.cpp). x86-64 only; every function carries its target attribute, so including this header
// adds no AVX instruction to code that is not itself compiled for that target.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

namespace anchor::kernels::simd {

// Cephes' expf (Moshier): range reduction x = n ln2 + r with ln2 split in two, degree-6 polynomial for e^r on
// |r| <= ln2/2, 2^n built in the exponent bits; relative error ~1e-7. Used for x <= 0 (scores minus their maximum).
// Below kExpCutoff it returns exactly 0: e^-60 = 8.8e-27 is invisible next to the maximum's term 1 in float32, and
// values near the bottom of the float range would make the probabilities (e / sum) denormal, which costs a microcode
// assist per FMA in the weighted sum (large-magnitude scores, e.g. random weights, would run several times slower).
// A NaN stays NaN (an unordered compare keeps it, max_ps returns its second operand when one is NaN), so a broken
// model still reaches the pipeline's NaN check.
constexpr float kExpCutoff = -60.f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

__attribute__((target("avx2,fma"))) inline __m256 exp_ps(__m256 x) {
    const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(kExpCutoff), _CMP_NLE_UQ);
    x = _mm256_max_ps(_mm256_set1_ps(kExpCutoff), x);
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
    __m256 y = _mm256_set1_ps(kExpP[0]);
    for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kExpP[i]));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), keep);
}

// The same for 16 lanes.
__attribute__((target("avx512f"))) inline __m512 exp_ps(__m512 x) {
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpCutoff), _CMP_NLE_UQ);
    x = _mm512_max_ps(_mm512_set1_ps(kExpCutoff), x);
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
    __m512 y = _mm512_set1_ps(kExpP[0]);
    for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kExpP[i]));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mov_ps(keep, _mm512_mul_ps(y, _mm512_castsi512_ps(e)));
}

__attribute__((target("avx2,fma"))) inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

__attribute__((target("avx2,fma"))) inline float hsum8(__m256 v) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    m = _mm_add_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

} // namespace anchor::kernels::simd
#endif

#include <cstdint>
#include <cstring>

namespace anchor::kernels {

// float32 -> bfloat16 bits, rounded to nearest even as LibTorch's and oneDNN's conversions round; a NaN stays a NaN
// (quiet). For the kernels that write bfloat16 operands themselves (winograd.cpp, flash_attention.cpp).
inline uint16_t bf16_bits(float v) {
    uint32_t b;
    std::memcpy(&b, &v, sizeof b);
    const uint32_t rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
    return (b & 0x7fffffffu) > 0x7f800000u ? uint16_t((b >> 16) | 0x40u) : uint16_t(rounded);
}

} // namespace anchor::kernels
