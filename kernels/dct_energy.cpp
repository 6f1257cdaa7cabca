#include "kernels/dct_energy.h"

#include "cache/io/error.h"

#include <cmath>

namespace anchor::kernels {

namespace {
// The orthonormal DCT-II matrix C[k][i] = a_k cos(pi (2i + 1) k / (2n)), a_0 = sqrt(1/n), a_k = sqrt(2/n), built here
// in float64 from its definition (the kernels sit below the cache core, whose cache/dct.h caches its own), so the
// reference shares no code with what it checks.
torch::Tensor dct_matrix_f64(int64_t n) {
    const auto i = torch::arange(n, torch::kFloat64).unsqueeze(0);
    const auto k = torch::arange(n, torch::kFloat64).unsqueeze(1);
    auto c = torch::cos(M_PI * (2 * i + 1) * k / double(2 * n)) * std::sqrt(2.0 / double(n));
    c.select(0, 0).mul_(std::sqrt(0.5));
    return c;
}
} // namespace

torch::Tensor dct_energy_cpu(const torch::Tensor& x) {
    if (!x.defined() || x.dim() < 2 || !x.is_floating_point())
        throw Error("dct_energy: expected a floating-point tensor [.., H, W], got " +
                    (x.defined() ? shape_str(x.sizes().vec()) : std::string("undefined")));
    // float64 for the reference so it is more accurate than any float32 implementation it checks: X = C_H x C_W^T.
    const auto xd = x.to(torch::kCPU).to(torch::kFloat64);
    const auto X = torch::matmul(torch::matmul(dct_matrix_f64(x.size(-2)), xd), dct_matrix_f64(x.size(-1)).t());
    return X.square().to(torch::kFloat32);
}

} // namespace anchor::kernels
