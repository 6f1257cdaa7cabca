// Frequency-anchored deep-feature cache and the cache mode parser (see freq_cache.h for the rule and its equations).
#include "unet/freq_cache.h"

#include "cache/dct.h"
#include "cache/io/error.h"
#include "kernels/dispatch.h"
#include "unet/unet_macs.h"
#include "unet/unet_model.h"

#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <sstream>

namespace anchor::unet {

using torch::Tensor;

namespace {

// A step's record, begun with the shallow probe's r_k (both modes probe every step: the log and the policies read it).
CacheStepLog probed_step(ShallowProbe& probe, UNet2DConditionModelImpl& unet, const Tensor& x, int step,
                         const Tensor& injected = {}) {
    CacheStepLog rec;
    rec.step = step;
    rec.energy_change = probe.update(unet, x, injected);
    return rec;
}

double ms_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

std::string fmt_num(double v) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%g", v);
    return buf;
}

[[noreturn]] void bad_mode(const std::string& spec, const std::string& why) {
    throw ParamError("cache", "invalid cache mode '" + spec + "': " + why + "; valid forms:\n" + cache_mode_help());
}

double parse_double(const std::string& spec, const std::string& key, const std::string& v) {
    try {
        size_t pos = 0;
        const double d = std::stod(v, &pos);
        if (pos != v.size() || !std::isfinite(d)) throw std::invalid_argument(v);
        return d;
    } catch (const std::exception&) {
        bad_mode(spec, key + " must be a number, got '" + v + "'");
    }
}

int parse_int(const std::string& spec, const std::string& key, const std::string& v) {
    try {
        size_t pos = 0;
        const long d = std::stol(v, &pos);
        if (pos != v.size() || d < INT32_MIN || d > INT32_MAX) throw std::invalid_argument(v);
        return int(d);
    } catch (const std::exception&) {
        bad_mode(spec, key + " must be an integer, got '" + v + "'");
    }
}

std::vector<std::string> split(const std::string& s, char sep) {
    std::vector<std::string> out;
    std::string cur;
    std::stringstream ss(s);
    while (std::getline(ss, cur, sep)) out.push_back(cur);
    if (!s.empty() && s.back() == sep) out.emplace_back();
    return out;
}

} // namespace

// ---- mode table -------------------------------------------------------------------------------------------------

const std::vector<CacheModeInfo>& cache_mode_table() {
    static const std::vector<CacheModeInfo> t = {
        {CacheKind::Off, "off", "off", "full UNet at every step"},
        {CacheKind::DeepCache, "deepcache", "deepcache:N[,branch=B]",
         "DeepCache uniform: full UNet every N steps, shallow path of skip branch B (default 0) in between"},
        {CacheKind::Freq, "freq",
         "freq[:tau=T,thr=A,max=M|none,span=S,band=K,extrapolate=0|1,order=1|2,drift=D,branch=B,probe=det|raw,"
         "correct=0|1,skip=N,skipdrift=D,profile=FILE]",
         "frequency-anchored deep-feature cache: full step when the accumulated low-band (u+v<K, default 4) DCT "
         "energy change of conv_in(x) reaches A (default 1.0), after M reuses (default none), or once the "
         "log-sigma distance since the last full step passes S (default 0.35) of the loop's log-sigma range; "
         "coefficients of the cached feature with energy change rate < T (default 0.01) are reused, the others "
         "forecast along the timestep (extrapolate=1, default; order=1 linear, order=2 TaylorSeer's second-order "
         "term); drift=D (default 0.6, 0 = off) makes a step full when the probe's own forecast misses by more than D; "
         "probe=raw (default) decides on the input as it is, probe=det on the input less the sampler's injected "
         "noise (Euler a, DDIM eta > 0), adding that noise's effect back on reuse; correct=1 (default) scales each "
         "image's forecast step by the share of its own forecast the probe moved (forecast then calibrate); "
         "skip=N (default 1, 0 = off): up to N reuse steps in a row run no UNet layer, the model output forecast "
         "from the last two computed steps (never a step with injected noise, nor with LMS/PNDM), and only while the "
         "probe's drift is below skipdrift=D (default 0.45, 0 = no bound; else the shallow path runs); profile=FILE "
         "(anchor-sd calibrate) sets A per range of steps"},
    };
    return t;
}

