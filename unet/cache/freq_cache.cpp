// The frequency-anchored deep-feature cache (see freq_cache.h for the rule and its equations).
#include "unet/cache/freq_cache.h"
#include "unet/cache/freq_calibration.h"

#include "cache/ancestral_reuse.h"
#include "cache/dct.h"
#include "cache/io/error.h"
#include "cache/modes/key_table.h"
#include "kernels/dispatch.h"
#include "unet/model/unet_macs.h"
#include "unet/model/unet_model.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <set>

namespace anchor::unet {

using torch::Tensor;

namespace {
std::string freq_fmt(double v) {
    return cache::modes::format_number(v);
}
} // namespace

namespace {
// target=T: the given thresholds scaled for the target (FreqParams::target).
FreqParams freq_target_applied(const FreqParams& p, double* scale) {
    FreqParams r = p;
    *scale = 1.0;
    if (p.target > 0) {
        *scale = cache::target_threshold_scale(p.target, freq_target_calibration());
        r.thr *= *scale, r.drift *= *scale, r.skip_drift *= *scale;
    }
    return r;
}
} // namespace

FreqAnchorDenoiser::FreqAnchorDenoiser(const FreqParams& p)
    : given_(p), p_(freq_target_applied(p, &target_scale_)), probe_(p.band) {
    freq_target_applied(p, &target_scale_); // the member's own initialiser ran after p_'s
    if (!(p.tau >= 0)) throw ParamError("cache", "freq: tau must be >= 0, got " + freq_fmt(p.tau));
    if (!(p.thr > 0)) throw ParamError("cache", "freq: thr must be > 0, got " + freq_fmt(p.thr));
    if (p.max_reuse < -1)
        throw ParamError("cache", "freq: max must be >= 0 or none, got " + std::to_string(p.max_reuse));
    if (!(p.span >= 0)) throw ParamError("cache", "freq: span must be >= 0, got " + freq_fmt(p.span));
    if (p.order != 1 && p.order != 2)
        throw ParamError("cache", "freq: order must be 1 or 2, got " + std::to_string(p.order));
    if (!(p.drift >= 0)) throw ParamError("cache", "freq: drift must be >= 0, got " + freq_fmt(p.drift));
    if (!(p.noise >= 0)) throw ParamError("cache", "freq: noise must be >= 0, got " + freq_fmt(p.noise));
    if (p.band < 1) throw ParamError("cache", "freq: band must be >= 1, got " + std::to_string(p.band));
    if (!(p.guard >= 0)) throw ParamError("cache", "freq: guard must be >= 0, got " + freq_fmt(p.guard));
    if (p.branch < 0) throw ParamError("cache", "freq: branch must be >= 0, got " + std::to_string(p.branch));
}

FreqAnchorDenoiser::Lane::Lane(const FreqParams& p, BatchFeatureStore store)
    : policy(p.thr, p.max_reuse < 0 ? std::numeric_limits<int>::max() : p.max_reuse), guard(p.guard),
      features(std::move(store)) {}

nlohmann::json FreqAnchorDenoiser::params_json() const {
    return cache::modes::keys_json(freq_keys(), given_);
}

void FreqAnchorDenoiser::begin(int num_steps, int images) {
    num_steps_ = num_steps;
    images_ = std::max(images, 1);
    probe_.reset(images);
    features_.begin(images);
    log_.clear();
    pending_.clear();
    injected_ = InjectedNoise();
    last_full_ = true;
    // The loop's noise levels when the pipeline gave them for this loop (a caller driving predict itself gives none:
    // then no span bound).
    const auto levels = sigmas_.size() == size_t(num_steps) ? sigmas_ : std::vector<double>{};
    lanes_.clear();
    // The last step runs into sigma = 0, where an output error e moves the image by sigma_last e: below last_sigma a
    // reuse there is nearly free (FreqParams::last).
    const bool low_end = !levels.empty() && levels.back() < p_.last_sigma;
    const auto last_step = !p_.last ? cache::LastStep::Rules : low_end ? cache::LastStep::Reuse : cache::LastStep::Full;
    const int lanes = p_.per_image ? images_ : 1;
    for (int b = 0; b < lanes; ++b) {
        Lane lane(p_, p_.per_image ? features_.image(b) : features_);
        lane.images = p_.per_image ? 1 : images_;
        lane.policy.set_last_step(last_step);
        if (p_.profile_data.has_step_ranges()) {
            auto thresholds = p_.profile_data.step_thresholds(num_steps, given_.thr);
            for (auto& v : thresholds) v *= target_scale_; // target=T scales a profile's thresholds too
            lane.policy.set_step_thresholds(std::move(thresholds));
        }
        lane.policy.set_span_bound(p_.span, levels);
        lanes_.push_back(std::move(lane));
    }
}

int FreqAnchorDenoiser::staleness() const {
    return p_.max_reuse >= 0 ? p_.max_reuse : std::max(num_steps_, 1);
}

Tensor FreqAnchorDenoiser::anchored_mask(const Tensor& X1, const Tensor& X0, double tau) {
    return cache::energy_change_rate(X1.square(), X0.square()) < tau;
}

namespace {
// where(anchored_mask(X1, X0, tau), 0, X1 - X0) and the anchored count in one pass over float32 CPU spectra, with the
// float32 operations of the tensor formula in the same order (rate = |X1^2 - X0^2| / (X0^2 + eps) < tau): a full
// step of freq ran ~15 tensor ops over the cached feature's spectrum for this, ~4 % of its time on fashion-sd.
Tensor unanchored_difference(const Tensor& X1, const Tensor& X0, double tau, int64_t* anchored) {
    auto a = X1.contiguous(), b = X0.contiguous();
    auto d = torch::empty_like(a);
    const float* p1 = a.data_ptr<float>();
    const float* p0 = b.data_ptr<float>();
    float* pd = d.data_ptr<float>();
    const float eps = float(cache::kEnergyRateEps), t = float(tau); // the tensor formula adds eps in float32
    int64_t n_anchored = 0;
    for (int64_t i = 0, n = a.numel(); i < n; ++i) {
        const float e1 = p1[i] * p1[i], e0 = p0[i] * p0[i];
        const bool anch = std::abs(e1 - e0) / (e0 + eps) < t;
        pd[i] = anch ? 0.f : p1[i] - p0[i];
        n_anchored += anch;
    }
    *anchored = n_anchored;
    return d;
}
} // namespace

Tensor FreqAnchorDenoiser::extrapolation_slope(const Tensor& X1, const Tensor& X0, double s1, double s0, double tau,
                                               double* anchored_fraction, Tensor* anchored_on_device) {
    if (anchored_fraction) *anchored_fraction = 1.0;
    if (!X0.defined() || s1 == s0) return Tensor();
    Tensor diff;
    double frac = 1.0;
    if (X1.device().is_cpu() && X1.scalar_type() == torch::kFloat && X0.scalar_type() == torch::kFloat &&
        X1.sizes() == X0.sizes()) {
        int64_t anchored = 0;
        diff = unanchored_difference(X1, X0, tau, &anchored);
        frac = double(anchored) / double(std::max<int64_t>(X1.numel(), 1));
    } else { // the tensor formula (GPU, other dtypes); the test checks both agree
        auto mask = anchored_mask(X1, X0, tau);
        diff = torch::where(mask, torch::zeros_like(X1), X1 - X0);
        if (anchored_on_device && !X1.device().is_cpu()) {
            // Not read here: a full step's decision has read its one value already. An all-anchored slope is zero,
            // which extrapolates to F1 itself.
            *anchored_on_device = mask.to(torch::kDouble).mean();
            return cache::idct2(diff).div_(s1 - s0);
        }
        frac = mask.to(torch::kDouble).mean().item<double>();
    }
    if (anchored_fraction) *anchored_fraction = frac;
    if (frac >= 1.0) return Tensor();
    return cache::idct2(diff).div_(s1 - s0);
}

Tensor FreqAnchorDenoiser::extrapolation_curvature(const Tensor& X1, const Tensor& X0, const Tensor& X00, double s1,
                                                   double s0, double s00, double tau) {
    if (!X0.defined() || !X00.defined() || s1 == s0 || s0 == s00 || s1 == s00) return Tensor();
    auto mask = anchored_mask(X1, X0, tau);
    // On a GPU not read back (an all-anchored curvature is zero: the same feature).
    if (X1.device().is_cpu() && mask.all().item<bool>()) return Tensor();
    const auto a = X1.to(torch::kFloat), b = X0.to(torch::kFloat), c = X00.to(torch::kFloat);
    auto dd = ((a - b) / (s1 - s0) - (b - c) / (s0 - s00)) * (2.0 / (s1 - s00));
    return cache::idct2(torch::where(mask, torch::zeros_like(dd), dd));
}

namespace {
// Float32 CPU tensors of one shape, contiguous: the loops below handle them (the tensor formulas the rest).
bool plain_cpu_float(std::initializer_list<const Tensor*> ts) {
    const Tensor& first = **ts.begin();
    for (const Tensor* t : ts)
        if (t->defined() && (!t->device().is_cpu() || t->scalar_type() != torch::kFloat || !t->is_contiguous() ||
                             t->sizes() != first.sizes()))
            return false;
    return true;
}

// a1 + (a1 - a0) c: the first-order forecast through two earlier values (probe energies, model outputs). A reuse step
// forecasts at most a few maps this small, where three tensor ops cost more than the arithmetic.
Tensor linear_forecast(const Tensor& a1, const Tensor& a0, double c) {
    if (!plain_cpu_float({&a1, &a0})) return a1 + (a1 - a0) * c;
    auto out = torch::empty_like(a1);
    const float *p1 = a1.data_ptr<float>(), *p0 = a0.data_ptr<float>();
    float* po = out.data_ptr<float>();
    const float cf = float(c);
    for (int64_t i = 0, n = a1.numel(); i < n; ++i) po[i] = p1[i] + (p1[i] - p0[i]) * cf;
    return out;
}
} // namespace

Tensor FreqAnchorDenoiser::extrapolate_feature(const Tensor& F1, const Tensor& slope, double h, const Tensor& curvature,
                                               const Tensor& alpha) {
    if (!slope.defined() && !curvature.defined()) return F1;
    const int64_t rows = F1.size(0);
    if (alpha.defined() && (alpha.dim() != 1 || alpha.size(0) != rows))
        throw Error("freq: forecast calibration of shape " + shape_str(alpha.sizes().vec()) + " for a feature of " +
                    std::to_string(rows) + " rows");
    const double c2 = 0.5 * h * h;
    // One pass for the common case (float32 CPU feature, slope and curvature) instead of ~10 tensor ops, each a
    // dispatch that costs more than its arithmetic on a small feature map.
    const Tensor a = alpha.defined() ? alpha.to(torch::kFloat).contiguous() : Tensor();
    if (plain_cpu_float({&F1, &slope, &curvature}) && (!a.defined() || a.device().is_cpu()) && slope.defined()) {
        auto out = torch::empty_like(F1);
        const float *f1 = F1.data_ptr<float>(), *sl = slope.data_ptr<float>();
        const float* cv = curvature.defined() ? curvature.data_ptr<float>() : nullptr;
        float* po = out.data_ptr<float>();
        const int64_t per_row = rows ? F1.numel() / rows : 0;
        const float hf = float(h), cf = float(c2);
        for (int64_t r = 0; r < rows; ++r) {
            const float ar = a.defined() ? a.data_ptr<float>()[r] : 1.0f;
            for (int64_t i = r * per_row, e = i + per_row; i < e; ++i) {
                const float d = cv ? sl[i] * hf + cv[i] * cf : sl[i] * hf;
                po[i] = f1[i] + ar * d;
            }
        }
        return out;
    }
    Tensor d;
    if (slope.defined()) d = slope.to(torch::kFloat) * h;
    if (curvature.defined()) d = d.defined() ? d + curvature.to(torch::kFloat) * c2 : curvature.to(torch::kFloat) * c2;
    if (a.defined()) {
        std::vector<int64_t> shape(size_t(F1.dim()), 1);
        shape[0] = rows;
        d = d * a.to(F1.device()).reshape(shape);
    }
    return (F1.to(torch::kFloat) + d).to(F1.scalar_type());
}

Tensor FreqAnchorDenoiser::reuse_feature(const Tensor& F1, const Tensor& X1, const Tensor& X0, double s1, double s0,
                                         double k, double tau, bool extrapolate, double* anchored_fraction) {
    auto slope = extrapolation_slope(X1, X0, s1, s0, tau, anchored_fraction);
    return extrapolate ? extrapolate_feature(F1, slope, k - s1) : F1;
}

namespace {
// attn=reuse (FreqParams::attn_reuse): the hook on the shallow path's attention layers. A full step records their
// residuals (output - input); a shallow step hands them back through `lookup` (the group's residual from the store,
// undefined when some image has none), else the layer runs.
class AttentionResiduals : public AttentionHook {
public:
    explicit AttentionResiduals(const std::vector<FeatureId>& layers) {
        for (const auto& l : layers) keys_.insert(key(l));
    }
    std::map<int32_t, Tensor> recorded; // full step: the residual of each layer, keyed as the store keys it
    std::function<Tensor(int32_t)> lookup;
    int reused = 0;
    Tensor reuse(const FeatureId& id, const Tensor& in) override {
        if (!lookup || !keys_.count(key(id))) return {};
        Tensor r = lookup(key(id));
        if (!r.defined() || r.sizes() != in.sizes()) return {};
        ++reused;
        return r;
    }
    void computed(const FeatureId& id, const Tensor& in, const Tensor& out) override {
        if (!lookup && keys_.count(key(id))) recorded[key(id)] = out - in;
    }
    // The store's layer of an attention layer's entry (kAttnResidual): up or down, block, index.
    static int32_t key(const FeatureId& id) {
        return (id.kind == FeatureKind::UpAttention ? 1 << 20 : 0) + id.block * 1024 + id.index;
    }

private:
    std::set<int32_t> keys_;
};
} // namespace

struct FreqAnchorDenoiser::LanePlan {
    enum class Kind { Full, Shallow, Forecast } kind = Kind::Full;
    const char* why = "";
    double accumulated = 0, drift = 0, calibration = 1, anchored = 0;
    Tensor calibration_on_device, anchored_on_device; // a GPU's log values, read with the log
    bool calibrated = false;
    Tensor feature;   // Shallow: the reuse feature handed to the shallow path
    Tensor injected;  // Shallow with probe=det: the noise injected since the last full step, D
    double gain = 0;  // ... and its effect per unit on the output
    Tensor shift;     // ... noisepass=wiener: the output's answer to D (gain (D - passed)); undefined: gain D
    double noise = 0; // noise=V: D's RMS against the step's noise level
    Tensor out;       // Forecast: the forecast model output
};

namespace {
// The lane's rows of a batch tensor (all of them for a one-image lane, whose rows are undefined).
Tensor lane_rows(const Tensor& t, const Tensor& rows) {
    return rows.defined() && t.defined() ? t.index_select(0, rows.to(t.device())) : t;
}
} // namespace

// The model input is x0 + sigma eps scaled by 1 / sqrt(1 + sigma^2) for both sampler families (Euler-type samplers
// scale their latents so; a DDIM-type sample sqrt(abar) x0 + sqrt(1 - abar) eps is the same with sigma^2 = (1 - abar) /
// abar): the VP form with abar = 1 / (1 + sigma^2). A 9-channel inpainting input's latents are its first channels.
Tensor FreqAnchorDenoiser::denoised_estimate(const Tensor& x, const Tensor& out, double sigma, PredictionType p) {
    const auto xt = x.narrow(1, 0, out.size(1)).to(torch::kFloat);
    return vp_predict(p, out.to(torch::kFloat), xt, float(1.0 / (1.0 + sigma * sigma))).x0;
}

Tensor FreqAnchorDenoiser::output_for(const Tensor& x, const Tensor& x0, double sigma, PredictionType p,
                                      torch::ScalarType dtype) {
    const auto xt = x.narrow(1, 0, x0.size(1)).to(torch::kFloat);
    return vp_output(p, x0, xt, float(1.0 / (1.0 + sigma * sigma))).to(dtype);
}

Tensor FreqAnchorDenoiser::lane_change(const Lane& lane, const Tensor& prev_energies) const {
    // A lane over every row decides on the probe's own change (ShallowProbe::update: the same largest image change).
    const auto& energies = probe_.energies();
    if (!lane.rows.defined()) return Tensor();
    if (!prev_energies.defined() || prev_energies.sizes() != energies.sizes())
        return torch::zeros({}, torch::dtype(torch::kFloat64).device(energies.device()));
    return ShallowProbe::image_change(lane_rows(energies, lane.rows), lane_rows(prev_energies, lane.rows), lane.images);
}

Tensor FreqAnchorDenoiser::lane_drift(const Lane& lane, const Tensor& c) const {
    // Per-image safety: the probe's energies forecast from the last two full steps like the feature; an image whose
    // trajectory has left that forecast gets a full step whatever its accumulated change (plan).
    // Under injected noise only on the input less the noise (noisedrift=1 with probe=det): the raw energies carry
    // each step's fresh noise, which the noise rule bounds.
    const bool noise_rule = p_.noise > 0 && injected_.present && !(p_.noise_drift && p_.probe_det);
    if (p_.drift <= 0 || noise_rule || !lane.e1.defined()) return Tensor();
    const Tensor e = lane_rows(probe_.energies(), lane.rows);
    // c is a host double on the CPU (linear_forecast's loop, its bits) and a 0-d tensor on a GPU (nothing read back).
    const auto forecast = !lane.e0.defined() || lane.u1 == lane.u0 ? lane.e1
                          : c.device().is_cpu()                    ? linear_forecast(lane.e1, lane.e0, c.item<double>())
                                                                   : lane.e1 + (lane.e1 - lane.e0) * c;
    if (forecast.sizes() != e.sizes()) return Tensor();
    return ShallowProbe::image_change(e, forecast, lane.images);
}

FreqAnchorDenoiser::LanePlan FreqAnchorDenoiser::plan(Lane& lane, const Tensor& x, double change, double drift,
                                                      int step, double u) {
    LanePlan pl;
    cache::StepSignals sig;
    sig.step = step;
    sig.num_steps = num_steps_;
    sig.energy_change = change;
    const auto decision = lane.policy.decide(sig);
    bool full = decision.action == cache::Action::Full;
    const char* why = decision.why;
    pl.accumulated = full ? 0.0 : lane.policy.accumulated();
    const bool noise_rule = p_.noise > 0 && injected_.present;
    // The policy's reused last step: no rule of this controller makes it full either.
    const bool reused_last = lane.policy.last_step() == cache::LastStep::Reuse && step == num_steps_ - 1;
    if (!full && !std::isnan(drift)) { // lane_drift
        pl.drift = drift;
        if (pl.drift > p_.drift && !reused_last) full = true, why = "drift";
    }
    // The noise injected since the last full step, D (what the cached feature has not seen), carried to this step:
    // worked out once, for the noise rule and probe=det, on a step that may be a reuse.
    Tensor D;
    const bool noise_skip = holds_denoised();
    if (!full && injected_.part.defined() && (noise_rule || noise_skip || p_.probe_det))
        D = injected_since(lane, lane.injected_full);
    const double sigma = noise_level(step);
    if ((noise_rule || noise_skip) && D.defined()) {
        // Against the noise of the input at this step: sigma / sqrt(1 + sigma^2) in model-input units.
        const double level = sigma / std::sqrt(1.0 + sigma * sigma);
        // A second device read of the step, only under injected noise (ancestral samplers), counted as such.
        // noiserule=passed: only the part of D the last computed estimate's Wiener filter keeps.
        const bool passed = p_.noise_passed_rule && lane.x0.defined() && lane.x0.size(0) == D.size(0);
        const Tensor Dm = passed ? noise_passed(lane, D, sigma) : D.to(torch::kFloat);
        pl.noise = level > 0 ? std::sqrt(host_read({Dm.square().mean()})[0]) / level : 0.0;
        if (noise_rule && !reused_last && pl.noise >= p_.noise) full = true, why = "noise";
    }
    // The reuse reads the feature of the last full step, at most staleness() steps old (the policy's own bound): when
    // the store has no such entry (first step, a new batch size, an eviction) the step is full.
    const int64_t rows = lane.rows.defined() ? lane.rows.size(0) : probe_.stem().size(0);
    std::optional<Tensor> F1;
    if (!full) F1 = lane.features.get(p_.branch, kFeature, 0, step, staleness());
    if (!full && (!F1 || F1->size(0) != rows)) full = true, why = "store";
    // guard=B: the step the rules would reuse spends its drift residual from the image's budget; once spent, the rest
    // of the image's run is computed (cache::DivergenceGuard). The reused last step stays a reuse, as for drift.
    if (!full && !reused_last && lane.guard.must_compute(drift)) full = true, why = "guard";
    if (full && decision.action != cache::Action::Full) lane.policy.mark_full(step);
    // skip=N: the output forecast from the last two computed steps, when there are two and no noise was injected;
    // under injected noise (noiseskip=W) the denoised estimate of the last computed step held, while the noise since
    // the last full step stays below W.
    const bool may_forecast = !full && p_.skip > 0 && lane.forecasts < p_.skip && sampler_history_ <= 1 &&
                              (p_.skip_drift <= 0 || pl.drift < p_.skip_drift);
    // forecast=denoised: x0 of the last two computed steps forecast to this step (held when only one exists).
    const bool two_denoised = lane.x0.defined() && lane.x0_prev.defined() && lane.uo1 != lane.uo0 &&
                              lane.x0.size(0) == rows && lane.x0_prev.size(0) == rows;
    auto denoised_forecast = [&]() {
        return two_denoised ? linear_forecast(lane.x0, lane.x0_prev, (u - lane.uo1) / (lane.uo1 - lane.uo0)) : lane.x0;
    };
    // lastfc=1: the reused last step is the history's forecast of its denoised estimate, along ln sigma.
    if (!full && reused_last && p_.last_forecast && sigma > 0 && lane.h1.defined() && lane.h0.defined() &&
        lane.lh1 != lane.lh0 && lane.h1.size(0) == rows && lane.o1.defined()) {
        pl.kind = LanePlan::Kind::Forecast;
        const double c = (std::log(sigma) - lane.lh1) / (lane.lh1 - lane.lh0);
        pl.out = output_for(lane_rows(x, lane.rows), linear_forecast(lane.h1, lane.h0, c), sigma,
                            injected_.prediction, lane.o1.scalar_type());
        ++lane.forecasts;
        return pl;
    }
    if (may_forecast && !injected_.present && lane.o0.defined() && lane.uo1 != lane.uo0 && lane.o1.size(0) == rows) {
        pl.kind = LanePlan::Kind::Forecast;
        if (p_.forecast_denoised && two_denoised && sigma > 0)
            pl.out = output_for(lane_rows(x, lane.rows), denoised_forecast(), sigma, injected_.prediction,
                                lane.o1.scalar_type());
        else
            pl.out = linear_forecast(lane.o1, lane.o0, (u - lane.uo1) / (lane.uo1 - lane.uo0));
        ++lane.forecasts;
        return pl;
    }
    if (may_forecast && noise_skip && pl.noise < p_.noise_skip && sigma > 0 && lane.x0.defined() &&
        lane.x0.size(0) == rows) {
        pl.kind = LanePlan::Kind::Forecast;
        Tensor x0 = p_.forecast_denoised ? denoised_forecast() : lane.x0;
        // noisepass=wiener: the estimate takes the share of the noise since its own step that the denoiser keeps.
        if (p_.noise_wiener)
            if (auto Dx = injected_since(lane, lane.injected_x0); Dx.defined())
                x0 = x0 + noise_passed(lane, Dx, sigma) * std::sqrt(1.0 + sigma * sigma);
        pl.out = output_for(lane_rows(x, lane.rows), x0, sigma, injected_.prediction, lane.o1.scalar_type());
        ++lane.forecasts;
        return pl;
    }
    if (full) {
        pl.kind = LanePlan::Kind::Full;
        pl.why = why;
        return pl;
    }
    pl.kind = LanePlan::Kind::Shallow;
    Tensor slope, curv;
    if (lane.have_slope)
        if (auto sl = lane.features.get(p_.branch, kSlope, 0, step, staleness())) slope = *sl;
    if (lane.have_curv && slope.defined())
        if (auto c = lane.features.get(p_.branch, kCurvature, 0, step, staleness())) curv = *c;
    Tensor alpha;
    if (p_.correct && slope.defined() && lane.u1 != lane.u0) {
        const auto S1 = lane.features.get(p_.branch, kStem, lane.s1, step, std::numeric_limits<int>::max());
        const auto S0 = lane.features.get(p_.branch, kStem, lane.s0, step, std::numeric_limits<int>::max());
        const Tensor observed = lane_rows(probe_.observed(), lane.rows);
        if (S1 && S0 && S1->sizes() == observed.sizes()) {
            alpha = forecast_calibration(observed, *S1, *S0, (u - lane.u1) / (lane.u1 - lane.u0));
            // For the log only: on a GPU left there (read with the log), on the CPU read now.
            if (alpha.device().is_cpu())
                pl.calibration = alpha.mean().item<double>();
            else
                pl.calibration_on_device = alpha.to(torch::kFloat64).mean();
            pl.calibrated = true;
        }
    }
    pl.feature = extrapolate_feature(*F1, slope, u - lane.u1, curv, alpha);
    pl.anchored = lane.anchored_fraction;
    pl.anchored_on_device = lane.anchored_on_device;
    // probe=det: the noise injected since the last full step, D, is taken out of the shallow path's input and its
    // effect added back analytically (FreqParams::probe_det).
    const double gain = InjectedNoise::gain(injected_.prediction, noise_level(step));
    if (p_.probe_det && p_.shallow_det && D.defined() && gain > 0) {
        pl.injected = D;
        pl.gain = gain;
        if (p_.noise_wiener && lane.x0.defined() && lane.x0.size(0) == rows) {
            const auto Dn = D.narrow(1, 0, lane.x0.size(1)).to(torch::kFloat);
            pl.shift = (Dn - noise_passed(lane, Dn, sigma)) * gain;
        }
    }
    return pl;
}

Tensor FreqAnchorDenoiser::injected_since(const Lane& lane, const InjectedNoise& then) const {
    if (!injected_.part.defined()) return {};
    Tensor D = lane_rows(injected_.part, lane.rows);
    if (then.part.defined() && then.carry != 0) D = D - then.part * (injected_.carry / then.carry);
    return D;
}

Tensor FreqAnchorDenoiser::noise_passed(const Lane& lane, const Tensor& D, double sigma) const {
    // In the estimate's units the noise is D sqrt(1 + sigma^2) (the model input is the sample over sqrt(1 + sigma^2));
    // the filter is linear, so the scale goes in and out unchanged.
    const auto Dn = D.narrow(1, 0, lane.x0.size(1)).to(torch::kFloat);
    return cache::noise_into_denoised(Dn, lane.x0, sigma);
}

void FreqAnchorDenoiser::commit_full(Lane& lane, const Tensor& feature, int step, double u) {
    // Spectra are anchored by the full step that made them: keep this one (s1) and the previous one (s0), and for
    // order 2 the one before (s00).
    auto& fs = lane.features;
    const int dropped = p_.order >= 2 ? lane.s00 : lane.s0;
    if (dropped >= 0) fs.erase(p_.branch, kSpectrum, dropped);
    // correct=1 forecasts the probe's stem from the last two full steps.
    if (p_.correct) {
        if (lane.s0 >= 0) fs.erase(p_.branch, kStem, lane.s0);
        fs.put(p_.branch, kStem, step, lane_rows(probe_.observed(), lane.rows), step);
    }
    lane.s00 = lane.s0, lane.s0 = lane.s1, lane.s1 = step;
    lane.u00 = lane.u0, lane.u0 = lane.u1, lane.u1 = u;
    lane.e0 = lane.e1, lane.e1 = lane_rows(probe_.energies(), lane.rows);
    lane.injected_full = injected_;
    lane.injected_full.part = lane_rows(injected_.part, lane.rows);
    const auto X1 = cache::dct2(feature.to(torch::kFloat));
    fs.put(p_.branch, kFeature, 0, feature, step);
    fs.put(p_.branch, kSpectrum, lane.s1, X1, step);
    // The anchor mask and the forecast terms are fixed until the next full step: work them out once here, so that a
    // reuse step costs one or two axpys on top of the shallow path.
    auto spectrum = [&](int s) {
        Tensor X;
        if (s >= 0)
            if (auto v = fs.get(p_.branch, kSpectrum, s, step, std::numeric_limits<int>::max())) X = *v;
        return X;
    };
    const Tensor X0 = spectrum(lane.s0);
    lane.anchored_on_device = Tensor();
    auto slope = extrapolation_slope(X1, X0, lane.u1, lane.u0, p_.tau, &lane.anchored_fraction, &lane.anchored_on_device);
    lane.have_slope = p_.extrapolate && slope.defined();
    if (lane.have_slope)
        fs.put(p_.branch, kSlope, 0, slope, step);
    else
        fs.erase(p_.branch, kSlope, 0);
    Tensor curv;
    if (lane.have_slope && p_.order >= 2)
        curv = extrapolation_curvature(X1, X0, spectrum(lane.s00), lane.u1, lane.u0, lane.u00, p_.tau);
    lane.have_curv = curv.defined();
    if (lane.have_curv)
        fs.put(p_.branch, kCurvature, 0, curv, step);
    else
        fs.erase(p_.branch, kCurvature, 0);
}

Tensor FreqAnchorDenoiser::predict(UNet2DConditionModelImpl& unet, const Tensor& x, const Tensor& t,
                                   const UNetCond& ctx, int step, const Tensor&) {
    torch::NoGradGuard ng;
    const auto t0 = std::chrono::steady_clock::now();
    if (lanes_.empty()) begin(num_steps_, images_);
    const int64_t R = x.size(0);
    const int n = int(lanes_.size());
    if (images_ > 1 && R % images_ != 0)
        throw Error("freq: " + std::to_string(R) + " UNet rows for a batch of " + std::to_string(images_) + " images");
    if (n > 1) // image b owns rows b, n + b, ... (with guidance [uncond rows; cond rows])
        for (int b = 0; b < n; ++b)
            if (!lanes_[size_t(b)].rows.defined() || lanes_[size_t(b)].rows.size(0) != R / n)
                lanes_[size_t(b)].rows = batch_image_rows(b, R, n, torch::kCPU);
    begin_step();
    const Tensor prev_energies = probe_.energies();
    CacheStepLog rec;
    rec.step = step;
    const Tensor r = probe_.update_value(unet, x, p_.probe_det ? injected_.part : Tensor());
    rec.noise_level = noise_level(step);
    // Everything the decision reads, in one host transfer (one wait on a GPU): the timestep u (the forecast axis),
    // the probe's change r_k, and each lane's own change and drift residual. On a GPU the drift forecast takes u as a
    // tensor; on the CPU every value is the float loops' (their bits).
    const bool on_cpu = r.device().is_cpu();
    const double u_cpu = on_cpu ? t.item<double>() : 0.0;
    const Tensor u_t = on_cpu ? torch::scalar_tensor(u_cpu, torch::kFloat64) : t.to(torch::kFloat64).reshape({});
    std::vector<Tensor> values = {u_t, r};
    std::vector<int> change_at(lanes_.size(), -1), drift_at(lanes_.size(), -1);
    for (size_t b = 0; b < lanes_.size(); ++b) {
        const auto& lane = lanes_[b];
        const Tensor c = lane.u1 != lane.u0 ? (u_t - lane.u1) / (lane.u1 - lane.u0) : u_t;
        if (auto ch = lane_change(lane, prev_energies); ch.defined()) change_at[b] = int(values.size()), values.push_back(ch);
        if (auto d = lane_drift(lane, c); d.defined()) drift_at[b] = int(values.size()), values.push_back(d);
    }
    const auto host = host_read(values);
    const double u = host[0];
    rec.energy_change = host[1];
    std::vector<LanePlan> plans;
    for (size_t b = 0; b < lanes_.size(); ++b)
        plans.push_back(plan(lanes_[b], x, change_at[b] >= 0 ? host[size_t(change_at[b])] : rec.energy_change,
                             drift_at[b] >= 0 ? host[size_t(drift_at[b])] : std::nan(""), step, u));

    // The model output, assembled from each image's rows.
    Tensor out;
    auto place = [&](int b, const Tensor& ob) {
        if (n == 1) {
            out = ob;
            return;
        }
        if (!out.defined()) {
            auto shape = ob.sizes().vec();
            shape[0] = R;
            out = torch::empty(shape, ob.options());
        }
        out.index_copy_(0, lanes_[size_t(b)].rows.to(ob.device()), ob);
    };
    // attn=reuse: the shallow path's attention layers, whose residuals full steps record.
    const auto attn_layers = p_.attn_reuse ? unet.shallow_attention_layers(p_.branch) : std::vector<FeatureId>{};
    bool attention_reused = false;
    // One UNet call for the images that chose `kind`, on their rows in batch order.
    auto run_group = [&](LanePlan::Kind kind) {
        std::vector<int> ids;
        for (int b = 0; b < n; ++b)
            if (plans[size_t(b)].kind == kind) ids.push_back(b);
        if (ids.empty()) return;
        const bool all = int(ids.size()) == n;
        Tensor idx, pos; // the group's batch rows; the position in the group of each batch row
        if (!all) {
            auto mask = torch::zeros({R}, torch::kBool);
            for (int b : ids) mask.index_fill_(0, lanes_[size_t(b)].rows, true);
            idx = torch::nonzero(mask).reshape(-1);
            pos = torch::full({R}, -1, torch::kLong);
            pos.index_copy_(0, idx, torch::arange(idx.size(0), torch::kLong));
        }
        auto gather = [&](const Tensor& v) { return all || !v.defined() ? v : v.index_select(0, idx.to(v.device())); };
        auto local = [&](int b) { return all ? lanes_[size_t(b)].rows : pos.index_select(0, lanes_[size_t(b)].rows); };
        auto part = [&](const Tensor& g, int b) { return n == 1 ? g : g.index_select(0, local(b).to(g.device())); };
        // A per-image tensor laid out in the group's row order.
        auto assemble = [&](const std::function<Tensor(int)>& of) {
            if (n == 1) return of(0);
            Tensor g;
            for (int b : ids) {
                const Tensor v = of(b);
                if (!g.defined()) {
                    auto shape = v.sizes().vec();
                    shape[0] = all ? R : idx.size(0);
                    g = torch::empty(shape, v.options());
                }
                g.index_copy_(0, local(b).to(v.device()), v);
            }
            return g;
        };
        const UNetCond cond = all ? ctx : ctx.index_select(idx);
        AttentionResiduals residuals(attn_layers);
        // Not under injected noise: a residual answers the input its layer saw, and the fresh noise since is what no
        // cached layer has seen (as for the feature, FreqParams::noise).
        AttentionHook* hook = p_.attn_reuse && !injected_.present ? &residuals : nullptr;
        // Image b keeps the residuals its layers just produced (a full step, or a shallow step that ran them).
        auto record_residuals = [&](int b) {
            auto& lane = lanes_[size_t(b)];
            for (const auto& [key, r] : residuals.recorded) lane.features.put(key, kAttnResidual, 0, part(r, b), step);
            lane.attn_reuses = 0;
        };
        if (kind == LanePlan::Kind::Full) {
            SkipFeatureCapture f(p_.branch);
            const Tensor og = unet.forward(gather(x), t, cond, &f, gather(probe_.stem()), hook);
            if (!f.feature.defined())
                throw Error("freq: the UNet produced no cache feature for branch " + std::to_string(p_.branch) +
                            " (it has " + std::to_string(unet.num_skips()) + " skips)");
            for (int b : ids) {
                place(b, part(og, b));
                commit_full(lanes_[size_t(b)], part(f.feature, b), step, u);
                record_residuals(b);
            }
            return;
        }
        // attnmax=N: after N shallow steps in a row on the cached residuals, one runs the layers and records theirs
        // (for the whole group when one of its images is due).
        bool refresh = false;
        for (int b : ids) refresh = refresh || (p_.attn_max >= 0 && lanes_[size_t(b)].attn_reuses >= p_.attn_max);
        if (!refresh)
            residuals.lookup = [&](int32_t key) {
                std::map<int, Tensor> parts;
                for (int b : ids) {
                    auto r = lanes_[size_t(b)].features.get(key, kAttnResidual, 0, step, staleness());
                    if (!r) return Tensor();
                    parts[b] = *r;
                }
                return assemble([&](int b) { return parts[b]; });
            };
        const Tensor F = assemble([&](int b) { return plans[size_t(b)].feature; });
        // probe=det applies to every image of a step or to none (the sampler injects into all of them).
        const bool det = plans[size_t(ids.front())].injected.defined();
        Tensor og;
        if (det) {
            const Tensor D = assemble([&](int b) { return plans[size_t(b)].injected; });
            og = unet.forward_shallow(gather(x) - D, t, cond, p_.branch, F, {}, hook);
        } else {
            og = unet.forward_shallow(gather(x), t, cond, p_.branch, F, gather(probe_.stem()), hook);
        }
        attention_reused = attention_reused || residuals.reused > 0;
        for (int b : ids) {
            const auto& pl = plans[size_t(b)];
            place(b, !det                ? part(og, b)
                     : pl.shift.defined() ? part(og, b) + pl.shift.to(og.scalar_type())
                                          : part(og, b) + pl.injected * pl.gain);
            if (hook && refresh)
                record_residuals(b);
            else if (residuals.reused > 0)
                ++lanes_[size_t(b)].attn_reuses;
        }
    };
    run_group(LanePlan::Kind::Full);
    run_group(LanePlan::Kind::Shallow);
    for (int b = 0; b < n; ++b)
        if (plans[size_t(b)].kind == LanePlan::Kind::Forecast) place(b, plans[size_t(b)].out);

    // Each image's history of computed outputs; the step's record over the images.
    int full_n = 0, shallow_n = 0, forecast_n = 0, calibrated_n = 0;
    double calibration = 0, anchored = 0;
    Tensor calibration_dev, anchored_dev; // sums of a GPU's log values (read with the log)
    auto add = [](Tensor& sum, const Tensor& v) { sum = sum.defined() ? sum + v : v; };
    std::string why;
    for (int b = 0; b < n; ++b) {
        auto& lane = lanes_[size_t(b)];
        const auto& pl = plans[size_t(b)];
        rec.accumulated = std::max(rec.accumulated, pl.accumulated);
        rec.drift = std::max(rec.drift, pl.drift);
        rec.injected = std::max(rec.injected, pl.noise);
        if (pl.calibrated) {
            ++calibrated_n;
            if (pl.calibration_on_device.defined())
                add(calibration_dev, pl.calibration_on_device);
            else
                calibration += pl.calibration;
        }
        if (p_.last_forecast && noise_level(step) > 0) { // every step's estimate, for the last step's forecast
            lane.h0 = lane.h1, lane.lh0 = lane.lh1;
            lane.h1 = denoised_estimate(lane_rows(x, lane.rows), n == 1 ? out : lane_rows(out, lane.rows),
                                        noise_level(step), injected_.prediction);
            lane.lh1 = std::log(noise_level(step));
        }
        if (pl.kind == LanePlan::Kind::Forecast) {
            ++forecast_n;
            continue;
        }
        lane.o0 = lane.o1, lane.uo0 = lane.uo1;
        lane.o1 = n == 1 ? out : lane_rows(out, lane.rows), lane.uo1 = u;
        if (keeps_denoised() && noise_level(step) > 0) {
            lane.x0_prev = lane.x0;
            lane.x0 = denoised_estimate(lane_rows(x, lane.rows), lane.o1, noise_level(step), injected_.prediction);
            lane.injected_x0 = injected_;
            lane.injected_x0.part = lane_rows(injected_.part, lane.rows);
        }
        lane.forecasts = 0;
        if (pl.kind == LanePlan::Kind::Full) {
            ++full_n;
            if (why.find(pl.why) == std::string::npos) why += (why.empty() ? "" : "+") + std::string(pl.why);
        } else {
            ++shallow_n;
            if (pl.anchored_on_device.defined())
                add(anchored_dev, pl.anchored_on_device);
            else
                anchored += pl.anchored;
        }
    }
    last_full_ = full_n > 0;
    rec.full = full_n > 0;
    rec.full_share = double(full_n) / n;
    rec.forecast = forecast_n == n;
    rec.why = why;
    rec.calibration = calibrated_n ? calibration / calibrated_n : 1.0;
    rec.anchored_fraction = shallow_n ? anchored / shallow_n : 0.0;
    rec.macs = 0.0;
    if (full_n) rec.macs += full_n * step_macs(unet, x, ctx, StepCompute::Full, p_.branch) / n;
    if (shallow_n)
        rec.macs += shallow_n *
                    step_macs(unet, x, ctx, attention_reused ? StepCompute::ShallowNoAttention : StepCompute::Shallow,
                              p_.branch) /
                    n;
    rec.attention_reused = attention_reused;
    rec.ms = ms_since(t0);
    if (calibration_dev.defined())
        pending_.push_back({log_.size(), &CacheStepLog::calibration, (calibration_dev + calibration) / calibrated_n});
    if (anchored_dev.defined())
        pending_.push_back({log_.size(), &CacheStepLog::anchored_fraction, (anchored_dev + anchored) / shallow_n});
    log_step(std::move(rec));
    return out;
}

Tensor FreqAnchorDenoiser::forecast_calibration(const Tensor& S, const Tensor& S1, const Tensor& S0, double h) {
    if (plain_cpu_float({&S, &S1, &S0}) && S.dim() >= 1) { // one pass per row, sums in double
        const int64_t rows = S.size(0), per_row = rows ? S.numel() / rows : 0;
        auto alpha = torch::empty({rows}, torch::kFloat);
        float* pa = alpha.data_ptr<float>();
        const float *s = S.data_ptr<float>(), *s1 = S1.data_ptr<float>(), *s0 = S0.data_ptr<float>();
        for (int64_t r = 0; r < rows; ++r) {
            double num = 0, den = 0;
            for (int64_t i = r * per_row, e = i + per_row; i < e; ++i) {
                const double step = (double(s1[i]) - double(s0[i])) * h; // S^ - S1
                num += (double(s[i]) - double(s1[i])) * step, den += step * step;
            }
            pa[r] = float(den > 0 ? std::clamp(num / den, 0.0, 2.0) : 1.0);
        }
        return alpha;
    }
    const auto s = S.to(torch::kFloat).flatten(1), s1 = S1.to(torch::kFloat).flatten(1);
    const auto step = (s1 - S0.to(torch::kFloat).flatten(1)) * h; // S^ - S1
    const auto num = ((s - s1) * step).sum(1), den = step.square().sum(1);
    return torch::where(den > 0, num / den.clamp_min(std::numeric_limits<float>::min()), torch::ones_like(den))
        .clamp(0.0, 2.0);
}

} // namespace anchor::unet
