// The Int8 arithmetic of a whole-sequence product with q8_0 / q4_0 weights (kernels/qgemm_arith.h): activations
// quantised to q8_0 blocks, exact int32 block dots (vpdpbusd), scaled by d_w * d_x in float32.
#include "kernels/qgemm_arith.h"

#include "cache/io/error.h"
#include "kernels/cpu_features.h"
#include "kernels/gemv.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace anchor::kernels {

namespace {

constexpr int64_t kQgI8Lanes = 16;                     // int32 lanes of a 512-bit vector: weight rows per vector
constexpr int64_t kQgI8Vecs = 2;                       // vectors per panel
constexpr int64_t kQgI8Panel = kQgI8Lanes * kQgI8Vecs; // weight rows repacked together
constexpr int64_t kQgI8Groups = kQ8Block / 4;          // groups of four inputs (one int32 lane) per block
constexpr int64_t kQgI8BlockBytes = kQgI8Groups * kQgI8Vecs * 64; // one block of a panel, repacked
constexpr int kQgI8Rows = 6; // activation rows per pass: 6 x 2 int32 and 6 x 2 float accumulators in 32 registers

float qgemm_i8_half(uint16_t h) {
    return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// The activation side: per row and block the q8_0 scale, the 32 quants, and the int32 accumulator's start
// -offset * sum(quants), which removes the weights' unsigned offset: sum((c - o) x) = sum(c x) - o sum(x).
struct QgemmI8Activations {
    int64_t nb = 0;
    std::vector<float> d;
    std::vector<int8_t> q;
    std::vector<int32_t> start;
};

QgemmI8Activations qgemm_i8_quantize(const float* x, int64_t n, int64_t cols, int32_t offset) {
    QgemmI8Activations a;
    a.nb = q8_0_blocks(cols);
    const int64_t nb = a.nb;
    a.d.resize(size_t(n * nb));
    a.q.resize(size_t(n * nb * kQ8Block));
    a.start.resize(size_t(n * nb));
    at::parallel_for(0, n, 4, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
            int8_t* q = a.q.data() + r * nb * kQ8Block;
            quantize_activation_q8_0(x + r * cols, a.d.data() + r * nb, q, cols);
            for (int64_t b = 0; b < nb; ++b) {
                int32_t s = 0;
                for (int64_t j = 0; j < kQ8Block; ++j) s += q[b * kQ8Block + j];
                a.start[size_t(r * nb + b)] = -offset * s;
            }
        }
    });
    return a;
}

// Weight rows [r0, r0 + kQgI8Panel) as unsigned bytes (q4_0: the codes c, value c - 8; q8_0: q + 128), laid out per
// block, per group of four inputs, per vector: 16 rows x 4 bytes, so one 512-bit load feeds vpdpbusd for 16 rows.
// scales[b * kQgI8Panel + p]: row p's float16 scale of block b. Rows past the weight's end get scale 0.
void qgemm_i8_pack(const QWeight& w, int64_t r0, uint8_t* packed, float* scales) {
    const int64_t nb = q8_0_blocks(w.cols), rb = QWeight::row_bytes(w.type, w.cols);
    const uint8_t* base = w.data.data_ptr<uint8_t>();
    uint8_t codes[kQ8Block];
    for (int64_t p = 0; p < kQgI8Panel; ++p) {
        const int64_t r = r0 + p, v = p / kQgI8Lanes, lane = p % kQgI8Lanes;
        for (int64_t b = 0; b < nb; ++b) {
            float d = 0.f;
            if (r >= w.rows) {
                std::memset(codes, 0, sizeof(codes));
            } else if (w.type == QWeightType::Q4_0) {
                const auto& blk = reinterpret_cast<const BlockQ4_0*>(base + r * rb)[b];
                d = qgemm_i8_half(blk.d);
                for (int64_t j = 0; j < kQ4Block / 2; ++j) {
                    codes[j] = blk.qs[j] & 0x0F;
                    codes[j + kQ4Block / 2] = blk.qs[j] >> 4;
                }
            } else {
                const auto& blk = reinterpret_cast<const BlockQ8_0*>(base + r * rb)[b];
                d = qgemm_i8_half(blk.d);
                for (int64_t j = 0; j < kQ8Block; ++j) codes[j] = uint8_t(int(blk.q[j]) + 128);
            }
            scales[b * kQgI8Panel + p] = d;
            uint8_t* dst = packed + b * kQgI8BlockBytes + v * 64 + lane * 4;
            for (int64_t g = 0; g < kQgI8Groups; ++g) std::memcpy(dst + g * kQgI8Vecs * 64, codes + 4 * g, 4);
        }
    }
}

