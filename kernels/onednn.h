// Linear layers and convolutions on oneDNN's inference kernels, called directly (the oneDNN LibTorch itself links).
//
// Why: LibTorch 1.13 runs a linear layer on the BLAS (OpenBLAS here), and on the AVX-512 machines we measure on
// oneDNN's brgemm matmul runs SD's shapes at ~340-380 GFLOP/s where OpenBLAS' sgemm reaches ~160-200 (2 threads,
// Zen 5; tests/bench/results/onednn_gemm_2026-12-02.txt). LibTorch's own convolution goes through oneDNN too (ideep),
// as fast at SD's large sizes but with its weight reordered on every call unless a packed copy is kept (the LibTorch
// fast path of unet/model/unet_perf.h keeps one: ~1.2 GB for SD 1.5's UNet), and slower on the few positions of
// the deep levels at 256x256.
//
// What is different from LibTorch's arithmetic: the summation order (blocking) of the products, so results differ in
// the last bits (a few 1e-7 of the output's magnitude, tests/test_onednn.cpp against float64). The tiny reference
// models, whose GroupNorm over 1-2 channels amplifies a last-bit difference ~1000x, keep LibTorch's (they keep the
// exact attention too: unet/model/unet_model.h default_gemm_backend).
//
// No second copy of a weight is kept: the matmul reads the [N, K] weight as it is (a transposed "ba" operand), and
// a convolution's weight is reordered to the kernel's blocked layout on every call (a few ms for SD's largest,
// against tens of ms of compute); where the positions are few (a deep UNet level at 256x256) the convolution takes
// the plain weight layout, whose gemm-based kernel is then as fast.
#pragma once

#include "cache/io/enum_table.h"

#include <torch/torch.h>

#include <cstdint>
#include <string>

namespace anchor::kernels {

// Which library multiplies: LibTorch (its BLAS and ideep convolution: the reference's bits) or oneDNN's inference
// kernels (this file) where they apply; Winograd = oneDNN's kernels, with the 3x3 convolutions in Winograd's
// F(4x4, 3x3) form where that pays (kernels/winograd.h); Bf16 = oneDNN's kernels with bfloat16 operands: the
// activation rounded to bfloat16 on the way in (and a float32 weight on every call; store the weights as bf16 to
// avoid that), products summed and written in float32, everything between the layers (norms, attention, softmax)
// float32 as before. On a CPU with AVX512-BF16 or AMX a bfloat16 product costs half a float32 FMA or less (vdpbf16ps
// does two per lane), so the layers run up to twice as fast; the output moves by bfloat16's rounding of the operands
// (relative 2^-9 per operand), not the reference's bits. The automatic-mixed-precision recipe of Kalamkar et al.,
// "A Study of BFLOAT16 for Deep Learning Training" (2019), applied to inference.
enum class GemmBackend { Torch, OneDnn, Winograd, Bf16 };
const EnumTable<GemmBackend>& gemm_backend_table(); // "torch", "onednn", "winograd", "bf16"

// Built with oneDNN 2.x (ANCHOR_HAVE_DNNL); decided at build time.
bool onednn_available();
// Whether backend `b` runs on oneDNN's kernels in this build.
inline bool runs_on_onednn(GemmBackend b) {
    return b != GemmBackend::Torch && onednn_available();
}
// "oneDNN 2.6.3, matmul brg:avx512_core, convolution brgconv:avx512_core" (the kernels oneDNN picks on this CPU for
// a typical SD shape), or why it is not available.
std::string onednn_description();

// Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX-BF16) in a build with oneDNN: what
// GemmBackend::Bf16 needs (elsewhere oneDNN would emulate it slower than float32, or have no kernel).
bool onednn_bf16_native();
// Frees the bf16 kernels' packed weights (also dropped by themselves once their weight is gone, at the next packing).
void onednn_drop_packed_weights();
// Why backend `b` cannot run in this build on this CPU ("" when it can): the bf16 backend without native bfloat16.
std::string gemm_backend_unavailable(GemmBackend b);

// float32 CPU tensors outside autograd: x [..., K] with K == weight.size(1), weight [N, K] with unit stride along K.
// bf16: the weight may also be bfloat16.
bool onednn_linear_applies(const torch::Tensor& x, const torch::Tensor& weight, bool bf16 = false);
// x W^T + b (b may be undefined) -> [..., N], float32. bf16: x and W rounded to bfloat16, summed in float32
// (GemmBackend::Bf16).
torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                            bool bf16 = false);
// out [B, M, N] = a [B, M, K] times w [B, N, K] transposed: B products of float32 operands with any batch and row
// strides and unit inner strides (kernels/winograd.h).
void onednn_batched_linear_out(torch::Tensor& out, const torch::Tensor& a, const torch::Tensor& w);

// float32 CPU tensors outside autograd, x [N, C, H, W], weight [K, C, kh, kw], one group, zero padding (symmetric,
// as numbers), any stride and dilation. bf16: the weight may also be bfloat16.
bool onednn_conv2d_applies(const torch::Tensor& x, const torch::Tensor& weight, int64_t groups, bool bf16 = false);
// How onednn_conv2d multiplies: float32, float32 with Winograd's F(4x4, 3x3) for a 3x3, stride-1, padding-1
// convolution where winograd_applies (kernels/winograd.h), or bfloat16 operands summed in float32.
enum class ConvArithmetic { F32, Winograd, Bf16 };
torch::Tensor onednn_conv2d(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                            at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                            ConvArithmetic arithmetic = ConvArithmetic::F32);
// The oneDNN implementation onednn_conv2d runs for these operands with F32 or Bf16 arithmetic (e.g. "gemm:jit",
// "brgconv:avx512_core"; "ref:any" is oneDNN's scalar fallback), for tests and reports.
std::string onednn_conv2d_kernel(const torch::Tensor& x, const torch::Tensor& weight, bool bias, at::IntArrayRef stride,
                                 at::IntArrayRef padding, at::IntArrayRef dilation, bool bf16 = false);

// conv2d(upsample_nearest_2x(x), weight, bias, padding 1) for a 3x3 weight, without the upsampled input: each of the
// four output phases (dy, dx) of the upsampled grid sees only two rows and two columns of x, with the taps that fall
// on the same pixel summed (dy = 0: rows i-1 <- w[0], i <- w[1] + w[2]; dy = 1: i <- w[0] + w[1], i+1 <- w[2]; the
// same for columns). So the four phases are one 2x2 convolution of x with 4K output channels and padding 1, whose
// output [N, 4K, H+1, W+1] is interleaved into [N, K, 2H, 2W]: 16 instead of 36 multiplies per (input, output) pair
// and input pixel, and no 4x larger upsampled tensor (the "resize-convolution" of SD's upsamplers). The layout of x
// (NCHW or channels-last) is kept. Applies where onednn_conv2d_applies and the weight is [K, C, 3, 3].
// bf16: the phase weights summed in float32, then multiplied as onednn_conv2d's Bf16. keep: a float32 weight's phase
// weights are made once and kept while it lives unchanged (false for a weight made for this call, e.g. upcast).
torch::Tensor onednn_upsample2x_conv3x3(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                                        bool bf16 = false, bool keep = true);

// Output positions per call (N * H_out * W_out) at or below which onednn_conv2d hands the kernel the plain weight
// instead of reordering it (measured crossover: tests/bench/results/onednn_gemm_2026-12-02.txt).
constexpr int64_t kPlainWeightMaxPositions = 256;

} // namespace anchor::kernels
