// The Bf16 arithmetic of a whole-sequence product (kernels/qgemm_arith.h): weights dequantised and rounded to
// bfloat16, activations rounded to bfloat16, products summed in float32 by vdpbf16ps; and the arithmetic table and
// dispatch.
#include "kernels/qgemm_arith.h"

#include "cache/io/error.h"
#include "kernels/cpu_features.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace anchor::kernels {

const EnumTable<QGemmArithmetic>& qgemm_arithmetic_table() {
    static const EnumTable<QGemmArithmetic> t = {
        {"f32", QGemmArithmetic::F32}, {"bf16", QGemmArithmetic::Bf16}, {"int8", QGemmArithmetic::Int8}};
    return t;
}

QGemmArithmetic default_qgemm_arithmetic() {
    return QGemmArithmetic::Int8;
}

namespace {

bool qgemm_bf16_native() {
#if defined(__x86_64__)
    const auto& f = cpu_features();
    return f.avx512f && f.avx512bw && f.avx512vl && f.avx512bf16;
#else
    return false;
#endif
}

constexpr int64_t kQgBfLanes = 16;                     // float32 lanes: weight rows per vector
constexpr int64_t kQgBfVecs = 2;                       // vectors per panel
constexpr int64_t kQgBfPanel = kQgBfLanes * kQgBfVecs; // weight rows repacked together
constexpr int64_t kQgBfChunkPairs = 1024;              // input pairs per pass: 128 KiB of the panel stays in L2
constexpr int kQgBfRows = 12;                          // activation rows per pass: 12 x 2 float32 accumulators

// Two bfloat16 (round to nearest even, as LibTorch and oneDNN round) in one 32-bit lane: a at the low half.
inline uint32_t qgemm_bf16_pair(float a, float b) {
    return uint32_t(c10::BFloat16(a).x) | (uint32_t(c10::BFloat16(b).x) << 16);
}

#if defined(__x86_64__)
// MR activation rows [a0, a0 + MR) times input pairs [k0, k1) of one repacked panel, added into y (first: y is not
// read; last: the bias is added).
template <int MR>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void
qgemm_bf16_pass(const uint32_t* packed, const uint32_t* xa, int64_t kp, int64_t a0, int64_t k0, int64_t k1, bool first,
                const float* bias, float* y, int64_t ldy, int64_t valid) {
    __mmask16 m[kQgBfVecs];
    for (int v = 0; v < kQgBfVecs; ++v) {
        const int64_t lanes = std::clamp<int64_t>(valid - v * kQgBfLanes, 0, kQgBfLanes);
        m[v] = lanes == kQgBfLanes ? __mmask16(0xFFFF) : __mmask16((1u << lanes) - 1);
    }
    __m512 acc[MR][kQgBfVecs];
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
        for (int v = 0; v < kQgBfVecs; ++v)
            acc[r][v] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m[v], y + r * ldy + v * kQgBfLanes);
    const uint32_t* xr = xa + a0 * kp;
    for (int64_t k = k0; k < k1; ++k) {
        const __m512i w0 = _mm512_loadu_si512(packed + (k * kQgBfVecs) * kQgBfLanes);
        const __m512i w1 = _mm512_loadu_si512(packed + (k * kQgBfVecs + 1) * kQgBfLanes);
#pragma GCC unroll 12
        for (int r = 0; r < MR; ++r) {
            const __m512i xb = _mm512_set1_epi32(int32_t(xr[r * kp + k]));
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)w0, (__m512bh)xb);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)w1, (__m512bh)xb);
        }
    }
#pragma GCC unroll 2
    for (int v = 0; v < kQgBfVecs; ++v) {
        if (!m[v]) continue;
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(m[v], bias + v * kQgBfLanes) : _mm512_setzero_ps();
#pragma GCC unroll 12
        for (int r = 0; r < MR; ++r)
            _mm512_mask_storeu_ps(y + r * ldy + v * kQgBfLanes, m[v], _mm512_add_ps(acc[r][v], bv));
    }
}

template <int MR>
void qgemm_bf16_rows_upto(int mr, const uint32_t* packed, const uint32_t* xa, int64_t kp, int64_t a0, int64_t k0,
                          int64_t k1, bool first, const float* bias, float* y, int64_t ldy, int64_t valid) {
    if constexpr (MR > 1)
        if (mr < MR) return qgemm_bf16_rows_upto<MR - 1>(mr, packed, xa, kp, a0, k0, k1, first, bias, y, ldy, valid);
    qgemm_bf16_pass<MR>(packed, xa, kp, a0, k0, k1, first, bias, y, ldy, valid);
}
#endif

} // namespace