#if defined(__x86_64__)
// MR activation rows [a0, a0 + MR) times one repacked panel: y[a][0 .. valid) (+ bias). Per block the int32
// accumulators start at -offset * sum(x quants) and take 8 vpdpbusd (32 inputs); then each is converted once and
// added with the scale d_w (16 rows) * d_x (this activation row) to its float32 accumulator.
template <int MR>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void
qgemm_i8_pass(const uint8_t* packed, const float* scales, const QgemmI8Activations& act, int64_t a0, const float* bias,
              float* y, int64_t ldy, int64_t valid) {
    const int64_t nb = act.nb;
    const int8_t* xq = act.q.data() + a0 * nb * kQ8Block;
    const float* xd = act.d.data() + a0 * nb;
    const int32_t* st = act.start.data() + a0 * nb;
    __m512 accf[MR][kQgI8Vecs];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
        for (int v = 0; v < kQgI8Vecs; ++v) accf[r][v] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m512i acc[MR][kQgI8Vecs];
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
            const __m512i s = _mm512_set1_epi32(st[r * nb + b]);
#pragma GCC unroll 2
            for (int v = 0; v < kQgI8Vecs; ++v) acc[r][v] = s;
        }
        const uint8_t* pw = packed + b * kQgI8BlockBytes;
#pragma GCC unroll 8
        for (int g = 0; g < kQgI8Groups; ++g) {
            const __m512i w0 = _mm512_loadu_si512(pw + (g * kQgI8Vecs) * 64);
            const __m512i w1 = _mm512_loadu_si512(pw + (g * kQgI8Vecs + 1) * 64);
#pragma GCC unroll 8
            for (int r = 0; r < MR; ++r) {
                int32_t four;
                std::memcpy(&four, xq + (r * nb + b) * kQ8Block + 4 * g, 4);
                const __m512i xb = _mm512_set1_epi32(four);
                acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], w0, xb);
                acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], w1, xb);
            }
        }
        const __m512 d0 = _mm512_loadu_ps(scales + b * kQgI8Panel), d1 = _mm512_loadu_ps(scales + b * kQgI8Panel + 16);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
            const __m512 dx = _mm512_set1_ps(xd[r * nb + b]);
            accf[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][0]), _mm512_mul_ps(d0, dx), accf[r][0]);
            accf[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][1]), _mm512_mul_ps(d1, dx), accf[r][1]);
        }
    }
#pragma GCC unroll 2
    for (int v = 0; v < kQgI8Vecs; ++v) {
        const int64_t lanes = std::clamp<int64_t>(valid - v * kQgI8Lanes, 0, kQgI8Lanes);
        if (lanes == 0) continue;
        const __mmask16 m = lanes == kQgI8Lanes ? __mmask16(0xFFFF) : __mmask16((1u << lanes) - 1);
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(m, bias + v * kQgI8Lanes) : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r)
            _mm512_mask_storeu_ps(y + r * ldy + v * kQgI8Lanes, m, _mm512_add_ps(accf[r][v], bv));
    }
}

void qgemm_i8_rows(int mr, const uint8_t* packed, const float* scales, const QgemmI8Activations& act, int64_t a0,
                   const float* bias, float* y, int64_t ldy, int64_t valid) {
    switch (mr) {
    case 1:
        return qgemm_i8_pass<1>(packed, scales, act, a0, bias, y, ldy, valid);
    case 2:
        return qgemm_i8_pass<2>(packed, scales, act, a0, bias, y, ldy, valid);
    case 3:
        return qgemm_i8_pass<3>(packed, scales, act, a0, bias, y, ldy, valid);
    case 4:
        return qgemm_i8_pass<4>(packed, scales, act, a0, bias, y, ldy, valid);
    case 5:
        return qgemm_i8_pass<5>(packed, scales, act, a0, bias, y, ldy, valid);
    default:
        return qgemm_i8_pass<kQgI8Rows>(packed, scales, act, a0, bias, y, ldy, valid);
    }
}
#endif

bool qgemm_i8_vnni() {
#if defined(__x86_64__)
    const auto& f = cpu_features();
    return f.avx512f && f.avx512bw && f.avx512vl && f.avx512vnni;
#else
    return false;
#endif
}

void qgemm_i8_check(const torch::Tensor& x, const QWeight& w, const char* who) {
    if (x.size(-1) != w.cols)
        throw Error(std::string(who) + ": input has " + std::to_string(x.size(-1)) + " features, the weight " +
                    std::to_string(w.cols));
    if (w.type != QWeightType::Q8_0 && w.type != QWeightType::Q4_0)
        throw Error(std::string(who) + ": int8 products need q8_0 or q4_0 weights, got " +
                    enum_name(qweight_type_table(), w.type));
}