std::string cache_mode_help() {
    std::string s;
    for (const auto& m : cache_mode_table()) s += std::string("  ") + m.syntax + "  -  " + m.help + "\n";
    return s;
}

std::string FreqParams::describe() const {
    return "freq:tau=" + fmt_num(tau) + ",thr=" + fmt_num(thr) +
           ",max=" + (max_reuse < 0 ? std::string("none") : std::to_string(max_reuse)) + ",span=" + fmt_num(span) +
           ",band=" + std::to_string(band) + ",extrapolate=" + (extrapolate ? "1" : "0") +
           ",order=" + std::to_string(order) + ",drift=" + fmt_num(drift) + ",branch=" + std::to_string(branch) +
           ",probe=" + (probe_det ? "det" : "raw") + ",correct=" + (correct ? "1" : "0") +
           ",skip=" + std::to_string(skip) + ",skipdrift=" + fmt_num(skip_drift) +
           (profile.empty() ? "" : ",profile=" + profile);
}

nlohmann::json CacheController::params_json() const {
    return nlohmann::json::object();
}

// ---- store ------------------------------------------------------------------------------------------------------

namespace {
std::string fresh_namespace() {
    static std::atomic<uint64_t> next{0};
    return "sd/run" + std::to_string(next++);
}
} // namespace

BatchFeatureStore::BatchFeatureStore() : store_(std::make_shared<cache::LatentCache>()), ns_(fresh_namespace()) {}

BatchFeatureStore::BatchFeatureStore(std::shared_ptr<cache::LatentCache> store, std::string ns)
    : store_(std::move(store)), ns_(std::move(ns)) {
    if (!store_) throw Error("BatchFeatureStore: no store");
}

cache::CacheKey BatchFeatureStore::key(int b, int32_t layer, int32_t slot, int64_t anchor) const {
    return {ns_ + "/" + std::to_string(b), layer, slot, anchor};
}

void BatchFeatureStore::begin(int images) {
    for (int b = 0; b < images_; ++b) store_->erase_namespace(ns_ + "/" + std::to_string(b));
    images_ = std::max(images, 1);
}

void BatchFeatureStore::put(int32_t layer, int32_t slot, int64_t anchor, const Tensor& batch, int64_t step) {
    const int64_t n = images_, rows = batch.size(0);
    if (n == 1 || rows % n != 0) {
        if (rows % n != 0)
            throw Error("feature store: " + std::to_string(rows) + " rows for " + std::to_string(n) + " images");
        store_->put(key(0, layer, slot, anchor), batch, step);
        return;
    }
    for (int64_t b = 0; b < n; ++b) {
        auto idx = torch::arange(b, rows, n, torch::TensorOptions().dtype(torch::kLong).device(batch.device()));
        store_->put(key(int(b), layer, slot, anchor), batch.index_select(0, idx), step);
    }
}

std::optional<Tensor> BatchFeatureStore::get(int32_t layer, int32_t slot, int64_t anchor, int64_t step,
                                             int max_staleness) {
    std::vector<Tensor> parts;
    for (int b = 0; b < images_; ++b) {
        auto t = store_->get(key(b, layer, slot, anchor), step, max_staleness);
        if (!t) return std::nullopt;
        parts.push_back(*t);
    }
    if (parts.size() == 1) return parts[0];
    // Back to the batch order: row r of image b was row r * n + b.
    return torch::stack(parts, 1).flatten(0, 1);
}

void BatchFeatureStore::erase(int32_t layer, int32_t slot, int64_t anchor) {
    for (int b = 0; b < images_; ++b) store_->erase(key(b, layer, slot, anchor));
}

void CacheController::set_store(std::shared_ptr<cache::LatentCache> store, std::string ns) {
    features_ = BatchFeatureStore(std::move(store), std::move(ns));
}

// ---- probe ------------------------------------------------------------------------------------------------------

