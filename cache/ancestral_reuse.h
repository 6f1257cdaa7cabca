// What a reused step lets of an ancestral sampler's fresh noise into its denoised estimate.
//
// An ancestral step (Euler a: k-diffusion's sample_euler_ancestral; Karras et al. 2022, Algorithm 2 with S_churn's
// noise added after the step) moves the sample along the probability-flow ODE and then adds fresh noise sigma_up z.
// A cache that reuses a step k after the last computed step s must say how the denoised estimate D_k = D(x_k) answers
// the noise n injected since s (carried to step k), which no cached quantity has seen. Two extremes bracket it:
//   hold: D_k = D_s (the noise stays in x - D, the model output eps = (x - D) / sigma carries it; the next step
//         removes part of it again), what `noiseskip` did;
//   pass: D_k = D_s + n (the noise is taken for image content; eps unchanged).
// For data with power spectrum P the denoiser at noise level sigma is the Wiener filter P / (P + sigma^2) (the MMSE
// estimator of a Gaussian signal in white Gaussian noise), and its Jacobian passes white noise with the same gain per
// frequency: noise is kept where the image has more energy than the noise level and removed where it has less. The
// empirical Wiener filter takes P per DCT coefficient from the last computed estimate itself, X_s(u, v)^2 of
// X_s = dct2(D_s) (the orthonormal DCT of cache/dct.h, per image, channel and coefficient), so
//   D_k = D_s + idct2(G_k . dct2(n)),   G_k(u, v) = X_s(u, v)^2 / (X_s(u, v)^2 + sigma_k^2),
// which holds the noise early in the run (sigma large against every coefficient) and passes it late (sigma small),
// coefficient by coefficient in between.
#pragma once

#include <torch/torch.h>

namespace anchor::cache {

// G = X^2 / (X^2 + sigma^2) per coefficient of X = dct2(denoised) over the last two dims; float32, denoised's shape.
// sigma <= 0: ones (nothing left to remove). Throws UsageError for a non-finite sigma.
torch::Tensor wiener_noise_gain(const torch::Tensor& denoised, double sigma);

// The part of `noise` (the same units as `denoised`, shape broadcastable to it) that a denoiser at noise level sigma
// with the estimate `denoised` passes into its estimate: idct2(wiener_noise_gain(denoised, sigma) * dct2(noise)).
// Float32.
torch::Tensor noise_into_denoised(const torch::Tensor& noise, const torch::Tensor& denoised, double sigma);

} // namespace anchor::cache
