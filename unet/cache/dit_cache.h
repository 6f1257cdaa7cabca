// The cache modes on a diffusion transformer (SD 3 / 3.5's MMDiT, unet/model/mmdit.h): what a step of the denoising
// loop computes of the transformer, per mode. Every mode runs the patch embedding, the conditioning and the output
// head (norm_out, proj_out) at every step; they differ in which joint blocks run and what stands in for the others:
//
//   off         every block.
//   freq        the first block always (its image-token output on the patch grid is the probe); the remaining
//               blocks when the probe's low-band DCT energy change accumulated since the last full step reaches thr
//               (cache::DctChangePolicy, with max, span, drift and the last-step rule as on the UNet); else their
//               residual R = h_L - h_1 of the last two full steps is forecast along the timestep, the DCT
//               coefficients of R whose energy moved by less than tau kept as they are and the others extrapolated
//               (FreqAnchorDenoiser's reuse_feature arithmetic on R seen as a [B, dim, h, w] map). With skip=N, up
//               to N steps after a probed one run no block at all while the probe's change carried on at its last
//               rate stays below thr (cache::dit_skip_steps): their output is forecast linearly along the timestep
//               from the last two outputs the transformer computed (a flow-matching velocity changes slowly along
//               the trajectory). On the transformer freq's defaults are dit_freq_defaults() (the keys the user does
//               not name; resolve_dit_cache_config).
//   fbcache     the first block always; the remaining blocks' residual of the last computed step added while the
//               first block's residual moves by less than thr (cache::FirstBlockRule).
//   teacache    only the first block's modulation (LayerNorm(h) * (1 + scale) + shift) while the accumulated rescaled
//               change of that input stays below thr; then the residual of all blocks of the last computed step is
//               added (cache::TeaCacheRule).
//   taylorseer  every block every `interval` steps; in between the residual of all blocks is a Taylor series along
//               the step index with finite-difference derivatives (cache::TaylorSeerRule).
//
// With thr 0 (fbcache, teacache), max=0,lastsigma=0 (freq) or interval=1 (taylorseer) every step computes every
// block and the output is the uncached one bit for bit (the stages compose to the same operations as forward()). The
// state is per run (begin()); a batch decides together (classifier-free guidance's two rows of an image with it).
#pragma once

#include "cache/anchor_policy.h"
#include "cache/dit_cache_rules.h"
#include "unet/cache/cache_config.h"
#include "unet/cache/cache_controller.h"
#include "unet/model/mmdit.h"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

namespace anchor::unet {

class DitCacheController {
public:
    // ParamError(field) for a mode that does not apply to the transformer (check_dit_cache_config).
    explicit DitCacheController(const CacheConfig& c, const std::string& field = "cache");
    // A new loop of `num_steps` steps with noise levels `sigmas` (one per step, may be empty) and `images` images
    // (the rows of a guided batch are 2 x images); the loop's steps are numbered from `first_step` (an img2img loop
    // starts later in the schedule), the cache's own from 0.
    void begin(int num_steps, std::vector<double> sigmas = {}, int images = 1, int first_step = 0);
    // The transformer's output at loop step `step` (timestep t = sigma * 1000) for the batch, as the mode computes it.
    torch::Tensor forward(SD3Transformer2DModelImpl& tr, const torch::Tensor& x, const torch::Tensor& context,
                          const torch::Tensor& pooled, double t, int step);

    // TeaCache's calibration samples (mode off only): per step after the first, the relative L1 change of the first
    // block's modulated input and of the model output against the previous step (cache::fit_polynomial fits the
    // rescale polynomial to them).
    bool record_teacache = false;
    const std::vector<std::pair<double, double>>& teacache_samples() const { return samples_; }

    const CacheConfig& config() const { return cfg_; }
    const std::vector<CacheStepLog>& log() const { return log_; }
    int full_steps() const;
    // As cache_log_json: mode, resolved, kind, params, full_steps, total_steps, transformer_ms, steps.
    nlohmann::json log_json() const;

    // The relative L1 change mean|a - ref| / mean|ref| (fbcache's and teacache's signal), float64.
    static double relative_l1(const torch::Tensor& a, const torch::Tensor& ref);
    // TaylorSeer's finite differences: the new factors after a computed step with value f at distance `distance`
    // steps from the previous one: d_0 = f, d_{i+1} = (d_i - old_i) / distance while old_i exists, up to `order`.
    static std::vector<torch::Tensor> taylor_update(const torch::Tensor& f, const std::vector<torch::Tensor>& old,
                                                    double distance, int order);
    // sum_i d_i h^i / i!
    static torch::Tensor taylor_forecast(const std::vector<torch::Tensor>& d, double h);
    // freq's skip step: o1 + (o1 - o0) (u - u1) / (u1 - u0), the line through (u0, o0) and (u1, o1) at u.
    static torch::Tensor linear_output_forecast(const torch::Tensor& o1, const torch::Tensor& o0, double u1, double u0,
                                                double u);

private:
    torch::Tensor forward_freq(SD3Transformer2DModelImpl& tr, SD3Tokens& tok, double t, int step, CacheStepLog& rec);
    torch::Tensor freq_reuse_output(SD3Transformer2DModelImpl& tr, SD3Tokens& tok, const torch::Tensor& h1, double u,
                                    CacheStepLog& rec);
    void freq_plan_skips(const torch::Tensor& e, double u, int step, const torch::Tensor& out, const CacheStepLog& rec);
    torch::Tensor forward_fbcache(SD3Transformer2DModelImpl& tr, SD3Tokens& tok, int step, CacheStepLog& rec);
    torch::Tensor forward_teacache(SD3Transformer2DModelImpl& tr, SD3Tokens& tok, int step, CacheStepLog& rec);
    torch::Tensor forward_taylorseer(SD3Transformer2DModelImpl& tr, SD3Tokens& tok, int step, CacheStepLog& rec);

    CacheConfig cfg_;
    int num_steps_ = 0, images_ = 1, first_step_ = 0;
    std::vector<double> sigmas_;
    std::vector<CacheStepLog> log_;
    std::unique_ptr<cache::DctChangePolicy> dct_;
    std::unique_ptr<cache::FirstBlockRule> fb_;
    std::unique_ptr<cache::TeaCacheRule> tea_;
    std::unique_ptr<cache::TaylorSeerRule> seer_;
    // freq: the probe's energies (previous step; last two full steps), the residual R of the last full step and the
    // spectra of the last three, their timesteps.
    torch::Tensor prev_e_, e1_, e0_, F1_, X1_, X0_, X00_;
    double u1_ = 0, u0_ = 0, u00_ = 0;
    // fbcache: the first block's residual of the last computed step; every mode: the cached residual.
    torch::Tensor ref_r1_, residual_;
    // teacache: the previous step's modulated input.
    torch::Tensor prev_mod_;
    // taylorseer: the factors and the step they were made at.
    std::vector<torch::Tensor> taylor_;
    int taylor_step_ = -1;
    // freq's skip steps: how many of the next steps run no block; the last two computed outputs and their timesteps;
    // the reuses since the last full step; the step of the last probe.
    int skip_left_ = 0, reuse_run_ = 0, probe_step_ = -1;
    torch::Tensor out1_, out0_;
    double out_u1_ = 0, out_u0_ = 0;
    // record_teacache: the previous step's model output and the samples.
    torch::Tensor prev_out_;
    std::vector<std::pair<double, double>> samples_;
};

} // namespace anchor::unet