double ShallowProbe::update(UNet2DConditionModelImpl& unet, const Tensor& x, const Tensor& injected) {
    torch::NoGradGuard ng;
    stem_ = unet.stem(x); // the UNet reuses it as its conv_in output this step (forward's `stem`)
    if (injected.defined() && injected.sizes() != x.sizes())
        throw Error("freq probe: the injected noise has shape " + shape_str(injected.sizes().vec()) +
                    ", the model input " + shape_str(x.sizes().vec()));
    observed_ = injected.defined() ? unet.stem(x - injected) : stem_;
    auto s = observed_.to(torch::kFloat);
    // Only the L low-band coefficients (u + v < band) enter r_k. On the CPU one [maps, HW] x [HW, L] product
    // (cache::dct2_low_band); on a GPU the batched cuFFT energy kernel (kernels/cuda/dct_energy.cu), band picked after.
    Tensor e;
    if (s.is_cuda() && kernels::cuda_kernels_built()) {
        const int64_t h = s.size(-2), w = s.size(-1);
        const auto idx = cache::low_band_indices(h, w, band_);
        e = kernels::dct_energy(s).flatten(-2).index_select(-1, torch::tensor(idx, torch::kInt64).to(s.device()));
    } else {
        e = cache::dct2_low_band(s, band_).square();
    }
    const double r = prev_.defined() && prev_.sizes() == e.sizes() ? largest_image_change(e, prev_, images_) : 0.0;
    prev_ = e;
    return r;
}

double ShallowProbe::largest_image_change(const Tensor& e, const Tensor& ref, int images) {
    const int64_t rows = e.size(0), n = images;
    if (n <= 1 || rows % n != 0) return cache::relative_spectral_change(e, ref);
    double r = 0.0;
    for (int64_t b = 0; b < n; ++b) { // image b owns rows b, n + b, 2n + b, ...
        auto idx = torch::arange(b, rows, n, torch::TensorOptions().dtype(torch::kLong).device(e.device()));
        r = std::max(r, cache::relative_spectral_change(e.index_select(0, idx), ref.index_select(0, idx)));
    }
    return r;
}

// ---- freq -------------------------------------------------------------------------------------------------------

double CacheController::step_macs(const UNet2DConditionModelImpl& unet, const torch::Tensor& x, const UNetCond& ctx,
                                  bool full, int branch) {
    if (!mac_fn) {
        const auto b = unet_mac_breakdown(unet.config(), x.size(-2), x.size(-1), ctx.context.size(1));
        const double f = double(b.full().total()), sh = double(b.shallow(branch).total());
        mac_fn = [f, sh](bool is_full) { return is_full ? f : sh; };
    }
    return mac_fn(full);
}

FreqAnchorDenoiser::FreqAnchorDenoiser(const FreqParams& p)
    : p_(p), policy_(p.thr, p.max_reuse < 0 ? std::numeric_limits<int>::max() : p.max_reuse), probe_(p.band) {
    if (!(p.tau >= 0)) throw ParamError("cache", "freq: tau must be >= 0, got " + fmt_num(p.tau));
    if (!(p.thr > 0)) throw ParamError("cache", "freq: thr must be > 0, got " + fmt_num(p.thr));
    if (p.max_reuse < -1)
        throw ParamError("cache", "freq: max must be >= 0 or none, got " + std::to_string(p.max_reuse));
    if (!(p.span >= 0)) throw ParamError("cache", "freq: span must be >= 0, got " + fmt_num(p.span));
    if (p.order != 1 && p.order != 2)
        throw ParamError("cache", "freq: order must be 1 or 2, got " + std::to_string(p.order));
    if (!(p.drift >= 0)) throw ParamError("cache", "freq: drift must be >= 0, got " + fmt_num(p.drift));
    if (p.band < 1) throw ParamError("cache", "freq: band must be >= 1, got " + std::to_string(p.band));
    if (p.branch < 0) throw ParamError("cache", "freq: branch must be >= 0, got " + std::to_string(p.branch));
}

