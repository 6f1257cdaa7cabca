// Analytic multiply-accumulate (MAC) counts of a UNet2DConditionModel forward, from the config and latent size only.
//
// Definition (the one DeepCache (Ma et al. 2023, Table 1/3) and most diffusion-acceleration papers use): MACs of all
// Conv2d and Linear layers, weights only, for ONE sample:
//   conv   = C_out * C_in * k * k * H_out * W_out      (conv_in, resnet convs and 1x1 shortcuts, down/upsampler convs,
//                                                       1x1 proj_in/proj_out of SD 1.x transformers, conv_out)
//   linear = in * out * tokens                         (q/k/v/out projections, GEGLU, FF out, SD 2.x proj_in/out,
//                                                       time_embedding.linear_1/2 and every resnet's time_emb_proj)
// Attention's own matmuls (q k^T and p v) are not layers and are NOT in total(); they are reported separately.
//
// SD 1.5 at 512x512 (64x64 latents, 77 context tokens): conv 221.973 G + linear 116.610 G (of which 0.028 G are
// the time-embedding MLP and time_emb_proj) = 338.611 G, i.e. "338.6 GMACs". DeepCache's table says 338.83 G; the
// 0.22 G difference is reproduced to 0.002 G by the extra terms a thop-style profiler counts on diffusers' modules:
// one add per conv bias output (0.061 G) and 2 ops per GroupNorm (0.090 G) and LayerNorm (0.069 G) element
// (338.611 + 0.061 + 0.090 + 0.069 = 338.831). This is our reconstruction, not a statement from the paper.
#pragma once

#include "unet/model/unet_model.h"

#include <cstdint>
#include <vector>

namespace anchor::unet {

struct MacCount {
    int64_t conv = 0;      // Conv2d layers
    int64_t linear = 0;    // Linear layers (including the time-embedding MLP and time_emb_proj)
    int64_t attention = 0; // q k^T + p v matmuls of self- and cross-attention (not in total())
    int64_t total() const { return conv + linear; }
    MacCount& operator+=(const MacCount& o) {
        conv += o.conv, linear += o.linear, attention += o.attention;
        return *this;
    }
    MacCount& operator-=(const MacCount& o) {
        conv -= o.conv, linear -= o.linear, attention -= o.attention;
        return *this;
    }
};

// Per-layer breakdown in forward order, keyed like UNet2DConditionModelImpl::run's skip bookkeeping, so that the
// DeepCache shallow path of any branch can be summed from it.
struct UNetMacBreakdown {
    MacCount stem;              // conv_in + time embedding MLP
    std::vector<MacCount> down; // down[k] produces skip k (k >= 1; down[0] is empty: skip 0 is conv_in)
    MacCount mid;               // mid block
    std::vector<MacCount> up;   // up[k]: the up layer consuming skip k, plus the upsampler that follows it
    MacCount head;              // conv_norm_out (no MACs) + conv_out
    // The transformers' share of down[k] and up[k] (zero for layers without attention).
    std::vector<MacCount> down_attention, up_attention;
    MacCount full() const; // a whole forward
    // DeepCache cached step for `branch` (see forward_shallow); attention = false: without its attention layers (a
    // step that reuses their residuals, AttentionHook).
    MacCount shallow(int branch, bool attention = true) const;
    int num_skips() const { return int(down.size()); }
};

// latent_h/latent_w: the UNet input size (pixels / 8 for SD's VAE); context_tokens: text length (77).
UNetMacBreakdown unet_mac_breakdown(const UNetConfig& cfg, int64_t latent_h, int64_t latent_w,
                                    int64_t context_tokens = 77);
inline MacCount unet_macs(const UNetConfig& cfg, int64_t latent_h, int64_t latent_w, int64_t context_tokens = 77) {
    return unet_mac_breakdown(cfg, latent_h, latent_w, context_tokens).full();
}

// Mean MACs per step of a DeepCache uniform schedule over `steps` steps: step i is full when i % interval == 0,
// otherwise a cached step of `branch` (DeepCacheSDHelper semantics, tests/golden/sd/deepcache/README.md).
// steps <= 0: the long-run average (full + (interval - 1) * shallow) / interval.
double deepcache_macs_per_step(const UNetMacBreakdown& b, int interval, int branch = 0, int steps = 0);

// "338.6" style: value / 1e9 with one decimal.
std::string format_gmacs(double macs, int decimals = 1);

} // namespace anchor::unet
