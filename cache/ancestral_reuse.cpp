#include "cache/ancestral_reuse.h"

#include "cache/dct.h"
#include "cache/io/error.h"

#include <cmath>
#include <sstream>

namespace anchor::cache {

torch::Tensor wiener_noise_gain(const torch::Tensor& denoised, double sigma) {
    if (!std::isfinite(sigma)) {
        std::ostringstream os;
        os << "wiener noise gain: sigma must be finite, got " << sigma;
        throw UsageError(os.str());
    }
    const auto d = denoised.to(torch::kFloat);
    if (sigma <= 0) return torch::ones_like(d);
    const auto power = dct2(d).square();
    return power / (power + sigma * sigma);
}

torch::Tensor noise_into_denoised(const torch::Tensor& noise, const torch::Tensor& denoised, double sigma) {
    const auto gain = wiener_noise_gain(denoised, sigma);
    return idct2(gain * dct2(noise.to(torch::kFloat)));
}

} // namespace anchor::cache
