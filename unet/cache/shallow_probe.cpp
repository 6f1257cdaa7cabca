// The shallow probe of the SD cache modes (see shallow_probe.h).
#include "unet/cache/shallow_probe.h"

#include "cache/dct.h"
#include "cache/io/error.h"
#include "kernels/dispatch.h"
#include "unet/cache/feature_store.h"
#include "unet/model/unet_model.h"

namespace anchor::unet {

using torch::Tensor;

namespace {
thread_local int64_t g_host_reads = 0;
} // namespace

std::vector<double> host_read(const std::vector<Tensor>& values) {
    ++g_host_reads;
    std::vector<double> out;
    out.reserve(values.size());
    torch::Device dev = torch::kCPU;
    for (const auto& v : values)
        if (!v.device().is_cpu()) dev = v.device();
    if (dev.is_cpu()) {
        for (const auto& v : values) out.push_back(v.item<double>());
        return out;
    }
    std::vector<Tensor> on_dev;
    for (const auto& v : values) on_dev.push_back(v.to(dev, torch::kFloat64).reshape({}));
    const auto host = torch::stack(on_dev).to(torch::kCPU); // the one wait for the stream
    const double* p = host.data_ptr<double>();
    out.assign(p, p + host.numel());
    return out;
}

int64_t host_reads() {
    return g_host_reads;
}

double ShallowProbe::update(UNet2DConditionModelImpl& unet, const Tensor& x, const Tensor& injected) {
    return host_read({update_value(unet, x, injected)})[0];
}

Tensor ShallowProbe::update_value(UNet2DConditionModelImpl& unet, const Tensor& x, const Tensor& injected) {
    torch::NoGradGuard ng;
    stem_ = unet.stem(x); // the UNet reuses it as its conv_in output this step (forward's `stem`)
    if (injected.defined() && injected.sizes() != x.sizes())
        throw Error("freq probe: the injected noise has shape " + shape_str(injected.sizes().vec()) +
                    ", the model input " + shape_str(x.sizes().vec()));
    observed_ = injected.defined() ? unet.stem(x - injected) : stem_;
    auto s = observed_.to(torch::kFloat);
    // Only the L low-band coefficients (u + v < band) enter r_k. On the CPU one [maps, HW] x [HW, L] product
    // (cache::dct2_low_band); on a GPU the batched cuFFT energy kernel (kernels/cuda/dct_energy.cu), band picked after.
    Tensor e;
    if (s.is_cuda() && kernels::cuda_kernels_built()) {
        const int64_t h = s.size(-2), w = s.size(-1);
        const auto idx = cache::low_band_indices(h, w, band_);
        e = kernels::dct_energy(s).flatten(-2).index_select(-1, torch::tensor(idx, torch::kInt64).to(s.device()));
    } else {
        e = cache::dct2_low_band(s, band_).square();
    }
    Tensor r = prev_.defined() && prev_.sizes() == e.sizes()
                   ? image_change(e, prev_, images_)
                   : torch::zeros({}, torch::dtype(torch::kFloat64).device(e.device()));
    prev_ = e;
    return r;
}

Tensor ShallowProbe::image_change(const Tensor& e, const Tensor& ref, int images) {
    if (e.device().is_cpu()) return torch::scalar_tensor(largest_image_change(e, ref, images), torch::kFloat64);
    // cache::relative_spectral_change's sums (float64), per image over its rows b, n + b, ..., then the largest.
    const int64_t rows = e.size(0), n = images > 1 && rows % images == 0 ? images : 1;
    const auto a = e.to(torch::kFloat64).reshape({rows / n, n, -1}), b = ref.to(torch::kFloat64).reshape({rows / n, n, -1});
    const auto num = (a - b).abs().sum(std::vector<int64_t>{0, 2}), den = b.sum(std::vector<int64_t>{0, 2});
    return (num / (den + cache::kEnergyRateEps)).max();
}

double ShallowProbe::largest_image_change(const Tensor& e, const Tensor& ref, int images) {
    const int64_t rows = e.size(0), n = images;
    if (n <= 1 || rows % n != 0) return cache::relative_spectral_change(e, ref);
    double r = 0.0;
    for (int64_t b = 0; b < n; ++b) { // image b owns rows b, n + b, 2n + b, ...
        const auto idx = batch_image_rows(b, rows, n, e.device());
        r = std::max(r, cache::relative_spectral_change(e.index_select(0, idx), ref.index_select(0, idx)));
    }
    return r;
}

} // namespace anchor::unet