nlohmann::json FreqAnchorDenoiser::params_json() const {
    return {{"tau", p_.tau},
            {"thr", p_.thr},
            {"max", p_.max_reuse < 0 ? nlohmann::json("none") : nlohmann::json(p_.max_reuse)},
            {"span", p_.span},
            {"band", p_.band},
            {"extrapolate", p_.extrapolate},
            {"order", p_.order},
            {"drift", p_.drift},
            {"branch", p_.branch},
            {"probe", p_.probe_det ? "det" : "raw"},
            {"correct", p_.correct},
            {"skip", p_.skip},
            {"skipdrift", p_.skip_drift}};
}

void FreqAnchorDenoiser::begin(int num_steps, int images) {
    num_steps_ = num_steps;
    policy_.reset();
    if (p_.profile_data.has_step_ranges())
        policy_.set_step_thresholds(p_.profile_data.step_thresholds(num_steps, p_.thr));
    // The loop's noise levels when the pipeline gave them for this loop (a caller driving predict itself gives none:
    // then no span bound).
    policy_.set_span_bound(p_.span, sigmas_.size() == size_t(num_steps) ? sigmas_ : std::vector<double>{});
    images_ = std::max(images, 1);
    probe_.reset(images);
    features_.begin(images);
    log_.clear();
    have_slope_ = have_curv_ = false;
    anchored_fraction_ = 1.0;
    s1_ = s0_ = s00_ = -1;
    e1_ = e0_ = Tensor();
    injected_ = injected_full_ = InjectedNoise();
    last_full_ = true;
    o1_ = o0_ = Tensor();
    forecasts_ = 0;
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
                                               double* anchored_fraction) {
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
        frac = mask.to(torch::kDouble).mean().item<double>();
        diff = torch::where(mask, torch::zeros_like(X1), X1 - X0);
    }
    if (anchored_fraction) *anchored_fraction = frac;
    if (frac >= 1.0) return Tensor();
    return cache::idct2(diff).div_(s1 - s0);
}

Tensor FreqAnchorDenoiser::extrapolation_curvature(const Tensor& X1, const Tensor& X0, const Tensor& X00, double s1,
                                                   double s0, double s00, double tau) {
    if (!X0.defined() || !X00.defined() || s1 == s0 || s0 == s00 || s1 == s00) return Tensor();
    auto mask = anchored_mask(X1, X0, tau);
    if (mask.all().item<bool>()) return Tensor();
    const auto a = X1.to(torch::kFloat), b = X0.to(torch::kFloat), c = X00.to(torch::kFloat);
    auto dd = ((a - b) / (s1 - s0) - (b - c) / (s0 - s00)) * (2.0 / (s1 - s00));
    return cache::idct2(torch::where(mask, torch::zeros_like(dd), dd));
}

Tensor FreqAnchorDenoiser::extrapolate_feature(const Tensor& F1, const Tensor& slope, double h,
                                               const Tensor& curvature) {
    if (!slope.defined() && !curvature.defined()) return F1;
    auto f = F1.to(torch::kFloat);
    if (slope.defined()) f = f + slope * h;
    if (curvature.defined()) f = f + curvature * (0.5 * h * h);
    return f.to(F1.scalar_type());
}

Tensor FreqAnchorDenoiser::reuse_feature(const Tensor& F1, const Tensor& X1, const Tensor& X0, double s1, double s0,
                                         double k, double tau, bool extrapolate, double* anchored_fraction) {
    auto slope = extrapolation_slope(X1, X0, s1, s0, tau, anchored_fraction);
    return extrapolate ? extrapolate_feature(F1, slope, k - s1) : F1;
}

