// Batched 2-D DCT-II energies with cuFFT (Makhoul 1980 reordering; see anchor_cuda.h for the equations).
#include "kernels/cuda/anchor_cuda.h"
#include "kernels/cuda/status.cuh"

#include <cuda_runtime.h>
#include <cufft.h>

#include <algorithm>
#include <mutex>
#include <utility>
#include <vector>
#include <cmath>
#include <string>

namespace anchor::kernels::cuda {

namespace detail {

thread_local std::string g_last_error;

int set_error(const std::string& what) {
    g_last_error = what;
    return 1;
}

int check_cuda(cudaError_t e, const char* call) {
    if (e == cudaSuccess) return 0;
    return set_error(std::string(call) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

} // namespace detail

const char* anchor_cuda_last_error() {
    return detail::g_last_error.c_str();
}

namespace {

constexpr int kThreads = 256;

size_t align_up(size_t n) {
    return (n + 255) / 256 * 256;
}

// v[r][p] = x[r][2p] for p < ceil(N/2), v[r][p] = x[r][2(N-1-p)+1] otherwise: evens ascending, then odds descending.
__global__ void makhoul_reorder(const float* __restrict__ x, float* __restrict__ v, int64_t rows, int64_t n) {
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= rows * n) return;
    const int64_t r = i / n, p = i % n;
    const int64_t half = (n + 1) / 2;
    const int64_t src = p < half ? 2 * p : 2 * (n - 1 - p) + 1;
    v[i] = x[r * n + src];
}

// From the half spectrum V (R2C output, n/2 + 1 bins per row) to the orthonormal DCT-II coefficient
// X(k) = a_k (cos(pi k / 2n) Re V(k) + sin(pi k / 2n) Im V(k)), using V(k) = conj(V(n - k)) for k > n/2.
// Row r = m * a_count + a of the input [maps, a_count, n] is written transposed to out[m][k][a]; squared when
// `square` (the final pass produces energies).
__global__ void makhoul_post(const cufftComplex* __restrict__ spec, float* __restrict__ out, int64_t maps,
                             int64_t a_count, int64_t n, bool square) {
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= maps * a_count * n) return;
    const int64_t k = i % n;
    const int64_t r = i / n; // = m * a_count + a
    const int64_t m = r / a_count, a = r % a_count;
    const int64_t bins = n / 2 + 1;
    cufftComplex c;
    if (k < bins) {
        c = spec[r * bins + k];
    } else {
        c = spec[r * bins + (n - k)];
        c.y = -c.y;
    }
    const double theta = M_PI * double(k) / double(2 * n);
    const float scale = static_cast<float>(k == 0 ? sqrt(1.0 / double(n)) : sqrt(2.0 / double(n)));
    const float val = scale * (static_cast<float>(cos(theta)) * c.x + static_cast<float>(sin(theta)) * c.y);
    out[(m * n + k) * a_count + a] = square ? val * val : val;
}

// Length-1 transforms are the identity (a_0 = 1): only the transposition (and squaring) remains. cuFFT plans need n
// >= 2.
__global__ void transpose_copy(const float* __restrict__ in, float* __restrict__ out, int64_t maps, int64_t a_count,
                               bool square) {
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= maps * a_count) return;
    const float v = in[i]; // in [maps, a_count, 1] -> out [maps, 1, a_count]: same linear index
    out[i] = square ? v * v : v;
}

int cufft_status(cufftResult r, const char* call) {
    if (r == CUFFT_SUCCESS) return 0;
    return detail::set_error(std::string(call) + ": cuFFT error " + std::to_string(static_cast<int>(r)));
}

// cuFFT plans cost ~0.1 ms to make (more than the transform itself at SD feature-map sizes: the performance mode of
// tests/test_kernels.cpp measured 0.33 ms per call with a plan per call vs 0.06 ms for torch's GEMM route), so they
// are kept, keyed by (length, batch), at most kMaxPlans of them (least recently made first out).
constexpr size_t kMaxPlans = 16;

std::mutex& plan_mutex() {
    static std::mutex m;
    return m;
}

// Caller holds plan_mutex() until it has executed the plan (eviction destroys plans).
int cached_plan(int len, int rows, cufftHandle* out) {
    static std::vector<std::pair<std::pair<int, int>, cufftHandle>> plans; // in creation order
    for (const auto& p : plans)
        if (p.first == std::make_pair(len, rows)) {
            *out = p.second;
            return 0;
        }
    cufftHandle plan;
    int in_embed = len, out_embed = len / 2 + 1;
    if (int s = cufft_status(cufftPlanMany(&plan, 1, &len, &in_embed, 1, len, &out_embed, 1, len / 2 + 1, CUFFT_R2C,
                                           rows),
                             "cufftPlanMany"))
        return s;
    if (plans.size() >= kMaxPlans) {
        cufftDestroy(plans.front().second);
        plans.erase(plans.begin());
    }
    plans.push_back({{len, rows}, plan});
    *out = plan;
    return 0;
}

// One pass: DCT-II along the last dim of in [maps, a_count, n], written transposed to out [maps, n, a_count].
int dct_pass(const float* in, float* out, int64_t maps, int64_t a_count, int64_t n, float* reordered,
             cufftComplex* spec, cudaStream_t stream, bool square) {
    const int64_t rows = maps * a_count, total = rows * n;
    const int blocks = static_cast<int>((total + kThreads - 1) / kThreads);
    if (n == 1) {
        transpose_copy<<<blocks, kThreads, 0, stream>>>(in, out, maps, a_count, square);
        return detail::check_cuda(cudaGetLastError(), "transpose_copy launch");
    }
    makhoul_reorder<<<blocks, kThreads, 0, stream>>>(in, reordered, rows, n);
    if (int s = detail::check_cuda(cudaGetLastError(), "makhoul_reorder launch")) return s;

    cufftHandle plan;
    std::lock_guard<std::mutex> lock(plan_mutex()); // a plan holds one stream and one work area at a time
    if (int s = cached_plan(static_cast<int>(n), static_cast<int>(rows), &plan)) return s;
    int status = cufft_status(cufftSetStream(plan, stream), "cufftSetStream");
    if (!status) status = cufft_status(cufftExecR2C(plan, reordered, spec), "cufftExecR2C");
    if (status) return status;

    makhoul_post<<<blocks, kThreads, 0, stream>>>(spec, out, maps, a_count, n, square);
    return detail::check_cuda(cudaGetLastError(), "makhoul_post launch");
}

} // namespace

