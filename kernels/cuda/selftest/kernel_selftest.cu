// Standalone GPU self-test of the plain-CUDA kernels (no LibTorch, no project build): compares the cuFFT DCT energy
// against a direct separable float64 DCT-II on the host and the fused ring write against host memcpy. Used by
// kernels/device-check.sh before (and independently of) the full build:
//   nvcc -std=c++17 -O2 -I. kernels/cuda/selftest/kernel_selftest.cu kernels/cuda/dct_energy.cu \
//        kernels/cuda/ring_write.cu -lcufft -o kernel_selftest
#include "kernels/cuda/anchor_cuda.h"

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

namespace kc = anchor::kernels::cuda;

namespace {

#define CK(call)                                                                                                       \
    do {                                                                                                               \
        cudaError_t e_ = (call);                                                                                       \
        if (e_ != cudaSuccess) {                                                                                       \
            std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__);                       \
            std::exit(2);                                                                                              \
        }                                                                                                              \
    } while (0)

// Orthonormal DCT-II of one [h, w] map in float64, separable: rows then columns.
std::vector<double> host_dct2(const float* x, int64_t h, int64_t w) {
    auto basis = [](int64_t n) {
        std::vector<double> c(n * n);
        for (int64_t k = 0; k < n; ++k)
            for (int64_t i = 0; i < n; ++i)
                c[k * n + i] = (k == 0 ? std::sqrt(1.0 / n) : std::sqrt(2.0 / n)) *
                               std::cos(M_PI * double(2 * i + 1) * double(k) / double(2 * n));
        return c;
    };
    const auto ch = basis(h), cw = basis(w);
    std::vector<double> tmp(h * w, 0.0), out(h * w, 0.0);
    for (int64_t i = 0; i < h; ++i)
        for (int64_t v = 0; v < w; ++v) {
            double s = 0;
            for (int64_t j = 0; j < w; ++j) s += cw[v * w + j] * x[i * w + j];
            tmp[i * w + v] = s;
        }
    for (int64_t u = 0; u < h; ++u)
        for (int64_t v = 0; v < w; ++v) {
            double s = 0;
            for (int64_t i = 0; i < h; ++i) s += ch[u * h + i] * tmp[i * w + v];
            out[u * w + v] = s;
        }
    return out;
}

bool check_dct(int64_t maps, int64_t h, int64_t w, std::mt19937& rng) {
    std::normal_distribution<float> nd;
    const int64_t n = maps * h * w;
    std::vector<float> x(n), e(n);
    for (auto& v : x) v = nd(rng);
    float *dx, *de;
    void* ws;
    CK(cudaMalloc(&dx, n * sizeof(float)));
    CK(cudaMalloc(&de, n * sizeof(float)));
    CK(cudaMalloc(&ws, kc::dct_energy_workspace_bytes(maps, h, w)));
    CK(cudaMemcpy(dx, x.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    const int rc = kc::dct_energy(dx, de, maps, h, w, ws, nullptr);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(e.data(), de, n * sizeof(float), cudaMemcpyDeviceToHost));
    cudaFree(dx);
    cudaFree(de);
    cudaFree(ws);
    if (rc != 0) {
        std::printf("dct_energy           | [%ld, %ld, %ld] | error: %s | FAIL\n", long(maps), long(h), long(w),
                    kc::anchor_cuda_last_error());
        return false;
    }
    double max_err = 0, max_ref = 0;
    for (int64_t m = 0; m < maps; ++m) {
        const auto ref = host_dct2(x.data() + m * h * w, h, w);
        for (int64_t i = 0; i < h * w; ++i) {
            const double r = ref[i] * ref[i];
            max_err = std::max(max_err, std::abs(double(e[m * h * w + i]) - r));
            max_ref = std::max(max_ref, r);
        }
    }
    const double rel = max_err / (max_ref > 0 ? max_ref : 1.0);
    const bool pass = rel < 1e-4;
    std::printf("dct_energy           | [%ld, %ld, %ld] | %.2e | %s\n", long(maps), long(h), long(w), rel,
                pass ? "PASS" : "FAIL");
    return pass;
}

bool check_ring(int64_t B, int64_t H, int64_t C, int64_t D, int elem, std::mt19937& rng) {
    const int64_t buf_bytes = B * H * C * D * elem, row_bytes = B * H * D * elem;
    std::vector<uint8_t> kb(buf_bytes), vb(buf_bytes), k(row_bytes), v(row_bytes);
    for (auto* vec : {&kb, &vb, &k, &v})
        for (auto& b : *vec) b = static_cast<uint8_t>(rng());
    void *dkb, *dvb, *dk, *dv;
    CK(cudaMalloc(&dkb, buf_bytes));
    CK(cudaMalloc(&dvb, buf_bytes));
    CK(cudaMalloc(&dk, row_bytes));
    CK(cudaMalloc(&dv, row_bytes));
    CK(cudaMemcpy(dkb, kb.data(), buf_bytes, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dvb, vb.data(), buf_bytes, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dk, k.data(), row_bytes, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dv, v.data(), row_bytes, cudaMemcpyHostToDevice));
    const int64_t slot = C - 2;
    const int rc = kc::ring_write(dkb, dvb, dk, dv, B, H, C, D, slot, elem, nullptr);
    CK(cudaDeviceSynchronize());
    std::vector<uint8_t> gk(buf_bytes), gv(buf_bytes);
    CK(cudaMemcpy(gk.data(), dkb, buf_bytes, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(gv.data(), dvb, buf_bytes, cudaMemcpyDeviceToHost));
    for (void* p : {dkb, dvb, dk, dv}) cudaFree(p);
    const int64_t rb = D * elem;
    for (int64_t r = 0; r < B * H; ++r) {
        std::memcpy(kb.data() + (r * C + slot) * rb, k.data() + r * rb, rb);
        std::memcpy(vb.data() + (r * C + slot) * rb, v.data() + r * rb, rb);
    }
    const bool pass = rc == 0 && gk == kb && gv == vb;
    std::printf("ring_write elem=%d    | [%ld, %ld, %ld, %ld] | %s | %s\n", elem, long(B), long(H), long(C), long(D),
                rc ? kc::anchor_cuda_last_error() : (pass ? "exact" : "mismatch"), pass ? "PASS" : "FAIL");
    return pass;
}

} // namespace

int main() {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        std::printf("no CUDA device\n");
        return 2;
    }
    std::mt19937 rng(1234);
    bool ok = true;
    for (auto s : std::vector<std::vector<int64_t>>{{1, 8, 8}, {8, 7, 5}, {3, 16, 9}, {640, 64, 64}, {2, 1, 1}})
        ok &= check_dct(s[0], s[1], s[2], rng);
    for (int elem : {2, 4})
        for (int64_t D : {64, 80, 3}) ok &= check_ring(2, 12, 36, D, elem, rng);
    std::printf("%s\n", ok ? "selftest: all passed" : "selftest: FAILED");
    return ok ? 0 : 1;
}
