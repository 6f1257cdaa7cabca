// Bandwidth-bound matrix-vector product for batch-1 decoding: y = W x + b with W row-major [rows, cols] in float32,
// float16, q8_0 or q4_0. At batch 1 every weight byte is read once per token, so decode speed is memory bandwidth / weight
// bytes; the kernels read the rows front to back (one sequential stream the hardware prefetcher follows) with AVX-512
// (AVX2/FMA where the CPU has no AVX-512; F16C widening for f16 weights) and split rows over OpenMP threads.
// The SIMD path is chosen at run time (kernels/cpu_features.h); the portable reference path is always available.
#pragma once

#include <torch/torch.h>

#include <cstdint>

namespace anchor::kernels {

// Plain loops (double accumulation): the reference the fast path is tested against.
void gemv_ref_f32(const float* w, const float* x, const float* b, float* y, int64_t rows, int64_t cols);
void gemv_ref_f16(const uint16_t* w, const float* x, const float* b, float* y, int64_t rows, int64_t cols);
// Fast path (AVX-512 or AVX2 when the CPU has it, else the portable loop), OpenMP over rows. `b` may be null.
void gemv_f32(const float* w, const float* x, const float* b, float* y, int64_t rows, int64_t cols);
void gemv_f16(const uint16_t* w, const float* x, const float* b, float* y, int64_t rows, int64_t cols);
// The instruction set a kernel runs on: the best this CPU has, or a narrower one (tests and benchmarks of each path).
enum class SimdPath { Best, Avx2, Portable };
// y [n, rows] = x [n, cols] W^T + b for a few input rows: the weight rows are streamed once (four at a time, the other
// input rows reading them from L1) instead of packed as a BLAS GEMM does on every call. Float32 sums in a different
// order from BLAS: the last bits differ. AVX-512 or AVX2/FMA where the CPU has it, else the portable loop.
void gemm_few_rows_f32(const float* w, const float* x, const float* b, float* y, int64_t n, int64_t rows, int64_t cols,
                       SimdPath path = SimdPath::Best);
bool gemv_uses_avx2();
bool gemv_uses_avx512();
// "AVX-512 gemv", "AVX2/FMA gemv" or "portable gemv".
std::string gemv_isa();

// ---- q8_0 ----------------------------------------------------------------------------------------------------------
// llama.cpp's q8_0 (ggml-common.h block_q8_0): blocks of 32 consecutive values of a row sharing one float16 scale,
// value = d * q with d = max|v| / 127 and q = round(v / d) in [-127, 127]. A row of `cols` values is
// q8_0_blocks(cols) blocks; the last one is zero-padded. As in llama.cpp's vec_dot_q8_0_q8_0, the activations are
// quantised the same way per block, so each block's dot is an exact int32 sum scaled by d_w * d_x.
constexpr int64_t kQ8Block = 32;
struct BlockQ8_0 {
    uint16_t d; // float16 bits
    int8_t q[kQ8Block];
};
static_assert(sizeof(BlockQ8_0) == 34, "block_q8_0 is 2 + 32 bytes, packed as in ggml");
inline int64_t q8_0_blocks(int64_t cols) {
    return (cols + kQ8Block - 1) / kQ8Block;
}

// Quantises one row of n values into q8_0_blocks(n) blocks (ggml's quantize_row_q8_0_ref rounding).
void quantize_row_q8_0(const float* v, BlockQ8_0* out, int64_t n);
// The n values the blocks encode (d * q).
void dequantize_row_q8_0(const BlockQ8_0* in, float* v, int64_t n);
// The activation side: per-block float32 scales and int8 quants (zero-padded to whole blocks).
void quantize_activation_q8_0(const float* x, float* d, int8_t* q, int64_t n);
// Reference: quantises x (quantize_activation_q8_0), then per block the int32 dot times d_w * d_x, summed in double.
void gemv_ref_q8_0(const BlockQ8_0* w, const float* x, const float* b, float* y, int64_t rows, int64_t cols);
// Fast path: AVX-512 VNNI (vpdpbusd on 256-bit lanes) or AVX2 (maddubs), else the reference arithmetic in float.
void gemv_q8_0(const BlockQ8_0* w, const float* x, const float* b, float* y, int64_t rows, int64_t cols);

// Tensor forms. w [rows, cols] float32 -> uint8 [rows, q8_0_blocks(cols) * 34] (the blocks of each row).
torch::Tensor quantize_q8_0(const torch::Tensor& w);
// The rows of quantize_q8_0 times x [cols] (cols = x.numel()), plus bias [rows] or undefined. Returns y [rows].
torch::Tensor gemv_q8_0(const torch::Tensor& wq, const torch::Tensor& x, const torch::Tensor& bias = {});

// ---- q4_0 ----------------------------------------------------------------------------------------------------------
// llama.cpp's q4_0 (ggml-common.h block_q4_0): blocks of 32 consecutive values sharing one float16 scale d = m / -8,
// m the block's value of largest magnitude (sign kept), and 4-bit codes c = min(15, trunc(v / d + 8.5)), value
// d * (c - 8). Byte j of a block holds value j in its low nibble and value j + 16 in its high one. 18 bytes per 32
// weights (0.14 of float32). As in llama.cpp's vec_dot_q4_0_q8_0 the activations are quantised to q8_0 blocks, so
// each block's dot is an exact int32 sum scaled by d_w * d_x.
constexpr int64_t kQ4Block = 32;
struct BlockQ4_0 {
    uint16_t d; // float16 bits
    uint8_t qs[kQ4Block / 2];
};
static_assert(sizeof(BlockQ4_0) == 18, "block_q4_0 is 2 + 16 bytes, packed as in ggml");
inline int64_t q4_0_blocks(int64_t cols) {
    return (cols + kQ4Block - 1) / kQ4Block;
}
// Quantises one row of n values into q4_0_blocks(n) blocks (ggml's quantize_row_q4_0_ref rounding; a partial last
// block is zero-padded, zeros encode as code 8).
void quantize_row_q4_0(const float* v, BlockQ4_0* out, int64_t n);
// The n values the blocks encode.
void dequantize_row_q4_0(const BlockQ4_0* in, float* v, int64_t n);
// Reference: quantises x (quantize_activation_q8_0), then per block the int32 dot of (c - 8) and the activation
// quants times d_w * d_x, summed in double.
void gemv_ref_q4_0(const BlockQ4_0* w, const float* x, const float* b, float* y, int64_t rows, int64_t cols);
// Fast path: AVX-512 VNNI (vpdpbusd) or AVX2 (maddubs) on the unsigned codes, minus 8 times the block's activation
// sum; else the reference arithmetic in float.
void gemv_q4_0(const BlockQ4_0* w, const float* x, const float* b, float* y, int64_t rows, int64_t cols);
// Tensor forms. w [rows, cols] float32 -> uint8 [rows, q4_0_blocks(cols) * 18].
torch::Tensor quantize_q4_0(const torch::Tensor& w);
torch::Tensor gemv_q4_0(const torch::Tensor& wq, const torch::Tensor& x, const torch::Tensor& bias = {});

// A contiguous copy of `t` (CPU) for weights that are streamed every token, in memory the kernel is asked to back with
// 2 MiB transparent huge pages (madvise(MADV_HUGEPAGE); Linux's THP default is madvise-only). With 4 KiB pages the
// stream takes a TLB miss every 4 KiB and the hardware prefetchers, which stop at page boundaries, restart on each
// page; on 2 MiB pages the same gemv reads markedly faster. Tensors under 2 MiB, and other systems, get a plain copy.
torch::Tensor huge_page_copy(const torch::Tensor& t);

// Tensor form: w [rows, cols] contiguous CPU float32/float16, x [cols] float32, bias [rows] or undefined.
// Other dtypes/devices fall back to torch::addmv. Returns y [rows] float32.
torch::Tensor gemv(const torch::Tensor& w, const torch::Tensor& x, const torch::Tensor& bias = {});
// The same through torch::mv / addmv (reference for tests and benchmarks).
torch::Tensor gemv_torch(const torch::Tensor& w, const torch::Tensor& x, const torch::Tensor& bias = {});

// Tensor form of gemm_few_rows_f32: x [..., cols] float32 (any leading shape), w [rows, cols] contiguous float32,
// bias [rows] or undefined; returns [..., rows]. Applies where x has at most max_rows rows, both are CPU float32 and
// the CPU has AVX2/FMA (the portable loop would lose to BLAS), and no gradient is recorded.
bool few_rows_linear_applies(const torch::Tensor& x, const torch::Tensor& w, int64_t max_rows);
torch::Tensor few_rows_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias = {},
                              SimdPath path = SimdPath::Best);

} // namespace anchor::kernels