size_t dct_energy_workspace_bytes(int64_t n_maps, int64_t h, int64_t w) {
    const size_t elems = static_cast<size_t>(n_maps * h * w);
    const size_t bins = static_cast<size_t>(n_maps) * std::max(h * (w / 2 + 1), w * (h / 2 + 1));
    return align_up(elems * sizeof(float)) * 2 + align_up(bins * sizeof(cufftComplex));
}

int dct_energy(const float* x, float* out, int64_t n_maps, int64_t h, int64_t w, void* workspace, void* stream_ptr) {
    if (n_maps < 0 || h < 1 || w < 1)
        return detail::set_error("dct_energy: invalid sizes n_maps=" + std::to_string(n_maps) +
                                 " h=" + std::to_string(h) + " w=" + std::to_string(w));
    if (n_maps == 0) return 0;
    if (n_maps * h > INT32_MAX || n_maps * w > INT32_MAX || h > INT32_MAX || w > INT32_MAX)
        return detail::set_error("dct_energy: batch too large for one cuFFT plan");
    if (!x || !out || !workspace) return detail::set_error("dct_energy: null pointer");
    auto stream = static_cast<cudaStream_t>(stream_ptr);
    char* ws = static_cast<char*>(workspace);
    const size_t elems = static_cast<size_t>(n_maps * h * w);
    float* reordered = reinterpret_cast<float*>(ws);
    float* transposed = reinterpret_cast<float*>(ws + align_up(elems * sizeof(float)));
    auto* spec = reinterpret_cast<cufftComplex*>(ws + 2 * align_up(elems * sizeof(float)));
    // Along w: [m, h, w] -> coefficients transposed [m, w(k), h]; then along h: [m, w, h] -> [m, h(u), w(k)] squared.
    if (int s = dct_pass(x, transposed, n_maps, h, w, reordered, spec, stream, false)) return s;
    return dct_pass(transposed, out, n_maps, w, h, reordered, spec, stream, true);
}

} // namespace anchor::kernels::cuda
