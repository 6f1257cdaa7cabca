#include "kernels/cuda_graph.h"

#include "cache/io/error.h"

#include <torch/version.h>

#if defined(ANCHOR_WITH_CUDA) && TORCH_VERSION_MAJOR >= 2
#define ANCHOR_HAVE_CUDA_GRAPH 1
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#else
#define ANCHOR_HAVE_CUDA_GRAPH 0
#endif

namespace anchor::kernels {

#if ANCHOR_HAVE_CUDA_GRAPH
struct CudaGraph::Impl {
    std::unique_ptr<at::cuda::CUDAGraph> graph; // made at capture: constructing one initialises CUDA
    bool captured = false;
};
#else
struct CudaGraph::Impl {
    bool captured = false;
};
#endif

CudaGraph::CudaGraph() : impl_(std::make_unique<Impl>()) {}
CudaGraph::~CudaGraph() = default;

bool CudaGraph::available() {
    return ANCHOR_HAVE_CUDA_GRAPH;
}

bool CudaGraph::captured() const {
    return impl_->captured;
}

std::vector<torch::Tensor> CudaGraph::capture(const std::function<std::vector<torch::Tensor>()>& body,
                                              const torch::Device& device, int warmup) {
#if ANCHOR_HAVE_CUDA_GRAPH
    if (!device.is_cuda()) throw Error("CUDA graph: needs a CUDA device, got " + device.str());
    if (impl_->captured) throw Error("CUDA graph: already captured");
    const c10::cuda::CUDAGuard device_guard(device);
    // Capture is not allowed on the legacy default stream; the side stream first waits for what the caller queued.
    auto side = c10::cuda::getStreamFromPool(false, device.index());
    c10::cuda::getCurrentCUDAStream(device.index()).synchronize();
    std::vector<torch::Tensor> out;
    {
        const c10::cuda::CUDAStreamGuard stream_guard(side);
        for (int i = 0; i < warmup; ++i) body();
        side.synchronize();
        impl_->graph = std::make_unique<at::cuda::CUDAGraph>();
        impl_->graph->capture_begin();
        out = body();
        impl_->graph->capture_end();
    }
    side.synchronize();
    impl_->captured = true;
    return out;
#else
    (void)body, (void)device, (void)warmup;
    throw Error("CUDA graphs need LibTorch >= 2 with CUDA (the torch2 build, `cli/setup.sh --torch pip`)");
#endif
}

void CudaGraph::replay() {
#if ANCHOR_HAVE_CUDA_GRAPH
    if (!impl_->captured) throw Error("CUDA graph: replay before capture");
    impl_->graph->replay();
#else
    throw Error("CUDA graphs need LibTorch >= 2 with CUDA");
#endif
}

} // namespace anchor::kernels
