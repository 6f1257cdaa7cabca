// The full UNet call as a CUDA graph (`anchor-sd --cuda-graphs`, Txt2ImgParams::cuda_graphs). A CFG step of SD 1.5
// at 512² is ~1500 kernels; in f16 on a large GPU many of them run shorter than their launch, so the host's launch
// cost bounds the step rate. Capturing the step once (kernels/cuda_graph.h) and replaying it launches them with one
// call. The graph reads its inputs from fixed buffers, so a call copies the step's latents, timestep and
// conditioning into them, replays, and returns a copy of the output buffer. A call with other shapes, dtypes or
// conditioning parts than the captured one captures again (one graph is kept: a pipeline's steps all share one).
// Only the plain forward is captured: the caches' calls observe features and take other paths per step, and a
// ControlNet's residuals come from another model with its own per-step schedule, so those run eagerly.
#pragma once

#include "kernels/cuda_graph.h"
#include "unet/model/unet_model.h"

#include <memory>
#include <string>
#include <vector>

namespace anchor::unet {

class UNetStepGraph {
public:
    explicit UNetStepGraph(UNet2DConditionModelImpl& unet);
    // Whether a call can be captured: a CUDA sample and UNet in a build with CUDA graphs, and no skip residuals
    // (a ControlNet's change per step and run their own model: those calls stay eager).
    static bool applies(const UNet2DConditionModelImpl& unet, const torch::Tensor& sample, const UNetCond& cond);
    // Same result as unet.forward(sample, timestep, cond) (the same kernels, replayed).
    torch::Tensor forward(const torch::Tensor& sample, const torch::Tensor& timestep, const UNetCond& cond);
    const UNet2DConditionModelImpl* model() const { return unet_; }
    int captures() const { return captures_; }
    int replays() const { return replays_; }

private:
    // What a captured graph is specific to: every input's shape and dtype, which parts are present.
    static std::string signature(const torch::Tensor& sample, const torch::Tensor& timestep, const UNetCond& cond);
    void capture(const torch::Tensor& sample, const torch::Tensor& timestep, const UNetCond& cond);

    UNet2DConditionModelImpl* unet_;
    std::unique_ptr<kernels::CudaGraph> graph_;
    std::string signature_;
    torch::Tensor sample_, timestep_, out_;
    UNetCond cond_;
    int captures_ = 0, replays_ = 0;
};

} // namespace anchor::unet
