#include "kernels/winograd.h"

#include "kernels/cpu_features.h"
#include "kernels/onednn.h"
#include "kernels/op_timing.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <vector>

namespace anchor::kernels {

namespace {

constexpr int64_t kTile = 4; // outputs per tile side, m in F(m x m, 3 x 3)
constexpr int64_t kIn = 6;   // input tile side, m + r - 1
constexpr int64_t kXi = 36;  // tile positions

// The three transforms, each vectorised across channels (the innermost, contiguous dimension of every operand).

// Channels per block: the innermost loops run over a block so that they vectorise (one AVX-512 register, two AVX2).
constexpr int64_t kBlock = 16;

// u[xi * xi_stride + c] = (G g G^T)[xi] for g = w[c * 9 .. c * 9 + 8], c in [0, C): one output channel's weights.
// G = [[1/4, 0, 0], [-1/6, -1/6, -1/6], [-1/6, 1/6, -1/6], [1/24, 1/12, 1/6], [1/24, -1/12, 1/6], [0, 0, 1]].
ANCHOR_TARGET_CLONES
void transform_weight_row(const float* __restrict w, float* __restrict u, int64_t xi_stride, int64_t C) {
    for (int64_t c0 = 0; c0 < C; c0 += kBlock) {
        const int64_t n = std::min(kBlock, C - c0);
        float g[9][kBlock], t[kIn][3][kBlock]; // g transposed to channels innermost; t = G g
        for (int64_t q = 0; q < n; ++q)
            for (int e = 0; e < 9; ++e) g[e][q] = w[(c0 + q) * 9 + e];
        for (int j = 0; j < 3; ++j)
            for (int64_t q = 0; q < n; ++q) {
                const float g0 = g[j][q], g1 = g[3 + j][q], g2 = g[6 + j][q];
                t[0][j][q] = g0 * (1.f / 4);
                t[1][j][q] = (g0 + g1 + g2) * (-1.f / 6);
                t[2][j][q] = (g0 - g1 + g2) * (-1.f / 6);
                t[3][j][q] = g0 * (1.f / 24) + g1 * (1.f / 12) + g2 * (1.f / 6);
                t[4][j][q] = g0 * (1.f / 24) - g1 * (1.f / 12) + g2 * (1.f / 6);
                t[5][j][q] = g2;
            }
        for (int i = 0; i < kIn; ++i) { // (G g) G^T
            float* r = u + i * kIn * xi_stride + c0;
            for (int64_t q = 0; q < n; ++q) {
                const float a0 = t[i][0][q], a1 = t[i][1][q], a2 = t[i][2][q];
                r[0 * xi_stride + q] = a0 * (1.f / 4);
                r[1 * xi_stride + q] = (a0 + a1 + a2) * (-1.f / 6);
                r[2 * xi_stride + q] = (a0 - a1 + a2) * (-1.f / 6);
                r[3 * xi_stride + q] = a0 * (1.f / 24) + a1 * (1.f / 12) + a2 * (1.f / 6);
                r[4 * xi_stride + q] = a0 * (1.f / 24) - a1 * (1.f / 12) + a2 * (1.f / 6);
                r[5 * xi_stride + q] = a2;
            }
        }
    }
}

// v[xi * xi_stride + c] = (B^T d B)[xi] for the tile d[i][j][c] = rows[i * 6 + j][c] (a zero row outside the image).
// B^T = [[4, 0, -5, 0, 1, 0], [0, -4, -4, 1, 1, 0], [0, 4, -4, -1, 1, 0], [0, -2, -1, 2, 1, 0], [0, 2, -1, -2, 1, 0],
//        [0, 4, 0, -5, 0, 1]].
ANCHOR_TARGET_CLONES
void transform_input_tile(const float* const* rows, float* __restrict v, int64_t xi_stride, int64_t C) {
    for (int64_t c0 = 0; c0 < C; c0 += kBlock) {
        const int64_t n = std::min(kBlock, C - c0);
        float t[kIn][kIn][kBlock]; // B^T d
        for (int j = 0; j < kIn; ++j) {
            const float *__restrict d0 = rows[0 * kIn + j] + c0, *__restrict d1 = rows[1 * kIn + j] + c0,
                                    *__restrict d2 = rows[2 * kIn + j] + c0, *__restrict d3 = rows[3 * kIn + j] + c0,
                                    *__restrict d4 = rows[4 * kIn + j] + c0, *__restrict d5 = rows[5 * kIn + j] + c0;
            for (int64_t q = 0; q < n; ++q) {
                t[0][j][q] = 4.f * d0[q] - 5.f * d2[q] + d4[q];
                t[1][j][q] = -4.f * (d1[q] + d2[q]) + d3[q] + d4[q];
                t[2][j][q] = 4.f * (d1[q] - d2[q]) - d3[q] + d4[q];
                t[3][j][q] = 2.f * (d3[q] - d1[q]) - d2[q] + d4[q];
                t[4][j][q] = 2.f * (d1[q] - d3[q]) - d2[q] + d4[q];
                t[5][j][q] = 4.f * d1[q] - 5.f * d3[q] + d5[q];
            }
        }
        for (int i = 0; i < kIn; ++i) { // (B^T d) B
            float* r = v + i * kIn * xi_stride + c0;
            for (int64_t q = 0; q < n; ++q) {
                const float a0 = t[i][0][q], a1 = t[i][1][q], a2 = t[i][2][q], a3 = t[i][3][q], a4 = t[i][4][q],
                            a5 = t[i][5][q];
                r[0 * xi_stride + q] = 4.f * a0 - 5.f * a2 + a4;
                r[1 * xi_stride + q] = -4.f * (a1 + a2) + a3 + a4;
                r[2 * xi_stride + q] = 4.f * (a1 - a2) - a3 + a4;
                r[3 * xi_stride + q] = 2.f * (a3 - a1) - a2 + a4;
                r[4 * xi_stride + q] = 2.f * (a1 - a3) - a2 + a4;
                r[5 * xi_stride + q] = 4.f * a1 - 5.f * a3 + a5;
            }
        }
    }
}

// out[i * 4 + j][k] = (A^T m A)[i][j] + bias[k] for m[xi] = prod[xi * xi_stride + k] (outputs outside the image go
// to a scratch row). A^T = [[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]].
ANCHOR_TARGET_CLONES
void transform_output_tile(const float* __restrict prod, int64_t xi_stride, const float* __restrict bias,
                           float* const* out, int64_t K) {
    for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
        const int64_t n = std::min(kBlock, K - k0);
        float t[kTile][kIn][kBlock], b[kBlock]; // A^T m
        for (int64_t q = 0; q < n; ++q) b[q] = bias != nullptr ? bias[k0 + q] : 0.f;
        for (int j = 0; j < kIn; ++j) {
            const float* __restrict p = prod + j * xi_stride + k0;
            for (int64_t q = 0; q < n; ++q) {
                const float m0 = p[q], m1 = p[kIn * xi_stride + q], m2 = p[2 * kIn * xi_stride + q],
                            m3 = p[3 * kIn * xi_stride + q], m4 = p[4 * kIn * xi_stride + q],
                            m5 = p[5 * kIn * xi_stride + q];
                t[0][j][q] = m0 + (m1 + m2) + (m3 + m4);
                t[1][j][q] = (m1 - m2) + 2.f * (m3 - m4);
                t[2][j][q] = (m1 + m2) + 4.f * (m3 + m4);
                t[3][j][q] = (m1 - m2) + 8.f * (m3 - m4) + m5;
            }
        }
        for (int i = 0; i < kTile; ++i) { // (A^T m) A
            float *__restrict y0 = out[i * kTile + 0] + k0, *__restrict y1 = out[i * kTile + 1] + k0,
                              *__restrict y2 = out[i * kTile + 2] + k0, *__restrict y3 = out[i * kTile + 3] + k0;
            for (int64_t q = 0; q < n; ++q) {
                const float a0 = t[i][0][q], a1 = t[i][1][q], a2 = t[i][2][q], a3 = t[i][3][q], a4 = t[i][4][q],
                            a5 = t[i][5][q];
                y0[q] = a0 + (a1 + a2) + (a3 + a4) + b[q];
                y1[q] = (a1 - a2) + 2.f * (a3 - a4) + b[q];
                y2[q] = (a1 + a2) + 4.f * (a3 + a4) + b[q];
                y3[q] = (a1 - a2) + 8.f * (a3 - a4) + a5 + b[q];
            }
        }
    }
}

} // namespace

