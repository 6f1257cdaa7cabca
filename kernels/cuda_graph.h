// CUDA graphs (`--cuda-graphs`): a fixed sequence of kernels on fixed buffers, captured once with at::cuda::CUDAGraph
// and launched again with one call, without the host's per-kernel launch cost (a GPT-2-small decode step is ~150
// small kernels, launch-bound at batch 1). Everything a replay reads or writes lives at the addresses of the capture:
// the caller writes its inputs into buffers before replay() and reads the tensors the captured body returned.
// Compiled where LibTorch >= 2 has CUDA and the project's CUDA kernels are linked (ANCHOR_WITH_CUDA); elsewhere
// available() is false and capture() throws.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <vector>

namespace anchor::kernels {

class CudaGraph {
public:
    CudaGraph();
    ~CudaGraph();
    CudaGraph(const CudaGraph&) = delete;
    CudaGraph& operator=(const CudaGraph&) = delete;

    static bool available();
    // Runs `body` `warmup` times on a side stream of `device` (cuBLAS handles and workspaces, the caching allocator
    // settle; each run must be harmless to repeat, as the captured one will be), then captures one more run, which
    // does not execute. Returns that run's tensors: they hold the results after every replay().
    std::vector<torch::Tensor> capture(const std::function<std::vector<torch::Tensor>()>& body,
                                       const torch::Device& device, int warmup = 2);
    // Launches the captured kernels on the current stream (after whatever the caller queued there).
    void replay();
    bool captured() const;

private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

} // namespace anchor::kernels
