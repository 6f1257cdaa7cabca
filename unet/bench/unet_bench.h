// `anchor-sd bench` as a library call: times classifier-free-guidance UNet steps of a UNet with random weights (SD 1.5
// shapes unless a config says otherwise; no download) and relates them to the analytic MAC count (unet/model/unet_macs.h)
// and to the GEMM rate this machine reaches in the same process, so the number says how close the UNet step is to
// what the BLAS can do.
#pragma once

#include "kernels/attention.h"
#include "kernels/onednn.h"
#include "unet/model/vae.h"

#include "unet/model/sd_family.h"
#include "unet/model/unet_model.h"
#include <optional>

#include <functional>
#include <string>
#include <vector>

namespace anchor::unet {

struct UNetBenchParams {
    UNetConfig unet; // the shapes (random weights)
    std::string unet_name = "SD 1.5 UNet";
    int width = 256, height = 256; // image size; latents are width / vae_factor
    int vae_factor = 8;
    int repeat = 3, warmup = 1, batch = 2; // batch 2 = one classifier-free-guidance step
    bool baseline = false;                 // time the plain module forwards (the reference) instead of the fast paths
    bool ab = false;                       // also time plain and fast forwards interleaved
    std::optional<kernels::AttentionKernel> attention; // unset: default_attention_kernel of the config
    std::optional<kernels::GemmBackend> gemm;          // unset: default_gemm_backend of the attention
    std::vector<int> deepcache{2, 3, 5, 10};           // DeepCache intervals whose MACs and cached-step times are shown
    int branch = 0;
    bool time_shallow = true;
    int gemm_n = 2048, gemm_repeat = 5;
    // How the Linear/Conv weights are kept (LoadOptions::weights_dtype): f16/bf16 halve them, upcast per layer.
    torch::ScalarType weights_dtype = torch::kFloat;
    bool fused_qkv = false; // LoadOptions::fused_qkv: the self-attention projections as one GEMM
    int vae_repeat = 0; // > 0: also time this many decodes of one latent by SD's VAE (random weights) at the size
    // With vae_repeat: also time TAESD's decoder (the published shape, random weights) on the same latent, its decodes
    // interleaved with the VAE's.
    bool taesd = false;
    int64_t seed = 0;
    std::string profile, profile_shallow; // chrome traces of one more full / shallow step ("" = none)
    // `repeat` more full steps with every fast-kernel call timed (kernels/op_timing.h): a table of one step's calls
    // (their mean) grouped by shape, each with its time, share of the step and FLOP rate against the GEMM rate.
    // 0 = none; N = the N slowest shapes, then totals per kind.
    int op_table = 0;
    void validate() const;                // ParamError naming the field
};

// The UNet shapes of a model family with random weights: SD 1.5 (UNetConfig's defaults) or SDXL base 1.0
// (block_out_channels 320/640/1280, transformer depth 1/2/10 on the two attention levels, heads of 64 channels,
// cross_attention_dim 2048, linear projections, text_time conditioning with 256-wide time ids and a 2816-wide
// add_embedding input: 2.57 G parameters).
UNetConfig unet_config_of_family(SdFamily family);

// The traces beside --profile's (trace.json): one shallow step (suffix "_shallow") and, with --vae, one VAE decode
// ("_vae"): <stem><suffix><ext>; only the file name's extension counts, not a dot in a folder name.
std::string sibling_profile_path(const std::string& profile, const std::string& suffix);

// The analytic MAC count per sample of a full UNet forward at the params' size.
double unet_bench_macs(const UNetBenchParams& p);

// Runs the benchmark; every line of the report goes to `emit` as it is known (the program prints and keeps them).
void run_unet_bench(const UNetBenchParams& p, const std::function<void(const std::string&)>& emit);

// fp32 GEMM rate on the threads in effect: GFLOP/s of the fastest of `repeat` n^3 products, on LibTorch's BLAS
// (torch::mm) or oneDNN's matmul.
double gemm_gflops(int64_t n, int repeat, kernels::GemmBackend backend = kernels::GemmBackend::Torch);

} // namespace anchor::unet
