// The configurations of the cache modes made for diffusion transformers (SD 3 / 3.5's MMDiT): fbcache, teacache and
// taylorseer. Their keys are declared once in unet/cache/dit_cache_config.cpp (the key tables that drive the parser,
// `--cache help` and docs/caching.md); their state is DitCacheController (unet/cache/dit_cache.h); their decision
// rules are cache/dit_cache_rules.h. `freq` on the transformer reads FreqParams (unet/cache/freq_params.h).
#pragma once

#include <string>
#include <vector>

namespace anchor::unet {

// First-Block Cache (ParaAttention's FBCache, kept in cache-dit as DBCache with one front block): every step runs the
// first block; when the relative L1 change of its residual against the last computed step's stays below thr, the
// remaining blocks are skipped and their residual of that step added instead.
struct FbCacheParams {
    double thr = 0.08; // cache-dit's default residual_diff_threshold
    int max_reuse = -1; // at most this many reuse steps in a row; -1: no bound ("none")
    int warmup = 0;     // the first `warmup` steps always computed (cache-dit's max_warmup_steps; 0: only step 0)
};

// TeaCache (Liu et al. 2024, "Timestep Embedding Tells: It's Time to Cache for Video Diffusion Model"): the relative
// L1 change of the first block's timestep-modulated input between consecutive steps, rescaled by a polynomial fitted
// against the change of the model output, is accumulated; while the sum stays below thr every block is skipped and
// the residual of all blocks of the last computed step added.
struct TeaCacheParams {
    double thr = 0.4; // TeaCache's FLUX settings: 0.25 / 0.4 / 0.6 / 0.8
    // Rescale polynomial, highest degree first (numpy.poly1d's order). Default: TeaCache's coefficients for FLUX.1
    // (an MMDiT with flow matching, the same modulated-input signal); SD 3 has no published set.
    std::vector<double> coefficients = {498.651651, -283.781631, 55.8554382, -3.82021401, 0.264230861};
};

// TaylorSeer (Liu et al. 2025, "From Reusing to Forecasting: Accelerating Diffusion Models with TaylorSeers"): the
// blocks run every `interval` steps (after `warmup` computed ones); in between the residual of all blocks is forecast
// by a Taylor expansion along the step index whose derivatives are finite differences of the computed steps.
struct TaylorSeerParams {
    int interval = 3; // a computed step every N steps (1: every step)
    int order = 2;    // 1: linear, 2: with the second-order term (the paper's setting)
    int warmup = 2;   // the first `warmup` steps always computed (they give the first differences)
};

} // namespace anchor::unet
