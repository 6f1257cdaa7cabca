// `anchor-sd bench-vae`: the time and memory of one VAE decode at a size, plain or tiled (unet/model/vae_tiling.h),
// on random weights with the shapes of the VAE of SD 1.x / 2.x / SDXL (one architecture: 128/256/512/512 channels; the
// SDXL config differs only in scaling_factor and force_upcast, which change neither). Run it once per configuration,
// each in its own process, so that each peak RSS is its own (tests/bench/results/vae_tiling_*.txt). With a TAESD the
// peak RSS covers both decoders.
#pragma once

#include "kernels/attention.h"
#include "unet/model/vae_tiling.h"

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace anchor::unet {

struct VaeBenchParams {
    int width = 1024, height = 1024; // image pixels (latents / 8)
    int repeat = 3;                  // timed decodes (min / median / max reported)
    int warmup = 0;                  // untimed decodes first
    VaeTiling tiling;                // off: the plain decode
    int64_t seed = 0;
    // Unset: what anchor-sd gives a published SDXL checkpoint (default_attention_kernel of the SDXL UNet's shapes and
    // default_gemm_backend of that).
    std::optional<kernels::AttentionKernel> attention;
    std::optional<kernels::GemmBackend> gemm;
    // Also decode the same latent with a TAESD (unet/model/taesd.h) after each VAE decode, interleaved: the published
    // shapes (64 channels, decoder blocks 3/3/3/1) with random weights, or the file `taesd_file` when given; on the
    // VAE's fast paths and GEMM backend, as attach_taesd puts it. The report adds its times and the VAE / TAESD ratio.
    bool taesd = false;
    std::string taesd_file;
    bool taesd_only = false; // the TAESD decodes alone (profiling it); no VAE decode, no ratio
    void validate() const; // ParamError naming the field
};

// Builds the VAE, then decodes; `emit` gets the report lines: the settings, each run's seconds, min / median / max,
// the resident size before the first decode (weights and runtime), the peak during the decodes (VmHWM reset after
// the build) and their difference, the decode's working memory.
void run_vae_bench(const VaeBenchParams& p, const std::function<void(const std::string&)>& emit);

// Writes a TAESD of random weights with the published shapes (TaesdConfig{}: both coders, diffusers' names, LibTorch's
// default initialisation seeded by `seed`) to the .safetensors `path` in `dtype`, atomically, refusing an existing
// file unless `overwrite`: the decoder of speed benchmarks when no published file is at hand (TAESD and TAESDXL have
// the same shapes; `anchor-sd random-taesd`). Returns the tensor bytes.
int64_t write_random_taesd(const std::string& path, int64_t seed, torch::ScalarType dtype, bool overwrite);

} // namespace anchor::unet