Tensor FreqAnchorDenoiser::predict(UNet2DConditionModelImpl& unet, const Tensor& x, const Tensor& t,
                                   const UNetCond& ctx, int step, const Tensor&) {
    torch::NoGradGuard ng;
    const auto t0 = std::chrono::steady_clock::now();
    CacheStepLog rec = probed_step(probe_, unet, x, step, p_.probe_det ? injected_.part : Tensor());
    rec.noise_level = noise_level(step);
    const double u = t.item<double>(); // the forecast axis: the UNet's timestep
    cache::StepSignals sig;
    sig.step = step;
    sig.num_steps = num_steps_;
    sig.energy_change = rec.energy_change;
    const auto decision = policy_.decide(sig);
    bool full = decision.action == cache::Action::Full;
    const char* why = decision.why;
    rec.accumulated = full ? 0.0 : policy_.accumulated();
    // Per-image safety: the probe's energies forecast from the last two full steps like the feature; an image whose
    // trajectory has left that forecast gets a full step whatever its accumulated change.
    if (!full && p_.drift > 0 && e1_.defined()) {
        const auto& e = probe_.energies();
        auto forecast = e0_.defined() && u1_ != u0_ ? e1_ + (e1_ - e0_) * ((u - u1_) / (u1_ - u0_)) : e1_;
        if (forecast.sizes() == e.sizes()) {
            rec.drift = ShallowProbe::largest_image_change(e, forecast, images_);
            if (rec.drift > p_.drift) full = true, why = "drift";
        }
    }
    // The reuse reads the feature of the last full step, at most staleness() steps old (the policy's own bound): when
    // the store has no such entry (first step, a new batch size, an eviction) the step is full.
    std::optional<Tensor> F1;
    if (!full) F1 = features_.get(p_.branch, kFeature, 0, step, staleness());
    if (!full && (!F1 || F1->size(0) != x.size(0))) full = true, why = "store";
    if (full && decision.action != cache::Action::Full) policy_.mark_full(step);
    Tensor out;
    // skip=N: the output forecast from the last two computed steps, when there are two and no noise was injected.
    const bool forecast = !full && p_.skip > 0 && forecasts_ < p_.skip && o0_.defined() && uo1_ != uo0_ &&
                          o1_.size(0) == x.size(0) && !injected_.present && sampler_history_ <= 1 &&
                          (p_.skip_drift <= 0 || rec.drift < p_.skip_drift);
    if (forecast) {
        out = o1_ + (o1_ - o0_) * ((u - uo1_) / (uo1_ - uo0_));
        ++forecasts_;
    } else if (full) {
        SkipFeatureCapture f(p_.branch);
        out = unet.forward(x, t, ctx, &f, probe_.stem());
        if (!f.feature.defined())
            throw Error("freq: the UNet produced no cache feature for branch " + std::to_string(p_.branch) +
                        " (it has " + std::to_string(unet.num_skips()) + " skips)");
        // Spectra are anchored by the full step that made them: keep this one (s1) and the previous one (s0), and
        // for order 2 the one before (s00).
        const int dropped = p_.order >= 2 ? s00_ : s0_;
        if (dropped >= 0) features_.erase(p_.branch, kSpectrum, dropped);
        // correct=1 forecasts the probe's stem from the last two full steps.
        if (p_.correct) {
            if (s0_ >= 0) features_.erase(p_.branch, kStem, s0_);
            features_.put(p_.branch, kStem, step, probe_.observed(), step);
        }
        s00_ = s0_, s0_ = s1_, s1_ = step;
        u00_ = u0_, u0_ = u1_, u1_ = u;
        e0_ = e1_, e1_ = probe_.energies();
        injected_full_ = injected_;
        const auto X1 = cache::dct2(f.feature.to(torch::kFloat));
        features_.put(p_.branch, kFeature, 0, f.feature, step);
        features_.put(p_.branch, kSpectrum, s1_, X1, step);
        // The anchor mask and the forecast terms are fixed until the next full step: work them out once here, so
        // that a reuse step costs one or two axpys on top of the shallow path.
        auto spectrum = [&](int s) {
            Tensor X;
            if (s >= 0)
                if (auto v = features_.get(p_.branch, kSpectrum, s, step, std::numeric_limits<int>::max())) X = *v;
            return X;
        };
        const Tensor X0 = spectrum(s0_);
        auto slope = extrapolation_slope(X1, X0, u1_, u0_, p_.tau, &anchored_fraction_);
        have_slope_ = p_.extrapolate && slope.defined();
        if (have_slope_)
            features_.put(p_.branch, kSlope, 0, slope, step);
        else
            features_.erase(p_.branch, kSlope, 0);
        Tensor curv;
        if (have_slope_ && p_.order >= 2)
            curv = extrapolation_curvature(X1, X0, spectrum(s00_), u1_, u0_, u00_, p_.tau);
        have_curv_ = curv.defined();
        if (have_curv_)
            features_.put(p_.branch, kCurvature, 0, curv, step);
        else
            features_.erase(p_.branch, kCurvature, 0);
        rec.anchored_fraction = 0.0;
    } else {
        Tensor slope, curv;
        if (have_slope_)
            if (auto sl = features_.get(p_.branch, kSlope, 0, step, staleness())) slope = *sl;
        if (have_curv_ && slope.defined())
            if (auto c = features_.get(p_.branch, kCurvature, 0, step, staleness())) curv = *c;
        auto F = extrapolate_feature(*F1, slope, u - u1_, curv);
        if (p_.correct && slope.defined() && u1_ != u0_) {
            const auto S1 = features_.get(p_.branch, kStem, s1_, step, std::numeric_limits<int>::max());
            const auto S0 = features_.get(p_.branch, kStem, s0_, step, std::numeric_limits<int>::max());
            if (S1 && S0 && S1->sizes() == probe_.observed().sizes()) {
                const auto alpha = forecast_calibration(probe_.observed(), *S1, *S0, (u - u1_) / (u1_ - u0_));
                F = calibrated_feature(*F1, F, alpha);
                rec.calibration = alpha.mean().item<double>();
            }
        }
        rec.anchored_fraction = anchored_fraction_;
        // probe=det: the noise injected since the last full step, D, is taken out of the shallow path's input and its
        // effect added back analytically (FreqParams::probe_det).
        const double gain = InjectedNoise::gain(injected_.prediction, noise_level(step));
        if (p_.probe_det && injected_.part.defined() && gain > 0) {
            auto D = injected_.part;
            if (injected_full_.part.defined() && injected_full_.carry != 0)
                D = D - injected_full_.part * (injected_.carry / injected_full_.carry);
            out = unet.forward_shallow(x - D, t, ctx, p_.branch, F) + D * gain;
        } else {
            out = unet.forward_shallow(x, t, ctx, p_.branch, F, probe_.stem());
        }
    }
    if (!forecast) {
        o0_ = o1_, uo0_ = uo1_;
        o1_ = out, uo1_ = u;
        forecasts_ = 0;
    }
    last_full_ = full;
    rec.full = full;
    rec.forecast = forecast;
    rec.why = full ? why : "";
    rec.macs = forecast ? 0.0 : step_macs(unet, x, ctx, full, p_.branch);
    rec.ms = ms_since(t0);
    log_.push_back(rec);
    return out;
}

