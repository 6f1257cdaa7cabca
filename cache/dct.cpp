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
std::map<std::tuple<int64_t, int64_t, int64_t, torch::ScalarType, torch::DeviceType, int>, torch::Tensor> g_kron;

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

std::vector<int64_t> low_band_indices(int64_t h, int64_t w, int64_t band) {
    std::vector<int64_t> rows;
    for (int64_t u = 0; u < h; ++u)
        for (int64_t v = 0; v < w; ++v)
            if (band < 0 || u + v < band) rows.push_back(u * w + v);
    return rows;
}

torch::Tensor dct2_kron_basis(int64_t h, int64_t w, int64_t band, torch::ScalarType dtype, torch::Device device) {
    if (h < 1 || w < 1) throw Error("dct2_kron_basis: sizes must be >= 1");
    const auto key = std::make_tuple(h, w, band, dtype, device.type(), int(device.has_index() ? device.index() : -1));
    {
        std::lock_guard<std::mutex> lock(g_mu);
        auto it = g_kron.find(key);
        if (it != g_kron.end()) return it->second;
    }
    const auto rows = low_band_indices(h, w, band);
    if (int64_t(rows.size()) * h * w > (int64_t(1) << 24))
        throw Error("dct2_kron_basis: " + std::to_string(rows.size()) + " x " + std::to_string(h * w) +
                    " basis is too large (use dct2 or a smaller band)");
    // K[(u, v), (i, j)] = C_H[u][i] C_W[v][j], built in float64 one row (one basis image) at a time.
    const auto ch = dct_basis(h, torch::kFloat64), cw = dct_basis(w, torch::kFloat64);
    auto k = torch::empty({int64_t(rows.size()), h * w}, torch::kFloat64);
    for (size_t r = 0; r < rows.size(); ++r)
        k[int64_t(r)].copy_(torch::outer(ch[rows[r] / w], cw[rows[r] % w]).reshape({-1}));
    auto t = k.to(torch::TensorOptions().dtype(dtype).device(device));
    std::lock_guard<std::mutex> lock(g_mu);
    g_kron.emplace(key, t);
    return t;
}

namespace {
// Maps of at most this many pixels take the one-GEMM Kronecker path: vec(C_H x C_W^T) = (C_H (x) C_W) vec(x) for
// row-major vec. One [maps, HW] x [HW, HW] product instead of C_H x C_W^T, whose left factor broadcasts to a batched
// matmul that LibTorch 1.13 runs one map at a time (640 dispatches for a [20, 32, 8, 8] feature). 256 pixels (16x16)
// keep the basis at 256 KiB in float32; larger maps have enough work per map for the two-matmul form.
constexpr int64_t kKronMaxPixels = 256;
} // namespace

torch::Tensor dct2(const torch::Tensor& x) {
    check_map(x, "dct2");
    const int64_t h = x.size(-2), w = x.size(-1);
    if (h * w <= kKronMaxPixels) {
        const auto k = dct2_kron_basis(h, w, -1, x.scalar_type(), x.device());
        return torch::matmul(x.reshape({-1, h * w}), k.t()).view(x.sizes());
    }
    const auto ch = dct_basis(h, x.scalar_type(), x.device());
    const auto cw = dct_basis(w, x.scalar_type(), x.device());
    return torch::matmul(torch::matmul(ch, x), cw.t()); // C_H x C_W^T
}

torch::Tensor idct2(const torch::Tensor& X) {
    check_map(X, "idct2");
    const int64_t h = X.size(-2), w = X.size(-1);
    if (h * w <= kKronMaxPixels) { // K orthogonal: vec(x) = K^T vec(X), i.e. rows times K
        const auto k = dct2_kron_basis(h, w, -1, X.scalar_type(), X.device());
        return torch::matmul(X.reshape({-1, h * w}), k).view(X.sizes());
    }
    const auto ch = dct_basis(h, X.scalar_type(), X.device());
    const auto cw = dct_basis(w, X.scalar_type(), X.device());
    return torch::matmul(torch::matmul(ch.t(), X), cw); // C_H^T X C_W
}

torch::Tensor dct2_low_band(const torch::Tensor& x, int64_t band) {
    check_map(x, "dct2_low_band");
    if (band < 1) throw Error("dct2_low_band: band must be >= 1, got " + std::to_string(band));
    const int64_t h = x.size(-2), w = x.size(-1);
    const auto k = dct2_kron_basis(h, w, band, x.scalar_type(), x.device());
    auto sizes = x.sizes().vec();
    sizes.pop_back();
    sizes.back() = k.size(0);
    return torch::matmul(x.reshape({-1, h * w}), k.t()).view(sizes);
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
    if (e1.device().is_cpu() && e1.scalar_type() == torch::kFloat && e0.scalar_type() == torch::kFloat &&
        e1.is_contiguous() && e0.is_contiguous()) {
        // One pass in double over the float32 maps (the probe calls this every step; six tensor ops cost more).
        const float* a = e1.data_ptr<float>();
        const float* b = e0.data_ptr<float>();
        double num = 0, den = 0;
        for (int64_t i = 0, n = e1.numel(); i < n; ++i)
            num += std::abs(double(a[i]) - double(b[i])), den += double(b[i]);
        return num / (den + eps);
    }
    const double num = (e1.to(torch::kFloat64) - e0.to(torch::kFloat64)).abs().sum().item<double>();
    const double den = e0.to(torch::kFloat64).sum().item<double>();
    return num / (den + eps);
}

} // namespace anchor::cache
