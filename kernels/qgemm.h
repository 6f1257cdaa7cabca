// Linear layers whose weights stay in their storage format (float32, float16, bfloat16, or llama.cpp's q8_0 / q4_0
// blocks of kernels/gemv.h) for whole-sequence products: a masked-diffusion LM denoises every position of the sequence
// at each step, so its products are GEMMs (n = sequence length rows of activations), not the GEMVs of batch-1
// decoding. The fast path dequantises a tile of weight rows into a float32 buffer that stays in cache and multiplies
// it with every activation row through BLAS: each weight is widened once per product and reused n times, and the
// arithmetic is the float32 product of the dequantised weights (only BLAS's summation order differs from
// dequantise-then-matmul), so the rounding is that of the weights' quantisation alone.
#pragma once

#include "cache/io/enum_table.h"

#include <torch/torch.h>

#include <cstdint>

namespace anchor::kernels {

enum class QWeightType { F32, F16, BF16, Q8_0, Q4_0 };
const EnumTable<QWeightType>& qweight_type_table(); // "f32", "f16", "bf16", "q8_0", "q4_0"

// A weight [rows, cols] in one storage format:
//   F32 / F16 / BF16: a [rows, cols] tensor of that dtype;
//   Q8_0 / Q4_0: uint8 [rows, blocks(cols) * block bytes], each row its own run of blocks (a partial last block is
//   zero-padded, so any cols works).
// `data` may view memory it does not own (a GGUF map): its deleter keeps the owner alive.
struct QWeight {
    QWeightType type = QWeightType::F32;
    int64_t rows = 0, cols = 0;
    torch::Tensor data;

    bool defined() const { return data.defined(); }
    int64_t bytes() const { return data.defined() ? data.numel() * int64_t(data.element_size()) : 0; }
    // Bytes of one stored row.
    static int64_t row_bytes(QWeightType t, int64_t cols);
    // w [rows, cols] (any float dtype) stored as `t` (quantised with ggml's reference rounding for Q8_0 / Q4_0).
    static QWeight from_float(const torch::Tensor& w, QWeightType t);
    // Stored bytes as they are: uint8 [rows, row_bytes] for Q8_0 / Q4_0, the dtype's [rows, cols] tensor otherwise.
    // anchor::Error naming `what` when the shape or dtype does not fit.
    static QWeight from_stored(torch::Tensor data, QWeightType t, int64_t rows, int64_t cols, const std::string& what);
    // Every value as float32 [rows, cols].
    torch::Tensor dequantize() const;
    // Rows [r0, r1) as float32 into `out` (contiguous, (r1 - r0) * cols floats).
    void dequantize_rows(int64_t r0, int64_t r1, float* out) const;
    // The rows named by `ids` (int64, any shape) as float32 [..., cols]: an embedding lookup.
    torch::Tensor gather_rows(const torch::Tensor& ids) const;
    // The same weight with its rows reordered: row i of the result is row perm[i] (int64 [rows]).
    QWeight permute_rows(const torch::Tensor& perm) const;
};

// y [..., rows] = x [..., cols] W^T + b (b [rows] float32 or undefined). F32 weights run torch::matmul / addmm as a
// plain float32 linear layer does; the others the tiled dequantise-and-multiply described above.
torch::Tensor qlinear(const torch::Tensor& x, const QWeight& w, const torch::Tensor& b = {});
// Reference: the whole weight dequantised, then one float32 matmul.
torch::Tensor qlinear_ref(const torch::Tensor& x, const QWeight& w, const torch::Tensor& b = {});

} // namespace anchor::kernels