Tensor FreqAnchorDenoiser::forecast_calibration(const Tensor& S, const Tensor& S1, const Tensor& S0, double h) {
    const auto s = S.to(torch::kFloat).flatten(1), s1 = S1.to(torch::kFloat).flatten(1);
    const auto step = (s1 - S0.to(torch::kFloat).flatten(1)) * h; // S^ - S1
    const auto num = ((s - s1) * step).sum(1), den = step.square().sum(1);
    return torch::where(den > 0, num / den.clamp_min(std::numeric_limits<float>::min()), torch::ones_like(den))
        .clamp(0.0, 2.0);
}

Tensor FreqAnchorDenoiser::calibrated_feature(const Tensor& F1, const Tensor& F, const Tensor& alpha) {
    std::vector<int64_t> shape(size_t(F1.dim()), 1);
    shape[0] = F1.size(0);
    const auto f1 = F1.to(torch::kFloat);
    return (f1 + (F.to(torch::kFloat) - f1) * alpha.to(F1.device()).reshape(shape)).to(F1.scalar_type());
}

// ---- off / deepcache --------------------------------------------------------------------------------------------

DeepCacheDenoiser::DeepCacheDenoiser(int interval, int branch, int band)
    : interval_(interval), branch_(branch), probe_(band) {
    if (interval < 0) throw Error("deepcache: interval must be >= 1 (0 = off), got " + std::to_string(interval));
    if (branch < 0) throw Error("deepcache: branch must be >= 0, got " + std::to_string(branch));
    if (interval > 0) policy_ = std::make_unique<cache::FixedIntervalPolicy>(interval);
}

