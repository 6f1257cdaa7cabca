// Image quality metrics used to judge cached generations against uncached ones. One implementation (plain loops in
// float64 over channel-last float images); the tensor overloads only convert and call it.
//
// PSNR = 10 log10(L^2 / MSE) dB with L the data range (inf for identical images).
// SSIM (Wang, Bovik, Sheikh, Simoncelli 2004, eq. 13): per channel, local statistics under an 11x11 Gaussian window
// (sigma 1.5, normalised), C1 = (K1 L)^2, C2 = (K2 L)^2 with K1 = 0.01, K2 = 0.03,
//   SSIM(x, y) = (2 mu_x mu_y + C1)(2 sigma_xy + C2) / ((mu_x^2 + mu_y^2 + C1)(sigma_x^2 + sigma_y^2 + C2)),
// averaged over the positions where the window fits entirely ('valid', as in the authors' ssim_index.m), then over
// channels. Images must be at least 11x11.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <vector>

namespace anchor::cache {

// A contiguous channel-last float image [height, width, channels].
struct ImageView {
    const float* data = nullptr;
    int64_t height = 0, width = 0, channels = 1;
};

double psnr(const ImageView& a, const ImageView& b, double data_range);
double ssim(const ImageView& a, const ImageView& b, double data_range);

// Tensors [H, W, C] or [H, W] (any floating or integer dtype; converted to float32 on the CPU).
double psnr(const torch::Tensor& a, const torch::Tensor& b, double data_range);
double ssim(const torch::Tensor& a, const torch::Tensor& b, double data_range);

// The normalised 1-D Gaussian window used by ssim (size 11, sigma 1.5); the 2-D window is its outer product.
const std::vector<double>& ssim_window_1d();

} // namespace anchor::cache
