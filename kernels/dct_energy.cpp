#include "kernels/dct_energy.h"

#include "cache/dct.h"
#include "cache/io/error.h"

namespace anchor::kernels {

torch::Tensor dct_energy_cpu(const torch::Tensor& x) {
    if (!x.defined() || x.dim() < 2 || !x.is_floating_point())
        throw Error("dct_energy: expected a floating-point tensor [.., H, W], got " +
                    (x.defined() ? shape_str(x.sizes().vec()) : std::string("undefined")));
    // float64 for the reference so it is more accurate than any float32 implementation it checks.
    return cache::spectral_energy(x.to(torch::kCPU).to(torch::kFloat64)).to(torch::kFloat32);
}

} // namespace anchor::kernels
