// The configuration of the freq cache mode (its state is FreqAnchorDenoiser, unet/cache/freq_cache.h). Every key, its
// range and its help are declared once in freq_keys() (unet/cache/cache_config.cpp); the defaults below are the ones
// docs/caching.md tabulates, with the measurements that chose them (tests/bench/results/eval_cache_*).
#pragma once

#include "cache/anchor_profile.h"

#include <string>

namespace anchor::unet {

struct FreqParams {
    double tau = 0.01; // anchoring threshold on the per-coefficient energy change rate rho (freq_cache.h, rule 2)
    // Full-step threshold on the accumulated low-band change A_k (rule 1). r_k scales ~1/steps, so longer runs reuse
    // more at one threshold.
    double thr = 0.7;
    int max_reuse = -1; // at most this many consecutive reuses; -1: no count bound ("max=none")
    // The reuse run bound in the schedule's own units (DctChangePolicy::set_span_bound): a fraction of the loop's
    // log-sigma range; 0 = none. Unlike a count it means the same stretch of the schedule at 10 or 50 steps.
    double span = 0.35;
    int band = 4; // low band u + v < band of the probe spectrum
    bool extrapolate = true;
    // Forecast order of the non-anchored coefficients along the timestep axis: 1 = linear through the last two full
    // steps; 2 = TaylorSeer's second-order term (Liu et al., ICCV 2025, eq. 6) with the real spacing of the last
    // three full steps (see FreqAnchorDenoiser::extrapolation_curvature).
    int order = 1;
    // Per-image safety bound (0 = off): the probe's low-band energies are forecast from the last two full steps like
    // the feature; when some image's relative residual |e_k - e^_k|_1 / |e_k|_1 exceeds `drift`, its trajectory has
    // left the forecast and the step is full ("drift"). It decides most full steps at every step count.
    double drift = 0.35;
    int branch = 0; // DeepCache branch of the cached feature
    // probe=det|raw: how a sampler that injects noise (Euler a, DDIM with eta > 0) is handled. raw: as any other;
    // the probe reads every step's fresh noise as change. det: the decisions (change, drift) look at the model input
    // less the injected noise carried forward (Scheduler::injected_noise), the deterministic part of the trajectory;
    // and a reuse step runs the shallow path on the input less the noise injected since the last full step D (the
    // input the cached feature's trajectory would have reached without it) and adds that noise's own effect on the
    // output, InjectedNoise::gain * D: with the denoised estimate held fixed, fresh white noise in the input moves
    // the predicted noise by itself. The same for deterministic samplers (nothing is injected).
    bool probe_det = false;
    // correct=1: forecast then calibrate (FoCa, Zheng et al., AAAI 2026: a forecast corrected by what the cheap
    // path observes). The probe's stem, computed at every step anyway, is forecast like the feature from the last two
    // full steps; the share of that forecast it actually moved (forecast_calibration) scales the feature's forecast
    // step per image: F = F1 + alpha (F^_k - F1). Nothing to calibrate with extrapolate=0.
    bool correct = true;
    // skip=N (0 = off): up to N reuse steps in a row between computed steps run no UNet layer at all: the model output
    // is forecast along the timestep from the last two computed outputs (first order with the real spacing; TeaCache
    // and FORA reuse the whole output unchanged), the probe still deciding. A step into which the sampler injected
    // noise (Euler a, DDIM eta > 0) is always computed, and so is every step of a sampler that combines more than one
    // earlier model output (LMS, PLMS): a forecast enters that history, and order-4 weights (Adams-Bashforth's 55/24,
    // -59/24, 37/24, -9/24) amplify its error.
    int skip = 1;
    // skipdrift=D: a reuse step is forecast only while the probe's drift (the per-image residual of the `drift` rule)
    // is below D; between D and `drift` the shallow path runs on the step's real input instead, so an image that
    // starts to leave its trajectory is corrected by a computed step before its forecasts compound. 0 = no bound.
    double skip_drift = 0.35;
    // noise=V (0 = off): with a sampler that injects noise (Euler a, DDIM with eta > 0), a full step once the noise
    // injected since the last full step, carried to this step (D of probe=det), reaches V times the noise of the
    // step's input: RMS(D) / (sigma_k / sqrt(1 + sigma_k^2)) >= V (model-input units, Euler-type and DDIM-type
    // alike). Fresh noise is what no cached feature has seen and no forecast can follow, so it bounds the reuse run
    // in the sampler's own units, whatever the step count. Under injected noise the drift rule is not applied: the
    // probe's energies carry each step's fresh noise, which their forecast from the full steps cannot follow, so
    // drift there measures the noise this rule already bounds.
    double noise = 0.7;
    // noiseskip=W (0 = off; counts against skip=N's run): under injected noise a reuse step whose noise since the
    // last full step (the ratio of noise=V) is below W runs no UNet layer. Its output is the one that gives, at this
    // step's input, the denoised estimate x0 of the last computed step: x0 is what an ancestral step carries from
    // one evaluation to the next, the fresh noise entering only the input, so the output follows that noise exactly
    // (eps = (x sqrt(1 + sigma^2) - x0) / sigma) where an output forecast (skip=N) or the shallow path could not.
    double noise_skip = 0.5;
    // last=1: the last step is always full when its noise level is at least last_sigma (lastsigma=S; 0: always), else
    // always a reuse (no rule makes it full); last=0: it follows the rules whatever its noise level. The last step
    // runs into sigma = 0, where an error e of the model output moves the image by sigma_last e (Euler's x - sigma
    // eps; DDIM's final step damps it further), so where the schedule ends low a reuse there costs little and where
    // it ends high (DPM++ 2M's default schedule) it does not.
    bool last = true;
    double last_sigma = 0.1;
    // decide=image|batch: who decides the full steps of a batch of several images. batch: one decision for all, from
    // the image that changes (or drifts) most, so no image is reused past its own bounds and a batch is at least as
    // close to the uncached images as each image alone (one UNet call per step). image: each image on its own
    // signals with its own state, so an image comes out the same alone or in any batch (the UNet then runs once on
    // the rows of the images that chose a full step and once on the others').
    bool per_image = false;
    // attn=reuse|run: a reuse step that runs the shallow path also skips the path's attention layers, adding the
    // residual (output - input) each had when it last ran instead (the transformer is residual; caching its residual
    // is FORA's and Delta-DiT's reuse, Selvaraju et al. 2024, Chen et al. 2024, applied inside DeepCache's shallow
    // path). The resnets and the output head still run on the step's own input, so the step follows its input where
    // it is local (the shallow path's high-resolution detail) for about half the shallow path's cost. Not under
    // injected noise (Euler a): the residual answers the input its layer saw, not the fresh noise since.
    bool attn_reuse = true;
    // attnmax=N (-1: "none"): at most N shallow steps in a row add the cached residuals; the next shallow step runs
    // the layers and records theirs. Each reused residual adds its own error to the step's output, so the bound is
    // on the steps that reuse it, not on a span of the schedule.
    int attn_max = 1;
    // forecast=denoised|output: what an output forecast (skip=N) and a held step under injected noise (noiseskip=W)
    // carry along the timestep. output: the model output itself, linearly from the last two computed outputs (and
    // under injected noise the last denoised estimate held). denoised: the denoised estimate x0 of the last two
    // computed outputs, forecast linearly, turned back into the output that gives it at this step's input
    // (output_for). Late in the loop x0 settles while eps = (x - x0) / sigma carries the input's own noise, so the
    // forecast follows the input exactly and errs only by the change of x0; and an ancestral sampler's fresh noise
    // enters the input only (Karras et al. 2022, Algorithm 2: x0 is what the step carries), so its steps are forecast
    // on the quantity the noise does not move, not held.
    bool forecast_denoised = false;
    // noisepass=wiener|hold: under injected noise, what a reuse step lets of the noise injected since the step whose
    // denoised estimate it rests on into that estimate (cache::noise_into_denoised, cache/ancestral_reuse.h). hold:
    // nothing, x0 is held and the noise stays in the output (noiseskip=W, and probe=det's shallow path). wiener: each
    // DCT coefficient's Wiener share X^2 / (X^2 + sigma^2) of the last computed estimate X: the denoiser keeps the
    // noise where the image has more energy than the noise level and removes it elsewhere, so the step follows how
    // the uncached model answers the fresh noise instead of removing all of it.
    bool noise_wiener = false;
    // shallowin=det|raw (with probe=det): the input of a shallow reuse step under injected noise. det: the input less
    // the noise since the last full step, its effect added back analytically (probe_det above). raw: the step's own
    // input, so the shallow layers answer the fresh noise themselves; the decisions still look at the input less the
    // injected noise, which the fresh noise does not move.
    bool shallow_det = true;
    // noisedrift=1 (with probe=det): the drift rule applies under injected noise too, on the energies of the input
    // less the injected noise (the deterministic trajectory, which a forecast from the full steps can follow).
    bool noise_drift = false;
    // noiserule=passed|all: what the noise rule (noise=V) measures. all: the whole noise injected since the last full
    // step. passed: only its part the denoiser keeps (noisepass's Wiener share of the last computed estimate), the
    // part no reuse can know; early in the run, where the noise level exceeds the image's energy in every
    // coefficient, the denoiser removes the fresh noise again and reusing costs little, late it keeps it.
    bool noise_passed_rule = false;
    // lastfc=1: a reused last step (last=1 below last_sigma) runs no UNet layer: its denoised estimate is extrapolated
    // linearly in ln sigma from the estimates of the two steps before it, computed or not (the history a multistep
    // sampler keeps). ln sigma is DPM-Solver's time variable (lambda = -ln sigma), along which its data prediction is
    // smooth (Lu et al. 2022b); a sampler whose last step goes to sigma = 0 returns that estimate as the image
    // (DPM++ 2M's first-order final step), so the step is the history's forecast of it.
    bool last_forecast = false;
    // target=T (0: none): a quality target in dB of PSNR against the uncached image, for about 95 % of images. thr,
    // drift and skipdrift (as given or defaulted) are scaled by cache::target_threshold_scale with the calibration of
    // the sampler's family (freq_target_calibration, unet/cache/freq_calibration.h), so a user picks a figure instead
    // of thresholds. The canonical string keeps the thresholds as given and the target; the record shows the scale.
    double target = 0;
    // guard=B (0: off): the per-image safety net (cache::DivergenceGuard, cache/divergence_guard.h). The drift
    // residuals of an image's reuse steps are summed over the run as an estimate of the error its reuses left; once a
    // reuse would take that sum past B, the step and every later one the rules would reuse are full ("guard"). Not
    // scaled by target=T. Under injected noise no drift is measured, so the guard has nothing to sum.
    double guard = 0;
    // profile=FILE (anchor-sd calibrate): an anchor profile (cache/anchor_profile.h) whose step ranges set the
    // threshold per range of the loop, replacing thr where they apply. Read when the mode is parsed (at the edge).
    std::string profile;
    cache::AnchorProfile profile_data;
    // The canonical string of every resolved key ("freq:tau=0.01,thr=0.7,...", the key table's order).
    std::string describe() const;
};

} // namespace anchor::unet
