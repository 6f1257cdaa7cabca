#include "unet/model/unet_graph.h"

#include "cache/io/error.h"

namespace anchor::unet {

using torch::Tensor;

namespace {
std::string describe(const char* name, const Tensor& t) {
    if (!t.defined()) return std::string(name) + "=none;";
    std::string s = std::string(name) + "=" + c10::toString(t.scalar_type()) + "[";
    for (auto d : t.sizes()) s += std::to_string(d) + ",";
    return s + "]" + t.device().str() + ";";
}

// A buffer on `device` holding `t` (undefined stays undefined), allocated outside the graph's memory pool.
Tensor buffer_like(const Tensor& t, const torch::Device& device) {
    return t.defined() ? t.to(device, /*non_blocking=*/false, /*copy=*/true).contiguous() : Tensor();
}

void fill(Tensor& buf, const Tensor& t) {
    if (buf.defined()) buf.copy_(t, /*non_blocking=*/true);
}
} // namespace

UNetStepGraph::UNetStepGraph(UNet2DConditionModelImpl& unet) : unet_(&unet) {}

bool UNetStepGraph::applies(const UNet2DConditionModelImpl& unet, const Tensor& sample, const UNetCond& cond) {
    return kernels::CudaGraph::available() && sample.is_cuda() && unet.conv_in->weight.is_cuda() &&
           cond.residuals.empty() && !cond.control;
}

std::string UNetStepGraph::signature(const Tensor& sample, const Tensor& timestep, const UNetCond& cond) {
    return describe("sample", sample) + describe("t", timestep) + describe("ctx", cond.context) +
           describe("text", cond.text_embeds) + describe("ids", cond.time_ids) + describe("w", cond.timestep_cond);
}

void UNetStepGraph::capture(const Tensor& sample, const Tensor& timestep, const UNetCond& cond) {
    const auto device = unet_->conv_in->weight.device();
    // The timestep moves to the device too: a host tensor read inside the capture would be read once, at capture.
    sample_ = buffer_like(sample, device);
    timestep_ = buffer_like(timestep, device);
    cond_ = UNetCond(buffer_like(cond.context, device), buffer_like(cond.text_embeds, device),
                     buffer_like(cond.time_ids, device));
    cond_.timestep_cond = buffer_like(cond.timestep_cond, device);
    graph_ = std::make_unique<kernels::CudaGraph>();
    // The warm-up runs compute this call's result eagerly; the captured run only records, so replay() follows.
    out_ = graph_->capture([this] { return std::vector<Tensor>{unet_->forward(sample_, timestep_, cond_)}; }, device)
               .at(0);
    ++captures_;
}

Tensor UNetStepGraph::forward(const Tensor& sample, const Tensor& timestep, const UNetCond& cond) {
    if (!applies(*unet_, sample, cond))
        throw Error("UNet CUDA graph: needs the UNet and its input on a CUDA device in a build with CUDA graphs "
                    "(LibTorch >= 2 with CUDA) and no skip residuals (ControlNet), got the input on " +
                    sample.device().str());
    const std::string sig = signature(sample, timestep, cond);
    if (!graph_ || sig != signature_) {
        capture(sample, timestep, cond);
        signature_ = sig;
    }
    fill(sample_, sample);
    fill(timestep_, timestep);
    fill(cond_.context, cond.context);
    fill(cond_.text_embeds, cond.text_embeds);
    fill(cond_.time_ids, cond.time_ids);
    fill(cond_.timestep_cond, cond.timestep_cond);
    graph_->replay();
    ++replays_;
    return out_.clone(); // the next replay overwrites out_
}

} // namespace anchor::unet
