// A per-image safety net for a reuse cache ("no image left behind"): notices during the run that one image's
// trajectory keeps leaving the forecast its reuse steps rest on, and spends full steps on that image from then on.
//
// Each reuse step of an image leaves an error that grows with how far the trajectory has left the forecast the cache
// serves it (a forecast of the cached features from the last full steps). The cheap probe, computed at every step,
// measures that departure on the probe itself: the relative residual d_k between the probe and its own forecast
// from the same full steps (the drift of unet/cache/freq_cache.h). A single large d_k is the per-step bound's
// business (drift); what the per-step bound lets through is an image whose residuals stay just under it step after
// step, each reuse adding its share to the image's error. The guard sums the residuals of the image's reuse steps over
// the whole run,
//   E_k = sum over the reuse steps j < k of d_j,
// an estimate of the error the reuses have left in it, and once a reuse at step k would take it past the image's
// budget B (E_k + d_k > B) the step is full, and so is every later step the rules would reuse: the image has spent
// what it may lose, so the rest of its run is computed. Typical images never reach the budget (they cost nothing);
// the ones that do are the outliers that set the worst-image PSNR.
#pragma once

namespace anchor::cache {

class DivergenceGuard {
public:
    // budget B > 0; 0 = off (never full). Throws UsageError for a negative or non-finite budget.
    explicit DivergenceGuard(double budget = 0.0);
    // A step the other rules would reuse, with its forecast residual d (NaN: none measured, e.g. under injected noise;
    // it neither adds nor trips). Returns true when the step must be full: the budget is spent (now or earlier).
    bool must_compute(double residual);
    // A new image / loop.
    void reset();
    double spent() const { return spent_; }
    bool tripped() const { return tripped_; }
    double budget() const { return budget_; }

private:
    double budget_;
    double spent_ = 0.0;
    bool tripped_ = false;
};

} // namespace anchor::cache
