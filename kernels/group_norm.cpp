#include "kernels/group_norm.h"

#include "kernels/cpu_features.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <cmath>
#include <vector>

namespace anchor::kernels {

namespace {

// sum[c] += x[p * C + c], sq[c] += x[p * C + c]^2 over pixels p in [0, P): channels innermost (vectorised over c).
ANCHOR_TARGET_CLONES
void accumulate_pixels(const float* __restrict x, int64_t P, int64_t C, double* __restrict sum, double* __restrict sq) {
    for (int64_t p = 0; p < P; ++p) {
        const float* r = x + p * C;
        for (int64_t c = 0; c < C; ++c) {
            const double v = r[c];
            sum[c] += v;
            sq[c] += v * v;
        }
    }
}

// Sum and sum of squares of one contiguous plane.
ANCHOR_TARGET_CLONES
void accumulate_plane(const float* __restrict x, int64_t n, double& sum, double& sq) {
    double s = 0, q = 0;
    for (int64_t i = 0; i < n; ++i) {
        const double v = x[i];
        s += v;
        q += v * v;
    }
    sum += s, sq += q;
}

} // namespace

torch::Tensor group_norm_silu_(torch::Tensor x, int64_t groups, const torch::Tensor& weight, const torch::Tensor& bias,
                               double eps) {
    TORCH_CHECK(x.dim() >= 2 && x.scalar_type() == torch::kFloat && x.device().is_cpu() && groups > 0 &&
                    x.size(1) % groups == 0,
                "group_norm_silu_: input ", x.sizes(), " ", x.scalar_type(), " is not a float32 CPU [N, C, ...] with C ",
                "divisible into ", groups, " groups");
    const bool channels_last = x.dim() == 4 && !x.is_contiguous() && x.is_contiguous(torch::MemoryFormat::ChannelsLast);
    TORCH_CHECK(channels_last || x.is_contiguous(), "group_norm_silu_: input ", x.sizes(), " with strides ",
                x.strides(), " is neither contiguous nor channels-last");
    RECORD_FUNCTION("anchor::group_norm_silu_", std::vector<c10::IValue>({x}));
    const int64_t N = x.size(0), C = x.size(1), G = groups, per = C / G, P = x.numel() / std::max<int64_t>(N * C, 1);
    if (x.numel() == 0) return x;
    // Per (image, channel) sums in double: one pass over x, in parallel over images x pixel chunks (channels-last) or
    // planes (contiguous).
    std::vector<double> sum(size_t(N * C), 0.0), sq(size_t(N * C), 0.0);
    const float* xp = x.data_ptr<float>();
    if (channels_last) {
        const int threads = std::max(1, at::get_num_threads());
        const int64_t chunks = std::min<int64_t>(P, threads * 4);
        std::vector<double> part_sum(size_t(N * chunks * C), 0.0), part_sq(size_t(N * chunks * C), 0.0);
        at::parallel_for(0, N * chunks, 1, [&](int64_t b, int64_t e) {
            for (int64_t t = b; t < e; ++t) {
                const int64_t n = t / chunks, k = t % chunks, p0 = P * k / chunks, p1 = P * (k + 1) / chunks;
                accumulate_pixels(xp + (n * P + p0) * C, p1 - p0, C, &part_sum[size_t(t * C)],
                                  &part_sq[size_t(t * C)]);
            }
        });
        for (int64_t t = 0; t < N * chunks; ++t)
            for (int64_t c = 0; c < C; ++c) {
                sum[size_t((t / chunks) * C + c)] += part_sum[size_t(t * C + c)];
                sq[size_t((t / chunks) * C + c)] += part_sq[size_t(t * C + c)];
            }
    } else {
        at::parallel_for(0, N * C, 1, [&](int64_t b, int64_t e) {
            for (int64_t t = b; t < e; ++t) accumulate_plane(xp + t * P, P, sum[size_t(t)], sq[size_t(t)]);
        });
    }
    // Per channel: y = x * scale + shift, scale = rstd * weight, shift = bias - mean * scale.
    auto scale = torch::empty({N, C}, x.options()), shift = torch::empty({N, C}, x.options());
    const auto w = weight.defined() ? weight.to(torch::kFloat).contiguous() : weight;
    const auto bb = bias.defined() ? bias.to(torch::kFloat).contiguous() : bias;
    const float* wp = w.defined() ? w.data_ptr<float>() : nullptr;
    const float* bp = bb.defined() ? bb.data_ptr<float>() : nullptr;
    float* sp = scale.data_ptr<float>();
    float* hp = shift.data_ptr<float>();
    const double count = double(per) * double(P);
    for (int64_t n = 0; n < N; ++n)
        for (int64_t g = 0; g < G; ++g) {
            double s = 0, q = 0;
            for (int64_t c = g * per; c < (g + 1) * per; ++c) s += sum[size_t(n * C + c)], q += sq[size_t(n * C + c)];
            const double mean = s / count, var = std::max(q / count - mean * mean, 0.0), rstd = 1.0 / std::sqrt(var + eps);
            for (int64_t c = g * per; c < (g + 1) * per; ++c) {
                const double a = rstd * (wp ? wp[c] : 1.0);
                sp[n * C + c] = float(a);
                hp[n * C + c] = float((bp ? bp[c] : 0.0) - mean * a);
            }
        }
    std::vector<int64_t> bshape(size_t(x.dim()), 1);
    bshape[0] = N, bshape[1] = C;
    x.mul_(scale.view(bshape)).add_(shift.view(bshape));
    return torch::silu_(x);
}

} // namespace anchor::kernels
