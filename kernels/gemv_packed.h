// q8_0 / q4_0 decode rows re-laid out for 512-bit VNNI (vpdpbusd on zmm registers): the same block values and float16
// scales as llama.cpp's formats (kernels/gemv.h; quantised by its reference rounding), in an order the kernel reads
// without per-block shuffles or scalar scale loads.
//
// Why: with ggml's interleaved 34- / 18-byte blocks, each block's dot is converted to float and scaled on its own (a
// scalar float16 load, a broadcast, a conversion and an FMA per 32 weights), which keeps the q8_0 and q4_0 products
// below the memory bandwidth on one core. Here a row is
//   [quants of every block][float16 scales of every block]   (row bytes exactly those of the block format)
// with the blocks in quads of four: a quad's 64-byte vector A holds values 0-15 of its four blocks, vector B values
// 16-31 (q8_0: two vectors, each int8 stored as q + 128, i.e. unsigned; q4_0: one vector of the quad's 4 x 16 code
// bytes, whose low nibbles are the A values and high nibbles the B values, as ggml packs a block). One vpdpbusd per
// vector leaves each block's partial sums in one 128-bit lane; four quads (16 blocks) reduce to one vector of 16
// block sums with two unpack-and-add levels, and the 16 scales are one float16 load, stored in that lane order.
// The offset of the unsigned codes (128 for q8_0, 8 for q4_0) is taken off as offset * sum(x) per block, computed
// once per product. Each block's integer dot is exact, as in llama.cpp's vec_dot; only the float sum order differs.
//
// Applies where cols is a multiple of 256 (whole groups of 8 blocks: every GPT-2 width); other rows keep the block
// format and its kernels.
#pragma once

#include "kernels/gemv.h"

#include <torch/torch.h>

#include <cstdint>

namespace anchor::kernels {

// cols % 256 == 0.
bool packed_rows_apply(int64_t cols);
// The 512-bit VNNI kernel runs on this CPU (else the packed products run a portable loop over the same layout).
bool packed_rows_fast();

// Re-lays out q8_0 / q4_0 rows (uint8 [rows, blocks * 34 or 18], as quantize_q8_0 / quantize_q4_0 give them) into
// the packed layout: uint8 [rows, same bytes]. anchor::Error when the shape does not fit or cols does not apply.
torch::Tensor pack_q8_0_rows(const torch::Tensor& wq, int64_t cols);
torch::Tensor pack_q4_0_rows(const torch::Tensor& wq, int64_t cols);

// y = W x + b (b may be null) over packed rows; OpenMP over rows as kernels::gemv_q8_0. SimdPath::Best: the 512-bit
// VNNI kernel where packed_rows_fast(), else (and for any other path) the portable loop over the same layout.
void gemv_q8_0_packed(const uint8_t* w, const float* x, const float* b, float* y, int64_t rows, int64_t cols,
                      SimdPath path = SimdPath::Best);
void gemv_q4_0_packed(const uint8_t* w, const float* x, const float* b, float* y, int64_t rows, int64_t cols,
                      SimdPath path = SimdPath::Best);

} // namespace anchor::kernels
