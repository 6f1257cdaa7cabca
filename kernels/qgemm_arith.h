// The arithmetic of a whole-sequence product with q8_0 / q4_0 weights (kernels/qgemm.h), chosen per model:
//
// - F32: qlinear's tiled dequantise-and-multiply: the float32 product of the dequantised weights (the reference;
//   only BLAS's summation order differs from dequantise-then-matmul).
// - Int8: llama.cpp's arithmetic (ggml's vec_dot_q8_0_q8_0 / vec_dot_q4_0_q8_0). Each activation row is quantised to
//   q8_0 blocks (32 values, scale max|x| / 127, ggml's reference rounding), each (weight block, activation block)
//   pair gives an exact int32 dot, scaled by d_w * d_x and summed in float32. The only error beyond the weights' own
//   quantisation is the activations' rounding to 8 bits: at most half a step (max|x_block| / 254) per value, so a
//   row's result moves by at most sum_blocks |w_block|_1 * max|x_block| / 254 (relative ~1e-3 for Gaussian-like
//   rows, the figure the tests bound). The micro-kernel (AVX-512 VNNI) keeps a panel of 32 weight rows repacked as
//   unsigned bytes, four consecutive inputs of 16 rows per 512-bit vector, and multiplies it with several activation
//   rows at once (vpdpbusd with the activation's four quants broadcast), so each weight byte loaded serves every row
//   of the group; the unsigned offset (8 for q4_0's codes, 128 for q8_0) is removed through the activation block's
//   sum, which starts the int32 accumulator.
// - Bf16: the weights dequantised to float32 then rounded to bfloat16, the activations rounded to bfloat16, products
//   summed in float32 (vdpbf16ps, AVX512-BF16). A q4_0 / q8_0 value d * q is generally NOT a bfloat16 (d is a float16,
//   11 significant bits; bfloat16 keeps 8), so both operands carry bfloat16's rounding (relative 2^-8 each).
//
// float16 / bfloat16 weights have no integer form: Int8 multiplies them as F32 does; Bf16 rounds float16 weights to
// bfloat16 (bfloat16 weights are exact). Where the CPU lacks the instructions (VNNI, AVX512-BF16) the same arithmetic
// runs through the per-row reference loops (Int8) or is refused (Bf16: qgemm_arithmetic_unavailable).
#pragma once

#include "cache/io/enum_table.h"
#include "kernels/qgemm.h"

#include <torch/torch.h>

#include <string>

namespace anchor::kernels {

enum class QGemmArithmetic { F32, Bf16, Int8 };
const EnumTable<QGemmArithmetic>& qgemm_arithmetic_table(); // "f32", "bf16", "int8"
// What a quantised model runs when nothing is asked for: Int8 (the measured fastest; docs/text-diffusion.md).
QGemmArithmetic default_qgemm_arithmetic();
// Why `a` cannot run on this CPU ("" when it can): Bf16 without AVX512-BF16.
std::string qgemm_arithmetic_unavailable(QGemmArithmetic a);

// y [..., rows] = x [..., cols] W^T + b in arithmetic `a` (F32 = qlinear). F32 weights always run qlinear's plain
// float32 linear layer.
torch::Tensor qlinear_with(const torch::Tensor& x, const QWeight& w, const torch::Tensor& b, QGemmArithmetic a);

// The Int8 product of q8_0 / q4_0 weights: the micro-kernel where the CPU has AVX-512 VNNI, else the per-row loops.
torch::Tensor qlinear_int8(const torch::Tensor& x, const QWeight& w, const torch::Tensor& b = {});
// Reference of the Int8 arithmetic: per activation row gemv_ref_q8_0 / gemv_ref_q4_0 (the same quantised
// activations, exact int32 block dots, sums in double).
torch::Tensor qlinear_int8_ref(const torch::Tensor& x, const QWeight& w, const torch::Tensor& b = {});
// The Bf16 product (any weight type; needs AVX512-BF16).
torch::Tensor qlinear_bf16(const torch::Tensor& x, const QWeight& w, const torch::Tensor& b = {});

} // namespace anchor::kernels