std::string DeepCacheDenoiser::spec() const {
    if (interval_ == 0) return "off";
    return "deepcache:" + std::to_string(interval_) + (branch_ ? ",branch=" + std::to_string(branch_) : "");
}

nlohmann::json DeepCacheDenoiser::params_json() const {
    if (interval_ == 0) return nlohmann::json::object();
    return {{"interval", interval_}, {"branch", branch_}};
}

void DeepCacheDenoiser::begin(int num_steps, int images) {
    num_steps_ = num_steps;
    probe_.reset(images);
    features_.begin(images);
    log_.clear();
    last_full_ = true;
}

Tensor DeepCacheDenoiser::predict(UNet2DConditionModelImpl& unet, const Tensor& x, const Tensor& t, const UNetCond& ctx,
                                  int step, const Tensor&) {
    torch::NoGradGuard ng;
    const auto t0 = std::chrono::steady_clock::now();
    CacheStepLog rec = probed_step(probe_, unet, x, step);
    rec.noise_level = noise_level(step);
    cache::Decision d;
    d.why = "off";
    if (policy_) d = policy_->decide({step, num_steps_, {}, rec.energy_change});
    bool full = d.action == cache::Action::Full;
    // The feature of the last full step serves the interval - 1 steps after it.
    std::optional<Tensor> cached;
    if (!full) cached = features_.get(branch_, kFeature, 0, step, interval_ - 1);
    if (!full && (!cached || cached->size(0) != x.size(0))) full = true, d.why = "store";
    Tensor out;
    if (full) {
        SkipFeatureCapture f(branch_);
        out = unet.forward(x, t, ctx, policy_ ? &f : nullptr, probe_.stem());
        if (policy_) features_.put(branch_, kFeature, 0, f.feature, step);
    } else {
        out = unet.forward_shallow(x, t, ctx, branch_, *cached, probe_.stem());
    }
    last_full_ = rec.full = full;
    rec.why = full ? d.why : "";
    rec.anchored_fraction = full ? 0.0 : 1.0;
    rec.macs = step_macs(unet, x, ctx, full, branch_);
    rec.ms = ms_since(t0);
    log_.push_back(rec);
    return out;
}

// ---- parsing ----------------------------------------------------------------------------------------------------

