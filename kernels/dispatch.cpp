#include "kernels/dispatch.h"

#include "cache/io/error.h"
#include "kernels/dct_energy.h"
#include "kernels/ring_write.h"

#ifdef ANCHOR_WITH_CUDA
#include "kernels/cuda/anchor_cuda.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace anchor::kernels {

bool cuda_kernels_built() {
#ifdef ANCHOR_WITH_CUDA
    return true;
#else
    return false;
#endif
}

torch::Tensor dct_energy(const torch::Tensor& x) {
#ifdef ANCHOR_WITH_CUDA
    if (x.defined() && x.is_cuda()) {
        if (x.dim() < 2 || !x.is_floating_point())
            throw Error("dct_energy: expected a floating-point tensor [.., H, W], got " + shape_str(x.sizes().vec()));
        const c10::cuda::CUDAGuard guard(x.device());
        auto xf = x.to(torch::kFloat32).contiguous();
        const int64_t h = x.size(-2), w = x.size(-1), maps = h * w == 0 ? 0 : xf.numel() / (h * w);
        auto out = torch::empty_like(xf);
        auto ws = torch::empty({static_cast<int64_t>(cuda::dct_energy_workspace_bytes(maps, h, w))},
                               xf.options().dtype(torch::kUInt8));
        const auto stream = c10::cuda::getCurrentCUDAStream(x.device().index());
        if (cuda::dct_energy(xf.data_ptr<float>(), out.data_ptr<float>(), maps, h, w, ws.data_ptr(), stream.stream()))
            throw Error(std::string("dct_energy (CUDA) on ") + shape_str(x.sizes().vec()) + ": " +
                        cuda::anchor_cuda_last_error());
        return out;
    }
#endif
    return dct_energy_cpu(x);
}

void ring_write(torch::Tensor& k_buf, torch::Tensor& v_buf, const torch::Tensor& k, const torch::Tensor& v,
                int64_t slot) {
#ifdef ANCHOR_WITH_CUDA
    if (k_buf.defined() && k_buf.is_cuda()) {
        check_ring_write(k_buf, v_buf, k, v, slot);
        const c10::cuda::CUDAGuard guard(k_buf.device());
        auto kc = k.contiguous(), vc = v.contiguous();
        const auto stream = c10::cuda::getCurrentCUDAStream(k_buf.device().index());
        if (cuda::ring_write(k_buf.data_ptr(), v_buf.data_ptr(), kc.data_ptr(), vc.data_ptr(), k_buf.size(0),
                             k_buf.size(1), k_buf.size(2), k_buf.size(3), slot, static_cast<int>(k_buf.element_size()),
                             stream.stream()))
            throw Error(std::string("ring_write (CUDA): ") + cuda::anchor_cuda_last_error());
        return;
    }
#endif
    ring_write_cpu(k_buf, v_buf, k, v, slot);
}

} // namespace anchor::kernels
