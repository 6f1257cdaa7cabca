// Orthonormal 2-D DCT of feature maps, band energies and spectral change rates (the signals of the DCT anchor policy).
//
// DCT-II (orthonormal): X(k) = a_k sum_{i<N} x(i) cos(pi (2i + 1) k / (2N)), a_0 = sqrt(1/N), a_k = sqrt(2/N).
// As a matrix C[k][i] = a_k cos(pi (2i + 1) k / 2N), C is orthogonal, so the 2-D transform of x [.., H, W] is
// X = C_H x C_W^T and its inverse (DCT-III) x = C_H^T X C_W; Parseval: sum x^2 = sum X^2.
// Basis matrices are built once per (N, dtype, device) and cached (thread-safe).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <vector>

namespace anchor::cache {

// The orthonormal DCT-II matrix C [n, n] (row k = frequency k); cached.
torch::Tensor dct_basis(int64_t n, torch::ScalarType dtype = torch::kFloat32, torch::Device device = torch::kCPU);
size_t dct_basis_cache_entries();

torch::Tensor dct2(const torch::Tensor& x);  // DCT-II over the last two dims of [.., H, W] (floating point)
torch::Tensor idct2(const torch::Tensor& X); // DCT-III (the inverse)

// The 2-D transform as one matrix on row-major flattened maps: K = C_H (x) C_W [H W, H W], K[(u, v), (i, j)] =
// C_H[u][i] C_W[v][j]; band >= 0 keeps only the rows with u + v < band (row-major (u, v) order), band < 0 all. Cached.
// dct2/idct2 use it for maps of up to 16x16 pixels (one GEMM instead of a per-map batched product).
torch::Tensor dct2_kron_basis(int64_t h, int64_t w, int64_t band, torch::ScalarType dtype = torch::kFloat32,
                              torch::Device device = torch::kCPU);
// Row-major flat indices u * W + v of the coefficients with u + v < band (all for band < 0): the rows of the banded
// basis above, and the entries of a full [.., H W] spectrum that dct2_low_band returns.
std::vector<int64_t> low_band_indices(int64_t h, int64_t w, int64_t band);
// The low-band DCT-II coefficients (u + v < band) of x [.., H, W] -> [.., L] in row-major (u, v) order: what a
// low-band energy probe needs, without computing the other H W - L coefficients.
torch::Tensor dct2_low_band(const torch::Tensor& x, int64_t band);

// Per-coefficient energy E(u, v) = X(u, v)^2 of the 2-D DCT.
torch::Tensor spectral_energy(const torch::Tensor& x);

struct BandEnergy {
    torch::Tensor low;   // sum of E(u, v) with u + v < cutoff, shape [..]
    torch::Tensor high;  // the rest
    torch::Tensor total; // low + high
};
// Band split of an energy map [.., H, W]; cutoff >= 0 (0: everything is high).
BandEnergy band_energies(const torch::Tensor& energy, int64_t cutoff);

// Guards the change rates below against zero energy; fused loops that restate the formula use it too.
constexpr double kEnergyRateEps = 1e-8;

// Per-coefficient change rate |E1 - E0| / (E0 + eps), elementwise on [.., H, W].
torch::Tensor energy_change_rate(const torch::Tensor& e1, const torch::Tensor& e0, double eps = kEnergyRateEps);

// Scalar summary used by DctChangePolicy: sum |E1 - E0| / (sum E0 + eps) over all coefficients (an E0-weighted mean
// of the per-coefficient rates, insensitive to the overall feature scale).
double relative_spectral_change(const torch::Tensor& e1, const torch::Tensor& e0, double eps = kEnergyRateEps);

} // namespace anchor::cache
