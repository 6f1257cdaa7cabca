#include "cache/dct.h"

#include "cache/io/error.h"

#include <cmath>
#include <map>
#include <mutex>
#include <tuple>

namespace anchor::cache {

namespace {

struct BasisKey {
    int64_t n;
    torch::ScalarType dtype;
    torch::DeviceType dev;
    int16_t index;
    bool operator<(const BasisKey& o) const {
        return std::tie(n, dtype, dev, index) < std::tie(o.n, o.dtype, o.dev, o.index);
    }
};

std::mutex g_mu;
std::map<BasisKey, torch::Tensor> g_basis;

void check_map(const torch::Tensor& x, const char* who) {
    if (!x.defined() || x.dim() < 2)
        throw Error(std::string(who) + ": expected a tensor [.., H, W], got " +
                    (x.defined() ? shape_str(x.sizes().vec()) : std::string("undefined")));
    if (!x.is_floating_point()) throw Error(std::string(who) + ": expected a floating-point tensor");
}

} // namespace

torch::Tensor dct_basis(int64_t n, torch::ScalarType dtype, torch::Device device) {
    if (n < 1) throw Error("dct_basis: size must be >= 1, got " + std::to_string(n));
    const BasisKey key{n, dtype, device.type(), static_cast<int16_t>(device.has_index() ? device.index() : -1)};
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_basis.find(key);
    if (it != g_basis.end()) return it->second;
    // Built in float64 on the CPU, then converted: C[k][i] = a_k cos(pi (2i + 1) k / 2n).
    auto c = torch::empty({n, n}, torch::kFloat64);
    auto acc = c.accessor<double, 2>();
    for (int64_t k = 0; k < n; ++k) {
        const double a = k == 0 ? std::sqrt(1.0 / double(n)) : std::sqrt(2.0 / double(n));
        for (int64_t i = 0; i < n; ++i) acc[k][i] = a * std::cos(M_PI * double(2 * i + 1) * double(k) / double(2 * n));
    }
    auto t = c.to(torch::TensorOptions().dtype(dtype).device(device));
    g_basis.emplace(key, t);
    return t;
}

size_t dct_basis_cache_entries() {
    std::lock_guard<std::mutex> lock(g_mu);
    return g_basis.size();
}

torch::Tensor dct2(const torch::Tensor& x) {
    check_map(x, "dct2");
    const auto ch = dct_basis(x.size(-2), x.scalar_type(), x.device());
    const auto cw = dct_basis(x.size(-1), x.scalar_type(), x.device());
    return torch::matmul(torch::matmul(ch, x), cw.t()); // C_H x C_W^T
}

torch::Tensor idct2(const torch::Tensor& X) {
    check_map(X, "idct2");
    const auto ch = dct_basis(X.size(-2), X.scalar_type(), X.device());
    const auto cw = dct_basis(X.size(-1), X.scalar_type(), X.device());
    return torch::matmul(torch::matmul(ch.t(), X), cw); // C_H^T X C_W
}

torch::Tensor spectral_energy(const torch::Tensor& x) {
    return dct2(x).square();
}

BandEnergy band_energies(const torch::Tensor& energy, int64_t cutoff) {
    check_map(energy, "band_energies");
    if (cutoff < 0) throw Error("band_energies: cutoff must be >= 0, got " + std::to_string(cutoff));
    const int64_t h = energy.size(-2), w = energy.size(-1);
    auto opts = torch::TensorOptions().dtype(torch::kInt64).device(energy.device());
    auto uv = torch::arange(h, opts).unsqueeze(1) + torch::arange(w, opts).unsqueeze(0); // u + v
    auto mask = (uv < cutoff).to(energy.scalar_type());
    BandEnergy b;
    b.total = energy.sum({-2, -1});
    b.low = (energy * mask).sum({-2, -1});
    b.high = b.total - b.low;
    return b;
}

torch::Tensor energy_change_rate(const torch::Tensor& e1, const torch::Tensor& e0, double eps) {
    if (e1.sizes() != e0.sizes())
        throw Error("energy_change_rate: shapes differ: " + shape_str(e1.sizes().vec()) + " vs " +
                    shape_str(e0.sizes().vec()));
    return (e1 - e0).abs() / (e0 + eps);
}

double relative_spectral_change(const torch::Tensor& e1, const torch::Tensor& e0, double eps) {
    if (e1.sizes() != e0.sizes())
        throw Error("relative_spectral_change: shapes differ: " + shape_str(e1.sizes().vec()) + " vs " +
                    shape_str(e0.sizes().vec()));
    const double num = (e1.to(torch::kFloat64) - e0.to(torch::kFloat64)).abs().sum().item<double>();
    const double den = e0.to(torch::kFloat64).sum().item<double>();
    return num / (den + eps);
}

} // namespace anchor::cache
