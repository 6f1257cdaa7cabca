// 3x3 convolutions by Winograd's minimal filtering algorithm F(4x4, 3x3) (Lavin & Gray, "Fast Algorithms for
// Convolutional Neural Networks", CVPR 2016, section 4): every 4x4 block of outputs comes from a 6x6 input tile as
//   Y = A^T [ (G g G^T) (.) (B^T d B) ] A,
// so the products per (input channel, output channel) pair and 16 outputs fall from 144 to 36, and those 36 are,
// for each of the 36 tile positions xi, one matrix product [tiles, C] x [C, K] (the GEMM runs at the machine's GEMM
// rate; the transforms are streaming passes over the input and output).
//
// Why here: the VAE decoder and the UNet's outer levels spend nearly all their time in 3x3 convolutions that already
// run at oneDNN's direct-convolution rate (tests/bench/results/sd15_512_profile_2026-12-02.txt). oneDNN 2.x has a
// Winograd kernel, but its weights must be reordered into its own format by a reference loop (seconds for one
// 1280-channel weight), so it only pays with a transformed copy of every weight kept (4x the conv weights); this
// implementation transforms the weight on every call instead (36 floats written per 9 read, a few ms for SD's largest)
// and keeps no copy.
//
// Arithmetic: the transforms' constants (up to 8 and 1/24) cost a few bits beyond a direct sum: measured within
// 1e-5 of the output's magnitude against float64 (tests/test_onednn.cpp), against ~1e-7 for the direct kernels.
#pragma once

#include <torch/torch.h>

#include <cstdint>

namespace anchor::kernels {

// Which library runs the 36 products: oneDNN's batched matmul (onednn_batched_linear) or LibTorch's bmm.
enum class WinogradGemm { OneDnn, Torch };

// Where onednn_conv2d(..., winograd) takes winograd_conv3x3: a float32 3x3 kernel, stride 1, padding 1, dilation 1,
// at least kWinogradMinChannels input and output channels and kWinogradMinPositions output positions (N H W). The
// weight's transform costs 36 C K floats written per call whatever the positions, the GEMM saves 4x of 9 C K per
// position: on few positions (SD 1.5's 1280-channel levels, 512 positions at 256x256 and 512x512) the direct kernel
// is faster, from 2048 positions on Winograd is (measured per layer: tests/bench/results/winograd_2026-12-02.txt). Narrow
// convolutions (SD's conv_in, conv_out) stay direct.
constexpr int64_t kWinogradMinChannels = 64;
constexpr int64_t kWinogradMinPositions = 2048;
bool winograd_applies(const torch::Tensor& x, const torch::Tensor& weight, at::IntArrayRef stride,
                      at::IntArrayRef padding, at::IntArrayRef dilation);

// conv2d(x, weight, bias, stride 1, padding 1) for x [N, C, H, W] float32 (NCHW or channels-last; the output has
// x's layout) and weight [K, C, 3, 3] float32, bias [K] or undefined. The tiles go through in strips of tile rows
// whose transformed input and output stay near `strip_bytes` (at least one tile row).
torch::Tensor winograd_conv3x3(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                               WinogradGemm gemm = WinogradGemm::OneDnn, int64_t strip_bytes = int64_t(64) << 20);

} // namespace anchor::kernels
