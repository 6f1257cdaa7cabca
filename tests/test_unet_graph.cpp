// The UNet step as a CUDA graph (unet/model/unet_graph.h, --cuda-graphs): refused clearly where it cannot run, and
// on a GPU the replayed step gives the eager step's result, for new inputs after capture and across a shape change.
#include "kernels/cuda_graph.h"
#include "tests/test_util.h"
#include "tests/tiny_sd_run.h"
#include "unet/model/unet_graph.h"
#include "unet/pipeline/pipeline.h"

#include <catch2/catch.hpp>

#include <torch/torch.h>
#include <torch/version.h>

using namespace anchor;
using namespace anchor::unet;

namespace {
struct StepInputs {
    torch::Tensor x, t;
    UNetCond cond;
};

StepInputs random_step(const UNet2DConditionModelImpl& unet, int64_t batch, int64_t h, int64_t w, double t,
                       const torch::Device& device, int64_t seed) {
    torch::manual_seed(seed);
    const auto& c = unet.config();
    StepInputs s;
    s.x = torch::randn({batch, c.in_channels, h, w}).to(device);
    s.t = torch::tensor(t, torch::kFloat);
    s.cond = UNetCond(torch::randn({batch, 77, c.cross_attention_dim}).to(device));
    return s;
}
} // namespace

TEST_CASE("UNet CUDA graph: refused off a CUDA device, naming the setting", "[sd][device]") {
    auto m = test::deepcache_models();
    const auto s = random_step(*m.unet, 2, 8, 8, 500.0, torch::kCPU, 1);
    CHECK_FALSE(UNetStepGraph::applies(*m.unet, s.x, s.cond));
    UNetStepGraph g(*m.unet);
    CHECK(test::error_of([&] { g.forward(s.x, s.t, s.cond); }).find("needs the UNet and its input on a CUDA device") !=
          std::string::npos);
    auto p = test::tiny_params(2, SamplerKind::DDIM);
    p.cuda_graphs = true;
    Txt2ImgPipeline pipe(m);
    const std::string e = test::error_of([&] { pipe.run(p); });
    CHECK(e.find("cuda_graphs") != std::string::npos);
    CHECK(e.find("needs a CUDA device") != std::string::npos);
}

TEST_CASE("UNet CUDA graph: replay gives the eager step, for new inputs and after a shape change", "[sd][cuda]") {
    if (!torch::cuda::is_available()) {
        WARN("skipped: CUDA device absent");
        return;
    }
    if (!kernels::CudaGraph::available()) {
        WARN("skipped: CUDA graphs need LibTorch >= 2 with CUDA (this is " TORCH_VERSION ")");
        return;
    }
    const torch::Device dev(torch::kCUDA, 0);
    auto m = test::deepcache_models();
    m.unet->to(dev);
    UNetStepGraph g(*m.unet);
    int64_t seed = 10;
    for (const auto& shape : std::vector<std::array<int64_t, 3>>{{2, 8, 8}, {2, 8, 8}, {4, 8, 16}}) {
        for (const double t : {999.0, 1.0}) {
            INFO("batch " << shape[0] << " latents " << shape[1] << "x" << shape[2] << " t " << t);
            const auto s = random_step(*m.unet, shape[0], shape[1], shape[2], t, dev, ++seed);
            const auto eager = m.unet->forward(s.x, s.t, s.cond);
            const auto replay = g.forward(s.x, s.t, s.cond);
            CHECK(test::rel_err(replay, eager) < 1e-5);
        }
    }
    CHECK(g.captures() == 2); // the second 2x8x8 step replays the first capture
    CHECK(g.replays() == 6);

    // The pipeline with --cuda-graphs: the same latents as without.
    auto p = test::tiny_params(4, SamplerKind::DDIM);
    p.device = dev;
    p.decode = false;
    Txt2ImgPipeline pipe(m);
    const auto eager = pipe.run(p).final_latents;
    p.cuda_graphs = true;
    const auto graphed = pipe.run(p).final_latents;
    CHECK(test::rel_err(graphed, eager) < 1e-5);
}
