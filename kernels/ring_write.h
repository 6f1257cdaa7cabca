// CPU reference for the fused K/V ring-buffer write (kernels/cuda/ring_write.cu).
//
// A ring KV cache of capacity S + W keeps S "sink" tokens (the first S positions, never overwritten; StreamingLLM,
// Xiao et al. 2024) followed by a rolling window of the W most recent tokens. Token position p goes to slot
// ring_slot(p, S, W) = p for p < S, else S + (p - S) mod W.
#pragma once

#include <torch/torch.h>

#include <cstdint>

namespace anchor::kernels {

int64_t ring_slot(int64_t position, int64_t sink, int64_t window);

// Validates the ring-write operands: k_buf/v_buf [B, H, C, D] contiguous, same dtype/device; k/v [B, H, D] (or
// [B, H, 1, D]) of that dtype; 0 <= slot < C. Throws anchor::Error naming the operand.
void check_ring_write(const torch::Tensor& k_buf, const torch::Tensor& v_buf, const torch::Tensor& k,
                      const torch::Tensor& v, int64_t slot);

// k_buf[:, :, slot, :] = k and v_buf[:, :, slot, :] = v (plain loops over rows; CPU tensors).
void ring_write_cpu(torch::Tensor& k_buf, torch::Tensor& v_buf, const torch::Tensor& k, const torch::Tensor& v,
                    int64_t slot);

} // namespace anchor::kernels
