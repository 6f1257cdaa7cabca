// Fused K/V ring-buffer write: one token's rows for all heads into slot `slot` of two [B, H, capacity, D] caches.
#include "kernels/cuda/anchor_cuda.h"
#include "kernels/cuda/status.cuh"

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace anchor::kernels::cuda {

namespace {

constexpr int kThreads = 256;

// One thread copies one unit (T = 16/8/4/2/1 bytes) of both K and V; `units` units per (batch, head) row.
template <typename T>
__global__ void ring_write_kernel(T* __restrict__ k_buf, T* __restrict__ v_buf, const T* __restrict__ k,
                                  const T* __restrict__ v, int64_t rows, int64_t units, int64_t capacity,
                                  int64_t slot) {
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= rows * units) return;
    const int64_t row = i / units, u = i % units; // row = b * heads + h
    const int64_t dst = (row * capacity + slot) * units + u;
    k_buf[dst] = k[i];
    v_buf[dst] = v[i];
}

template <typename T>
int launch(void* k_buf, void* v_buf, const void* k, const void* v, int64_t rows, int64_t row_bytes, int64_t capacity,
           int64_t slot, cudaStream_t stream) {
    const int64_t units = row_bytes / static_cast<int64_t>(sizeof(T));
    const int64_t total = rows * units;
    const int blocks = static_cast<int>((total + kThreads - 1) / kThreads);
    ring_write_kernel<T><<<blocks, kThreads, 0, stream>>>(static_cast<T*>(k_buf), static_cast<T*>(v_buf),
                                                          static_cast<const T*>(k), static_cast<const T*>(v), rows,
                                                          units, capacity, slot);
    return detail::check_cuda(cudaGetLastError(), "ring_write_kernel launch");
}

bool aligned(const void* p, size_t a) {
    return reinterpret_cast<uintptr_t>(p) % a == 0;
}

} // namespace

int ring_write(void* k_buf, void* v_buf, const void* k, const void* v, int64_t batch, int64_t heads, int64_t capacity,
               int64_t head_dim, int64_t slot, int elem_size, void* stream_ptr) {
    if (batch < 0 || heads < 0 || capacity < 1 || head_dim < 1) return detail::set_error("ring_write: invalid sizes");
    if (slot < 0 || slot >= capacity)
        return detail::set_error("ring_write: slot " + std::to_string(slot) + " outside [0, " +
                                 std::to_string(capacity) + ")");
    if (elem_size != 1 && elem_size != 2 && elem_size != 4 && elem_size != 8)
        return detail::set_error("ring_write: unsupported element size " + std::to_string(elem_size));
    if (!k_buf || !v_buf || !k || !v) return detail::set_error("ring_write: null pointer");
    const int64_t rows = batch * heads;
    if (rows == 0) return 0;
    const int64_t row_bytes = head_dim * elem_size;
    auto stream = static_cast<cudaStream_t>(stream_ptr);
    // Widest copy unit that divides a row and matches every pointer's alignment (16-byte vector loads for fp16 rows
    // of 8+ elements, fp32 rows of 4+).
    for (size_t unit : {16, 8, 4, 2}) {
        if (row_bytes % static_cast<int64_t>(unit) != 0) continue;
        if (!aligned(k_buf, unit) || !aligned(v_buf, unit) || !aligned(k, unit) || !aligned(v, unit)) continue;
        switch (unit) {
        case 16:
            return launch<uint4>(k_buf, v_buf, k, v, rows, row_bytes, capacity, slot, stream);
        case 8:
            return launch<uint2>(k_buf, v_buf, k, v, rows, row_bytes, capacity, slot, stream);
        case 4:
            return launch<uint32_t>(k_buf, v_buf, k, v, rows, row_bytes, capacity, slot, stream);
        default:
            return launch<uint16_t>(k_buf, v_buf, k, v, rows, row_bytes, capacity, slot, stream);
        }
    }
    return launch<uint8_t>(k_buf, v_buf, k, v, rows, row_bytes, capacity, slot, stream);
}

} // namespace anchor::kernels::cuda
