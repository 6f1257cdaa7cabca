// Plain-CUDA kernels of AnchorCache (raw device pointers, cuFFT; no LibTorch headers). The torch-facing entry points
// are in kernels/dispatch.h, which calls these only when built with ANCHOR_WITH_CUDA and the tensors are on a GPU.
//
// Every function returns 0 on success or a nonzero status; anchor_cuda_last_error() then describes the failure
// (CUDA or cuFFT error name, the call and the sizes). `stream` is a cudaStream_t passed as void* (nullptr = default).
#pragma once

#include <cstddef>
#include <cstdint>

namespace anchor::kernels::cuda {

// ---- batched 2-D DCT energy ----------------------------------------------------------------------------------
// x: n_maps contiguous float32 maps [n_maps, h, w] on the device; out: [n_maps, h, w] receives E(u, v) = X(u, v)^2
// with X the orthonormal DCT-II (see cache/dct.h). Each 1-D DCT-II of length N is computed from one real FFT of
// length N of the Makhoul (1980) reordering v = (x0, x2, x4, ..., x5, x3, x1):
//   X(k) = a_k Re(exp(-i pi k / 2N) V(k)),  a_0 = sqrt(1/N), a_k = sqrt(2/N),
// first along w (rows), written transposed, then along h. `workspace` must hold dct_energy_workspace_bytes() bytes.
size_t dct_energy_workspace_bytes(int64_t n_maps, int64_t h, int64_t w);
int dct_energy(const float* x, float* out, int64_t n_maps, int64_t h, int64_t w, void* workspace, void* stream);

// ---- fused ring-buffer write -------------------------------------------------------------------------------------
// k_buf, v_buf: contiguous [batch, heads, capacity, head_dim] caches (capacity = sink + window); k, v: one token's
// contiguous [batch, heads, head_dim] rows. Writes k into k_buf[:, :, slot, :] and v into v_buf[:, :, slot, :] in one
// launch. Elements are copied as raw bits of `elem_size` bytes (2: fp16/bf16, 4: fp32, 8: fp64).
int ring_write(void* k_buf, void* v_buf, const void* k, const void* v, int64_t batch, int64_t heads, int64_t capacity,
               int64_t head_dim, int64_t slot, int elem_size, void* stream);

const char* anchor_cuda_last_error();

} // namespace anchor::kernels::cuda