std::unique_ptr<CacheController> parse_cache_mode(const std::string& spec) {
    const auto colon = spec.find(':');
    const std::string head = spec.substr(0, colon);
    const std::string rest = colon == std::string::npos ? "" : spec.substr(colon + 1);
    const CacheModeInfo* info = nullptr;
    for (const auto& m : cache_mode_table())
        if (head == m.name) info = &m;
    if (!info) bad_mode(spec, "unknown mode '" + head + "'");
    if (colon != std::string::npos && rest.empty()) bad_mode(spec, "empty parameter list after ':'");

    switch (info->kind) {
    case CacheKind::Off:
        if (colon != std::string::npos) bad_mode(spec, "'off' takes no parameters");
        return std::make_unique<DeepCacheDenoiser>(0, 0);
    case CacheKind::DeepCache: {
        if (rest.empty()) bad_mode(spec, "deepcache needs an interval N");
        auto items = split(rest, ',');
        const int n = parse_int(spec, "N", items[0]);
        if (n < 1) bad_mode(spec, "the interval N must be >= 1");
        int branch = 0;
        for (size_t i = 1; i < items.size(); ++i) {
            const auto eq = items[i].find('=');
            if (eq == std::string::npos || items[i].substr(0, eq) != "branch")
                bad_mode(spec, "unknown deepcache parameter '" + items[i] + "' (only branch=B)");
            branch = parse_int(spec, "branch", items[i].substr(eq + 1));
            if (branch < 0) bad_mode(spec, "branch must be >= 0");
        }
        return std::make_unique<DeepCacheDenoiser>(n, branch);
    }
    case CacheKind::Freq: {
        FreqParams p;
        if (!rest.empty())
            for (const auto& item : split(rest, ',')) {
                const auto eq = item.find('=');
                if (eq == std::string::npos) bad_mode(spec, "expected key=value, got '" + item + "'");
                const std::string k = item.substr(0, eq), v = item.substr(eq + 1);
                if (k == "tau")
                    p.tau = parse_double(spec, k, v);
                else if (k == "thr")
                    p.thr = parse_double(spec, k, v);
                else if (k == "max") {
                    p.max_reuse = v == "none" ? -1 : parse_int(spec, k, v);
                    if (v != "none" && p.max_reuse < 0) bad_mode(spec, "max must be >= 0 or none, got '" + v + "'");
                } else if (k == "span")
                    p.span = parse_double(spec, k, v);
                else if (k == "order")
                    p.order = parse_int(spec, k, v);
                else if (k == "drift")
                    p.drift = parse_double(spec, k, v);
                else if (k == "band")
                    p.band = parse_int(spec, k, v);
                else if (k == "branch")
                    p.branch = parse_int(spec, k, v);
                else if (k == "profile") {
                    p.profile = v;
                    p.profile_data = cache::AnchorProfile::load(v);
                    if (!p.profile_data.has_step_ranges())
                        throw Error("anchor profile '" + v +
                                    "' has no step ranges (write one with anchor-sd calibrate)");
                } else if (k == "probe") {
                    if (v != "det" && v != "raw") bad_mode(spec, "probe must be det or raw, got '" + v + "'");
                    p.probe_det = v == "det";
                } else if (k == "correct") {
                    if (v != "0" && v != "1") bad_mode(spec, "correct must be 0 or 1, got '" + v + "'");
                    p.correct = v == "1";
                } else if (k == "skipdrift") {
                    p.skip_drift = parse_double(spec, k, v);
                    if (!(p.skip_drift >= 0)) bad_mode(spec, "skipdrift must be >= 0, got '" + v + "'");
                } else if (k == "skip") {
                    p.skip = parse_int(spec, k, v);
                    if (p.skip < 0) bad_mode(spec, "skip must be >= 0, got '" + v + "'");
                } else if (k == "extrapolate") {
                    if (v != "0" && v != "1") bad_mode(spec, "extrapolate must be 0 or 1, got '" + v + "'");
                    p.extrapolate = v == "1";
                } else
                    bad_mode(spec, "unknown freq parameter '" + k + "'");
            }
        try {
            return std::make_unique<FreqAnchorDenoiser>(p);
        } catch (const ParamError& e) {
            bad_mode(spec, e.detail());
        } catch (const Error& e) { // the policy's own checks (cache/anchor_policy.h)
            bad_mode(spec, e.what());
        }
    }
    }
    bad_mode(spec, "unknown mode");
}

std::vector<std::string> split_mode_list(const std::string& list) {
    std::vector<std::string> out;
    for (const auto& item : split(list, ',')) {
        const bool kv = item.find('=') != std::string::npos && item.find(':') == std::string::npos;
        if (kv && !out.empty())
            out.back() += (out.back().find(':') == std::string::npos ? ":" : ",") + item;
        else
            out.push_back(item);
    }
    return out;
}

nlohmann::json cache_log_json(const CacheController& c) {
    nlohmann::json steps = nlohmann::json::array();
    int full = 0;
    double macs = 0, ms = 0;
    for (const auto& r : c.log()) {
        steps.push_back({{"step", r.step},
                         {"full", r.full},
                         {"energy_change", r.energy_change},
                         {"accumulated", r.accumulated},
                         {"anchored_fraction", r.anchored_fraction},
                         {"noise_level", r.noise_level},
                         {"drift", r.drift},
                         {"calibration", r.calibration},
                         {"forecast", r.forecast},
                         {"why", r.why},
                         {"macs", r.macs},
                         {"ms", r.ms}});
        full += r.full ? 1 : 0;
        macs += r.macs;
        ms += r.ms;
    }
    const size_t n = c.log().size();
    return {{"mode", c.spec()},
            {"kind", c.name()},
            {"params", c.params_json()},
            {"full_steps", full},
            {"total_steps", n},
            {"macs_per_step", n ? macs / double(n) : 0.0},
            {"unet_ms", ms},
            {"store", c.features().store().stats_json()},
            {"steps", steps}};
}

} // namespace anchor::unet
