// `anchor-sd bench-cache -m <SD 3 / 3.5 model>`: the transformer's cache modes (off, freq, fbcache, teacache,
// taylorseer; unet/cache/dit_cache.h) against the first in one run, through the library's SD 3 pipeline
// (sd3_txt2img) over prompts x seeds with interleaved repeats, reported in cache_bench.h's CacheBenchReport: per mode
// the full steps, the denoising loop's and the whole image's wall seconds (text encoders, the loop, the VAE decode;
// min / median / max) with the speed-ups of the medians, and PSNR / SSIM of the images against the first mode. The
// transformer has no MAC model here: its MAC columns are left empty.
#pragma once

#include "unet/bench/cache_bench.h"
#include "unet/pipeline/sd3_pipeline.h"

#include <functional>
#include <string>
#include <vector>

namespace anchor::unet {

struct Sd3CacheBenchParams {
    std::vector<CacheConfig> modes;   // the first is the reference; each a mode of the transformer
    SD3Txt2ImgParams base;            // steps, guidance, size, seed of the first run, shift, ...
    std::vector<std::string> prompts; // one run per prompt and seed
    int seeds = 1;                    // base.seed, base.seed + 1, ...
    int repeat = 1;                   // interleaved runs of every mode per (prompt, seed)
    void validate() const;            // ParamError naming the field
};

// `log` hears one line per run. An untimed one-step run comes first (weights paged in, kernels chosen).
CacheBenchReport run_sd3_cache_bench(SD3Models& m, const Sd3CacheBenchParams& p,
                                     const std::function<void(const std::string&)>& log = {});

} // namespace anchor::unet