// The operands of a product as float32 rows: x [n, cols], the bias (or none) and y [n, rows] to fill.
struct QgemmI8Io {
    std::vector<int64_t> out_shape;
    torch::Tensor x2, bias, y;
    int64_t n = 0;
    const float* bp = nullptr;
};

QgemmI8Io qgemm_i8_io(const torch::Tensor& x, const QWeight& w, const torch::Tensor& b, const char* who) {
    qgemm_i8_check(x, w, who);
    QgemmI8Io io;
    io.out_shape = x.sizes().vec();
    io.out_shape.back() = w.rows;
    io.x2 = x.reshape({-1, w.cols}).to(torch::kFloat32).contiguous();
    io.n = io.x2.size(0);
    io.bias = b.defined() ? b.to(torch::kFloat32).contiguous() : torch::Tensor();
    io.bp = io.bias.defined() ? io.bias.data_ptr<float>() : nullptr;
    io.y = torch::empty({io.n, w.rows}, torch::kFloat32);
    return io;
}

} // namespace

torch::Tensor qlinear_int8(const torch::Tensor& x, const QWeight& w, const torch::Tensor& b) {
    const auto io = qgemm_i8_io(x, w, b, "qlinear_int8");
    const auto& out_shape = io.out_shape;
    const auto& y = io.y;
    const int64_t n = io.n, rows = w.rows, cols = w.cols;
    const float* bp = io.bp;
    float* yp = y.data_ptr<float>();
    const float* xp = io.x2.data_ptr<float>();
    if (n == 0 || rows == 0) return y.view(out_shape);
#if defined(__x86_64__)
    if (qgemm_i8_vnni()) {
        const auto act = qgemm_i8_quantize(xp, n, cols, w.type == QWeightType::Q4_0 ? 8 : 128);
        const int64_t nb = act.nb, panels = (rows + kQgI8Panel - 1) / kQgI8Panel;
        at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
            std::vector<uint8_t> packed(static_cast<size_t>(nb * kQgI8BlockBytes));
            std::vector<float> scales(static_cast<size_t>(nb * kQgI8Panel));
            for (int64_t p = p0; p < p1; ++p) {
                const int64_t r0 = p * kQgI8Panel, valid = std::min(kQgI8Panel, rows - r0);
                qgemm_i8_pack(w, r0, packed.data(), scales.data());
                for (int64_t a0 = 0; a0 < n; a0 += kQgI8Rows)
                    qgemm_i8_rows(int(std::min<int64_t>(kQgI8Rows, n - a0)), packed.data(), scales.data(), act, a0,
                                  bp ? bp + r0 : nullptr, yp + a0 * rows + r0, rows, valid);
            }
        });
        return y.view(out_shape);
    }
#endif
    // Without VNNI: the batch-1 kernels row by row (AVX2 maddubs or the portable loop), the same arithmetic.
    const uint8_t* wp = w.data.data_ptr<uint8_t>();
    for (int64_t r = 0; r < n; ++r) {
        if (w.type == QWeightType::Q4_0)
            gemv_q4_0(reinterpret_cast<const BlockQ4_0*>(wp), xp + r * cols, bp, yp + r * rows, rows, cols);
        else
            gemv_q8_0(reinterpret_cast<const BlockQ8_0*>(wp), xp + r * cols, bp, yp + r * rows, rows, cols);
    }
    return y.view(out_shape);
}

torch::Tensor qlinear_int8_ref(const torch::Tensor& x, const QWeight& w, const torch::Tensor& b) {
    const auto io = qgemm_i8_io(x, w, b, "qlinear_int8_ref");
    const int64_t rows = w.rows, cols = w.cols;
    const float* bp = io.bp;
    const uint8_t* wp = w.data.data_ptr<uint8_t>();
    for (int64_t r = 0; r < io.n; ++r) {
        const float* xr = io.x2.data_ptr<float>() + r * cols;
        float* yr = io.y.data_ptr<float>() + r * rows;
        if (w.type == QWeightType::Q4_0)
            gemv_ref_q4_0(reinterpret_cast<const BlockQ4_0*>(wp), xr, bp, yr, rows, cols);
        else
            gemv_ref_q8_0(reinterpret_cast<const BlockQ8_0*>(wp), xr, bp, yr, rows, cols);
    }
    return io.y.view(io.out_shape);
}

} // namespace anchor::kernels