std::string qgemm_arithmetic_unavailable(QGemmArithmetic a) {
    if (a == QGemmArithmetic::Bf16 && !qgemm_bf16_native())
        return "bf16 products need a CPU with AVX512-BF16 (vdpbf16ps); this one has: " + cpu_features_string();
    return "";
}

torch::Tensor qlinear_bf16(const torch::Tensor& x, const QWeight& w, const torch::Tensor& b) {
    if (x.size(-1) != w.cols)
        throw Error("qlinear_bf16: input has " + std::to_string(x.size(-1)) + " features, the weight " +
                    std::to_string(w.cols));
    if (const auto why = qgemm_arithmetic_unavailable(QGemmArithmetic::Bf16); !why.empty())
        throw Error("qlinear_bf16: " + why);
    auto out_shape = x.sizes().vec();
    out_shape.back() = w.rows;
    auto x2 = x.reshape({-1, w.cols}).to(torch::kFloat32).contiguous();
    const int64_t n = x2.size(0), rows = w.rows, cols = w.cols, kp = (cols + 1) / 2;
    auto bias = b.defined() ? b.to(torch::kFloat32).contiguous() : torch::Tensor();
    const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
    auto y = torch::empty({n, rows}, torch::kFloat32);
    if (n == 0 || rows == 0) return y.view(out_shape);
#if defined(__x86_64__)
    // The activations as bfloat16 pairs (an odd last input paired with zero).
    std::vector<uint32_t> xa(size_t(n * kp));
    const float* xp = x2.data_ptr<float>();
    at::parallel_for(0, n, 4, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r)
            for (int64_t k = 0; k < kp; ++k)
                xa[size_t(r * kp + k)] =
                    qgemm_bf16_pair(xp[r * cols + 2 * k], 2 * k + 1 < cols ? xp[r * cols + 2 * k + 1] : 0.f);
    });
    float* yp = y.data_ptr<float>();
    const int64_t panels = (rows + kQgBfPanel - 1) / kQgBfPanel;
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
        std::vector<uint32_t> packed(static_cast<size_t>(kp * kQgBfPanel));
        std::vector<float> row(static_cast<size_t>(cols));
        for (int64_t p = p0; p < p1; ++p) {
            const int64_t r0 = p * kQgBfPanel, valid = std::min(kQgBfPanel, rows - r0);
            // Panel layout: per input pair k, per vector v, 16 rows' pairs (row r0 + 16 v + lane).
            for (int64_t i = 0; i < kQgBfPanel; ++i) {
                const int64_t v = i / kQgBfLanes, lane = i % kQgBfLanes;
                if (i < valid) w.dequantize_rows(r0 + i, r0 + i + 1, row.data());
                for (int64_t k = 0; k < kp; ++k)
                    packed[size_t((k * kQgBfVecs + v) * kQgBfLanes + lane)] =
                        i < valid ? qgemm_bf16_pair(row[size_t(2 * k)], 2 * k + 1 < cols ? row[size_t(2 * k + 1)] : 0.f)
                                  : 0u;
            }
            for (int64_t k0 = 0; k0 < kp; k0 += kQgBfChunkPairs) {
                const int64_t k1 = std::min(kp, k0 + kQgBfChunkPairs);
                for (int64_t a0 = 0; a0 < n; a0 += kQgBfRows)
                    qgemm_bf16_rows_upto<kQgBfRows>(int(std::min<int64_t>(kQgBfRows, n - a0)), packed.data(), xa.data(),
                                                    kp, a0, k0, k1, k0 == 0, k1 == kp && bp ? bp + r0 : nullptr,
                                                    yp + a0 * rows + r0, rows, valid);
            }
        }
    });
#endif
    return y.view(out_shape);
}

torch::Tensor qlinear_with(const torch::Tensor& x, const QWeight& w, const torch::Tensor& b, QGemmArithmetic a) {
    if (w.type == QWeightType::F32 || a == QGemmArithmetic::F32) return qlinear(x, w, b);
    if (a == QGemmArithmetic::Int8)
        return w.type == QWeightType::Q8_0 || w.type == QWeightType::Q4_0 ? qlinear_int8(x, w, b) : qlinear(x, w, b);
    return qlinear_bf16(x, w, b);
}

} // namespace anchor::kernels
