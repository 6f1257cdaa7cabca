#include "cache/metrics.h"

#include "cache/io/error.h"

#include <cmath>
#include <limits>
#include <vector>

namespace anchor::cache {

namespace {

constexpr int kWin = 11;
constexpr double kSigma = 1.5, kK1 = 0.01, kK2 = 0.03;

void check_pair(const ImageView& a, const ImageView& b, double data_range, const char* who) {
    if (!a.data || !b.data) throw Error(std::string(who) + ": null image");
    if (a.height != b.height || a.width != b.width || a.channels != b.channels)
        throw Error(std::string(who) + ": image shapes differ: " + shape_str({a.height, a.width, a.channels}) + " vs " +
                    shape_str({b.height, b.width, b.channels}));
    if (a.height < 1 || a.width < 1 || a.channels < 1)
        throw Error(std::string(who) + ": empty image " + shape_str({a.height, a.width, a.channels}));
    if (!(data_range > 0)) throw Error(std::string(who) + ": data range must be > 0");
}

// Separable 'valid' filtering of one channel plane (double) with the 1-D window: [h, w] -> [h - 10, w - 10].
std::vector<double> filter_valid(const std::vector<double>& img, int64_t h, int64_t w) {
    const auto& g = ssim_window_1d();
    const int64_t oh = h - kWin + 1, ow = w - kWin + 1;
    std::vector<double> rows(static_cast<size_t>(h * ow));
    for (int64_t y = 0; y < h; ++y)
        for (int64_t x = 0; x < ow; ++x) {
            double s = 0;
            for (int k = 0; k < kWin; ++k) s += g[k] * img[y * w + x + k];
            rows[y * ow + x] = s;
        }
    std::vector<double> out(static_cast<size_t>(oh * ow));
    for (int64_t y = 0; y < oh; ++y)
        for (int64_t x = 0; x < ow; ++x) {
            double s = 0;
            for (int k = 0; k < kWin; ++k) s += g[k] * rows[(y + k) * ow + x];
            out[y * ow + x] = s;
        }
    return out;
}

ImageView view_of(const torch::Tensor& t, torch::Tensor& holder, const char* who) {
    if (!t.defined() || (t.dim() != 2 && t.dim() != 3))
        throw Error(std::string(who) + ": expected an image [H, W, C] or [H, W], got " +
                    (t.defined() ? shape_str(t.sizes().vec()) : std::string("undefined")));
    holder = t.detach().to(torch::kCPU).to(torch::kFloat32).contiguous();
    return {holder.data_ptr<float>(), holder.size(0), holder.size(1), holder.dim() == 3 ? holder.size(2) : 1};
}

} // namespace

const std::vector<double>& ssim_window_1d() {
    static const std::vector<double> g = [] {
        std::vector<double> v(kWin);
        double sum = 0;
        for (int i = 0; i < kWin; ++i) {
            const double d = i - (kWin - 1) / 2;
            v[i] = std::exp(-d * d / (2 * kSigma * kSigma));
            sum += v[i];
        }
        for (double& x : v) x /= sum;
        return v;
    }();
    return g;
}

double psnr(const ImageView& a, const ImageView& b, double data_range) {
    check_pair(a, b, data_range, "psnr");
    const int64_t n = a.height * a.width * a.channels;
    double se = 0;
    for (int64_t i = 0; i < n; ++i) {
        const double d = double(a.data[i]) - double(b.data[i]);
        se += d * d;
    }
    const double mse = se / double(n);
    if (mse == 0) return std::numeric_limits<double>::infinity();
    return 10.0 * std::log10(data_range * data_range / mse);
}

double ssim(const ImageView& a, const ImageView& b, double data_range) {
    check_pair(a, b, data_range, "ssim");
    const int64_t h = a.height, w = a.width, c = a.channels;
    if (h < kWin || w < kWin)
        throw Error("ssim: images must be at least 11x11 (Gaussian window), got " + shape_str({h, w, c}));
    const double c1 = (kK1 * data_range) * (kK1 * data_range), c2 = (kK2 * data_range) * (kK2 * data_range);
    double total = 0;
    std::vector<double> x(h * w), y(h * w), xx(h * w), yy(h * w), xy(h * w);
    for (int64_t ch = 0; ch < c; ++ch) {
        for (int64_t i = 0; i < h * w; ++i) {
            x[i] = a.data[i * c + ch];
            y[i] = b.data[i * c + ch];
            xx[i] = x[i] * x[i];
            yy[i] = y[i] * y[i];
            xy[i] = x[i] * y[i];
        }
        const auto mx = filter_valid(x, h, w), my = filter_valid(y, h, w);
        const auto sxx = filter_valid(xx, h, w), syy = filter_valid(yy, h, w), sxy = filter_valid(xy, h, w);
        double sum = 0;
        for (size_t i = 0; i < mx.size(); ++i) {
            const double vx = sxx[i] - mx[i] * mx[i], vy = syy[i] - my[i] * my[i], cxy = sxy[i] - mx[i] * my[i];
            sum +=
                ((2 * mx[i] * my[i] + c1) * (2 * cxy + c2)) / ((mx[i] * mx[i] + my[i] * my[i] + c1) * (vx + vy + c2));
        }
        total += sum / double(mx.size());
    }
    return total / double(c);
}

double psnr(const torch::Tensor& a, const torch::Tensor& b, double data_range) {
    torch::Tensor ha, hb;
    return psnr(view_of(a, ha, "psnr"), view_of(b, hb, "psnr"), data_range);
}

double ssim(const torch::Tensor& a, const torch::Tensor& b, double data_range) {
    torch::Tensor ha, hb;
    return ssim(view_of(a, ha, "ssim"), view_of(b, hb, "ssim"), data_range);
}

} // namespace anchor::cache