bool winograd_applies(const torch::Tensor& x, const torch::Tensor& w, at::IntArrayRef stride, at::IntArrayRef padding,
                      at::IntArrayRef dilation) {
    auto all = [](at::IntArrayRef a, int64_t v) {
        return a.size() == 2 && a[0] == v && a[1] == v;
    };
    return x.defined() && w.defined() && x.dim() == 4 && w.dim() == 4 && x.scalar_type() == torch::kFloat &&
           w.scalar_type() == torch::kFloat && x.device().is_cpu() && w.device().is_cpu() && w.size(2) == 3 &&
           w.size(3) == 3 && w.size(1) == x.size(1) && all(stride, 1) && all(padding, 1) && all(dilation, 1) &&
           x.size(1) >= kWinogradMinChannels && w.size(0) >= kWinogradMinChannels &&
           x.size(0) * x.size(2) * x.size(3) >= kWinogradMinPositions;
}

torch::Tensor winograd_conv3x3(const torch::Tensor& x_in, const torch::Tensor& w_in, const torch::Tensor& bias,
                               WinogradGemm gemm, int64_t strip_bytes) {
    TORCH_CHECK(x_in.dim() == 4 && w_in.dim() == 4 && w_in.size(2) == 3 && w_in.size(3) == 3 &&
                    w_in.size(1) == x_in.size(1) && x_in.scalar_type() == torch::kFloat &&
                    w_in.scalar_type() == torch::kFloat && x_in.device().is_cpu() && w_in.device().is_cpu(),
                "winograd_conv3x3: input ", x_in.sizes(), " ", x_in.scalar_type(), " and weight ", w_in.sizes(), " ",
                w_in.scalar_type(), " are not float32 CPU tensors [N, C, H, W] and [K, C, 3, 3]");
    TORCH_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == w_in.size(0) &&
                                    bias.scalar_type() == torch::kFloat && bias.device().is_cpu()),
                "winograd_conv3x3: bias ", bias.defined() ? bias.sizes() : at::IntArrayRef{}, " does not fit weight ",
                w_in.sizes());
    RECORD_FUNCTION("anchor::winograd_conv3x3", std::vector<c10::IValue>({x_in}));
    torch::NoGradGuard no_grad;
    const int64_t N = x_in.size(0), C = x_in.size(1), H = x_in.size(2), W = x_in.size(3), K = w_in.size(0);
    ScopedOpTime timed("winograd3x3", [&](std::string& shape, double& macs) {
        shape = conv_shape_text(x_in.sizes().vec(), w_in.sizes().vec(), 1);
        macs = double(N) * double(K) * double(H) * double(W) * double(C) * 9.0; // the direct convolution's count
    });
    const bool channels_last = x_in.is_contiguous(torch::MemoryFormat::ChannelsLast) && !x_in.is_contiguous();
    // Channels innermost for the transforms: [N, H, W, C] and [N, H, W, K].
    const auto x = x_in.contiguous(torch::MemoryFormat::ChannelsLast);
    auto out = torch::empty({N, K, H, W}, x.options().memory_format(torch::MemoryFormat::ChannelsLast));
    if (N == 0 || K == 0 || H == 0 || W == 0) return channels_last ? out : out.contiguous();
    const auto w = w_in.contiguous();
    const auto b = bias.defined() ? bias.contiguous() : bias;

    // U [K, 36, C], V [P, 36, C], products [P, 36, K]: each tile's and each weight's 36 transformed rows are one
    // contiguous block (36 rows a large power of two apart would meet in the same cache sets); the GEMM reads the
    // 36 matrices through strides.
    auto u = torch::empty({K, kXi, C}, x.options());
    {
        const float* wp = w.data_ptr<float>();
        float* up = u.data_ptr<float>();
        at::parallel_for(0, K, 16, [&](int64_t k0, int64_t k1) {
            for (int64_t k = k0; k < k1; ++k) transform_weight_row(wp + k * C * 9, up + k * kXi * C, C, C);
        });
    }

    const int64_t th = (H + kTile - 1) / kTile, tw = (W + kTile - 1) / kTile;
    const double row_bytes = double(kXi) * double(N * tw) * double(C + K) * sizeof(float);
    const int64_t strip = std::clamp<int64_t>(int64_t(double(strip_bytes) / row_bytes), 1, th);
    const std::vector<float> zeros(size_t(C), 0.f);
    const float* xp = x.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
    for (int64_t ty0 = 0; ty0 < th; ty0 += strip) {
        const int64_t rows = std::min(strip, th - ty0), P = N * rows * tw;
        auto v = torch::empty({P, kXi, C}, x.options());
        float* vp = v.data_ptr<float>();
        at::parallel_for(0, P, 8, [&](int64_t p0, int64_t p1) {
            const float* d[kXi];
            for (int64_t p = p0; p < p1; ++p) {
                const int64_t n = p / (rows * tw), ty = ty0 + (p / tw) % rows, tx = p % tw;
                for (int64_t i = 0; i < kIn; ++i)
                    for (int64_t j = 0; j < kIn; ++j) {
                        const int64_t yy = ty * kTile - 1 + i, xx = tx * kTile - 1 + j;
                        d[i * kIn + j] =
                            yy >= 0 && yy < H && xx >= 0 && xx < W ? xp + ((n * H + yy) * W + xx) * C : zeros.data();
                    }
                transform_input_tile(d, vp + p * kXi * C, C, C);
            }
        });
        auto prod = torch::empty({P, kXi, K}, x.options());
        auto prod_xi = prod.transpose(0, 1);
        if (gemm == WinogradGemm::OneDnn && onednn_available())
            onednn_batched_linear_out(prod_xi, v.transpose(0, 1), u.transpose(0, 1));
        else
            prod_xi.copy_(torch::bmm(v.transpose(0, 1), u.transpose(0, 1).transpose(1, 2)));
        v = torch::Tensor();
        const float* pp = prod.data_ptr<float>();
        at::parallel_for(0, P, 8, [&](int64_t p0, int64_t p1) {
            std::vector<float> spill(size_t(K), 0.f); // outputs of a tile past the image's edge
            float* y[kTile * kTile];
            for (int64_t p = p0; p < p1; ++p) {
                const int64_t n = p / (rows * tw), ty = ty0 + (p / tw) % rows, tx = p % tw;
                for (int64_t i = 0; i < kTile; ++i)
                    for (int64_t j = 0; j < kTile; ++j) {
                        const int64_t yy = ty * kTile + i, xx = tx * kTile + j;
                        y[i * kTile + j] = yy < H && xx < W ? op + ((n * H + yy) * W + xx) * K : spill.data();
                    }
                transform_output_tile(pp + p * kXi * K, K, bp, y, K);
            }
        });
    }
    return channels_last ? out : out.contiguous();
}

} // namespace anchor::kernels
