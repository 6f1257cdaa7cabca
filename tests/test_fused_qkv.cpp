// Fused QKV (LoadOptions::fused_qkv, --fused-qkv): the self-attention projections as one GEMM give the three
// projections' results on random inputs of several shapes, and follow the weights when they change after fusing.
#include "tests/test_util.h"
#include "tests/tiny_sd_run.h"
#include "unet/model/unet_model.h"

#include <catch2/catch.hpp>

#include <torch/torch.h>

using namespace anchor;
using namespace anchor::unet;

TEST_CASE("fused QKV: the UNet's output as with three projections, and after an in-place weight change", "[sd]") {
    auto m = test::deepcache_models();
    auto& unet = *m.unet;
    const auto& c = unet.config();
    int64_t seed = 300;
    for (const auto& shape : std::vector<std::array<int64_t, 4>>{{1, 8, 8, 77}, {2, 8, 16, 77}, {3, 16, 8, 5}}) {
        INFO("batch " << shape[0] << " latents " << shape[1] << "x" << shape[2] << " context " << shape[3]);
        torch::manual_seed(++seed);
        const auto x = torch::randn({shape[0], c.in_channels, shape[1], shape[2]});
        const auto ctx = torch::randn({shape[0], shape[3], c.cross_attention_dim});
        const auto t = torch::rand({shape[0]}) * 999;
        unet.set_fused_qkv(false);
        const auto plain = unet.forward(x, t, UNetCond(ctx));
        unet.set_fused_qkv(true);
        const auto fused = unet.forward(x, t, UNetCond(ctx));
        // One GEMM over the concatenated weights: each output is the same dot product, float32 summation may differ.
        CHECK(test::rel_err(fused, plain) < 1e-5);
    }
    // A weight changed in place after the fusing (as a LoRA merge does) is seen by the next call.
    torch::manual_seed(1);
    const auto x = torch::randn({2, c.in_channels, 8, 8});
    const auto ctx = torch::randn({2, 77, c.cross_attention_dim});
    const auto t = torch::tensor(500.0f);
    unet.set_fused_qkv(true);
    const auto before = unet.forward(x, t, UNetCond(ctx));
    {
        torch::NoGradGuard ng;
        for (const auto& mod : unet.modules(false))
            if (auto* b = dynamic_cast<BasicTransformerBlockImpl*>(mod.get())) b->attn1->to_k->weight.mul_(1.5);
    }
    const auto fused = unet.forward(x, t, UNetCond(ctx));
    unet.set_fused_qkv(false);
    const auto plain = unet.forward(x, t, UNetCond(ctx));
    CHECK(test::rel_err(fused, before) > 1e-3); // the change is seen at all
    // The tiny model's 1x1 GroupNorm levels amplify last-bit differences (tests/golden/sd/anchorcache_cases/README.md).
    CHECK(test::rel_err(fused, plain) < 5e-5);
}
