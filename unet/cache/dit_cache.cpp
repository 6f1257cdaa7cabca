// The cache modes on a diffusion transformer (see dit_cache.h).
#include "unet/cache/dit_cache.h"

#include "cache/dct.h"
#include "cache/io/error.h"
#include "unet/cache/dit_cache_config.h"
#include "unet/cache/freq_cache.h"
#include "unet/cache/shallow_probe.h"

#include <chrono>
#include <climits>
#include <cmath>

namespace anchor::unet {

using torch::Tensor;

namespace {

// Image tokens [B, h*w, dim] as a map [B, dim, h, w] on the patch grid (row-major tokens, as the patch embedding
// flattens them), and back.
Tensor dit_tokens_to_grid(const Tensor& t, int64_t h, int64_t w) {
    return t.transpose(1, 2).reshape({t.size(0), t.size(2), h, w});
}
Tensor dit_grid_to_tokens(const Tensor& g) {
    return g.flatten(2).transpose(1, 2);
}

// The largest over the images of |e - f|_1 / |e|_1, image b pooled over its rows b, images + b, ... (the drift rule).
double dit_largest_drift(const Tensor& e, const Tensor& f, int images) {
    const int64_t rows = e.size(0), n = images > 1 && rows % images == 0 ? images : 1;
    const auto a = e.to(torch::kFloat64).reshape({rows / n, n, -1}), b = f.to(torch::kFloat64).reshape({rows / n, n, -1});
    const auto num = (a - b).abs().sum(std::vector<int64_t>{0, 2}), den = a.abs().sum(std::vector<int64_t>{0, 2});
    return (num / (den + cache::kEnergyRateEps)).max().item<double>();
}

} // namespace

DitCacheController::DitCacheController(const CacheConfig& c, const std::string& field) {
    check_dit_cache_config(c, field);
    cfg_ = resolve_dit_cache_config(c);
}

void DitCacheController::begin(int num_steps, std::vector<double> sigmas, int images, int first_step) {
    num_steps_ = num_steps;
    first_step_ = first_step;
    sigmas_ = std::move(sigmas);
    images_ = std::max(images, 1);
    log_.clear();
    prev_e_ = e1_ = e0_ = F1_ = X1_ = X0_ = X00_ = ref_r1_ = residual_ = prev_mod_ = Tensor();
    taylor_.clear();
    taylor_step_ = -1;
    prev_out_ = Tensor();
    skip_left_ = reuse_run_ = 0;
    probe_step_ = -1;
    out1_ = out0_ = Tensor();
    out_u1_ = out_u0_ = 0;
    samples_.clear();
    dct_.reset(), fb_.reset(), tea_.reset(), seer_.reset();
    if (const auto* f = std::get_if<FreqParams>(&cfg_.params)) {
        dct_ = std::make_unique<cache::DctChangePolicy>(f->thr, f->max_reuse < 0 ? INT_MAX : f->max_reuse);
        bool levels = int(sigmas_.size()) >= num_steps && num_steps > 0;
        for (int i = 0; levels && i < num_steps; ++i) levels = sigmas_[size_t(i)] > 0 && std::isfinite(sigmas_[size_t(i)]);
        if (levels && f->span > 0)
            dct_->set_span_bound(f->span, std::vector<double>(sigmas_.begin(), sigmas_.begin() + num_steps));
        cache::LastStep last = cache::LastStep::Rules;
        if (f->last) {
            const double s = levels ? sigmas_[size_t(num_steps - 1)] : 1.0;
            last = f->last_sigma <= 0 || s >= f->last_sigma ? cache::LastStep::Full : cache::LastStep::Reuse;
        }
        dct_->set_last_step(last);
    } else if (const auto* b = std::get_if<FbCacheParams>(&cfg_.params)) {
        fb_ = std::make_unique<cache::FirstBlockRule>(b->thr, b->max_reuse, b->warmup);
    } else if (const auto* t = std::get_if<TeaCacheParams>(&cfg_.params)) {
        tea_ = std::make_unique<cache::TeaCacheRule>(t->thr, t->coefficients);
    } else if (const auto* s = std::get_if<TaylorSeerParams>(&cfg_.params)) {
        seer_ = std::make_unique<cache::TaylorSeerRule>(s->interval, s->warmup);
    }
}

Tensor DitCacheController::forward(SD3Transformer2DModelImpl& tr, const Tensor& x, const Tensor& context,
                                   const Tensor& pooled, double t, int loop_step) {
    const int step = loop_step - first_step_;
    const auto t0 = std::chrono::steady_clock::now();
    c10::InferenceMode guard;
    CacheStepLog rec;
    rec.step = step;
    rec.noise_level = step >= 0 && size_t(step) < sigmas_.size() ? sigmas_[size_t(step)] : 0;
    const auto ts = torch::full({x.size(0)}, float(t), torch::kFloat);
    Tensor out;
    if (cfg_.kind() == CacheKind::Off && record_teacache) {
        SD3Tokens tok = tr.embed(x, context, pooled, ts);
        const Tensor mod = tr.first_block_modulated_input(tok);
        tr.run_blocks(tok, int(tr.blocks.size()));
        out = tr.head(tok);
        if (prev_mod_.defined() && prev_out_.defined())
            samples_.emplace_back(relative_l1(mod, prev_mod_), relative_l1(out, prev_out_));
        prev_mod_ = mod, prev_out_ = out;
        rec.why = "off";
    } else if (cfg_.kind() == CacheKind::Off) {
        out = tr.forward(x, context, pooled, ts);
        rec.why = "off";
    } else if (cfg_.kind() == CacheKind::Freq && skip_left_ > 0 && out0_.defined() && out1_.size(0) == x.size(0) &&
               out_u1_ != out_u0_) {
        // A skip step (skip=N): no block, the output forecast from the last two computed ones.
        --skip_left_;
        ++reuse_run_;
        out = linear_output_forecast(out1_, out0_, out_u1_, out_u0_, t);
        rec.full = false;
        rec.why = "";
        rec.forecast = true;
        rec.accumulated = dct_->accumulated();
    } else {
        SD3Tokens tok = tr.embed(x, context, pooled, ts);
        switch (cfg_.kind()) {
        case CacheKind::Freq: out = forward_freq(tr, tok, t, step, rec); break;
        case CacheKind::FbCache: out = forward_fbcache(tr, tok, step, rec); break;
        case CacheKind::TeaCache: out = forward_teacache(tr, tok, step, rec); break;
        case CacheKind::TaylorSeer: out = forward_taylorseer(tr, tok, step, rec); break;
        default: throw Error("DiT cache: mode '" + cfg_.label + "' has no transformer path");
        }
    }
    rec.full_share = rec.full ? 1 : 0;
    rec.ms = ms_since(t0);
    log_.push_back(rec);
    return out;
}

Tensor DitCacheController::forward_freq(SD3Transformer2DModelImpl& tr, SD3Tokens& tok, double u, int step,
                                        CacheStepLog& rec) {
    const auto& p = std::get<FreqParams>(cfg_.params);
    const int L = int(tr.blocks.size());
    tr.run_blocks(tok, 1);
    const Tensor h1 = tok.hs;
    // The probe: the first block's image tokens on the patch grid, their low-band DCT energies (cache/dct.h).
    const auto e = cache::dct2_low_band(dit_tokens_to_grid(h1, tok.grid_h, tok.grid_w).to(torch::kFloat), p.band).square();
    rec.energy_change =
        prev_e_.defined() && prev_e_.sizes() == e.sizes() ? ShallowProbe::largest_image_change(e, prev_e_, images_) : 0;
    prev_e_ = e;
    cache::StepSignals s;
    s.step = step, s.num_steps = num_steps_, s.energy_change = rec.energy_change;
    cache::Decision d = dct_->decide(s);
    rec.accumulated = dct_->accumulated();
    if (d.action == cache::Action::Reuse && p.drift > 0 && e1_.defined() && e0_.defined() && u1_ != u0_) {
        // The probe's energies against their own linear forecast from the last two full steps (the per-image bound).
        const double c = (u - u1_) / (u1_ - u0_);
        rec.drift = dit_largest_drift(e, e1_ + (e1_ - e0_) * c, images_);
        if (rec.drift > p.drift) {
            d = {cache::Action::Full, {}, "drift"};
            dct_->mark_full(step);
        }
    }
    if (d.action == cache::Action::Reuse && !F1_.defined()) {
        d = {cache::Action::Full, {}, "store"};
        dct_->mark_full(step);
    }
    rec.full = d.action == cache::Action::Full;
    rec.why = d.why;
    Tensor out;
    if (rec.full) {
        tr.run_blocks(tok, L);
        const auto R = dit_tokens_to_grid(tok.hs - h1, tok.grid_h, tok.grid_w);
        X00_ = X0_, X0_ = X1_, u00_ = u0_, u0_ = u1_;
        X1_ = cache::dct2(R.to(torch::kFloat)), u1_ = u;
        F1_ = R;
        e0_ = e1_, e1_ = e;
        out = tr.head(tok);
    } else {
        out = freq_reuse_output(tr, tok, h1, u, rec);
    }
    freq_plan_skips(e, u, step, out, rec);
    return out;
}

void DitCacheController::freq_plan_skips(const Tensor& e, double u, int step, const Tensor& out,
                                         const CacheStepLog& rec) {
    const auto& p = std::get<FreqParams>(cfg_.params);
    reuse_run_ = rec.full ? 0 : reuse_run_ + 1;
    const int since = probe_step_ >= 0 ? step - probe_step_ : 1;
    probe_step_ = step;
    out0_ = out1_, out_u0_ = out_u1_;
    out1_ = out, out_u1_ = u;
    skip_left_ = 0;
    if (p.skip <= 0 || !out0_.defined() || out_u1_ == out_u0_) return;
    cache::DitSkipSignals s;
    s.step = step, s.num_steps = num_steps_, s.reuse_run = reuse_run_;
    s.accumulated = rec.full ? 0.0 : dct_->accumulated();
    s.rate = rec.energy_change / double(std::max(since, 1));
    // The probe's drift at this step: 0 at a full step (its energies are the forecast's newest point); at a reuse
    // step as the drift rule measures it, NaN where the last two full steps do not give a forecast yet.
    s.drift = rec.full ? 0.0 : std::nan("");
    if (!rec.full && e1_.defined() && e0_.defined() && u1_ != u0_)
        s.drift = dit_largest_drift(e, e1_ + (e1_ - e0_) * ((u - u1_) / (u1_ - u0_)), images_);
    skip_left_ = cache::dit_skip_steps(p.skip, p.thr, p.skip_drift, p.max_reuse, s);
}

Tensor DitCacheController::freq_reuse_output(SD3Transformer2DModelImpl& tr, SD3Tokens& tok, const Tensor& h1, double u,
                                             CacheStepLog& rec) {
    const auto& p = std::get<FreqParams>(cfg_.params);
    // Reuse: R forecast from the last full steps' spectra (anchored coefficients kept, the others extrapolated).
    Tensor F = F1_;
    rec.anchored_fraction = 1;
    if (p.extrapolate && X0_.defined() && u1_ != u0_) {
        double frac = 1;
        const auto slope = FreqAnchorDenoiser::extrapolation_slope(X1_, X0_, u1_, u0_, p.tau, &frac);
        Tensor curv;
        if (p.order == 2 && X00_.defined() && u0_ != u00_ && u1_ != u00_)
            curv = FreqAnchorDenoiser::extrapolation_curvature(X1_, X0_, X00_, u1_, u0_, u00_, p.tau);
        F = FreqAnchorDenoiser::extrapolate_feature(F1_, slope, u - u1_, curv);
        rec.anchored_fraction = frac;
    }
    tok.hs = h1 + dit_grid_to_tokens(F).to(h1.scalar_type());
    return tr.head(tok);
}

Tensor DitCacheController::linear_output_forecast(const Tensor& o1, const Tensor& o0, double u1, double u0, double u) {
    return o1 + (o1 - o0) * ((u - u1) / (u1 - u0));
}

Tensor DitCacheController::forward_fbcache(SD3Transformer2DModelImpl& tr, SD3Tokens& tok, int step,
                                           CacheStepLog& rec) {
    const Tensor h0 = tok.hs;
    tr.run_blocks(tok, 1);
    const Tensor h1 = tok.hs, r1 = h1 - h0;
    const double change = ref_r1_.defined() ? relative_l1(r1, ref_r1_) : std::nan("");
    rec.energy_change = std::isnan(change) ? 0 : change;
    auto d = fb_->decide(step, change);
    if (d.action == cache::Action::Reuse && !residual_.defined()) d = {cache::Action::Full, {}, "store"};
    rec.full = d.action == cache::Action::Full;
    rec.why = d.why;
    if (rec.full) {
        tr.run_blocks(tok, int(tr.blocks.size()));
        residual_ = tok.hs - h1;
        ref_r1_ = r1;
    } else {
        tok.hs = h1 + residual_;
    }
    return tr.head(tok);
}

Tensor DitCacheController::forward_teacache(SD3Transformer2DModelImpl& tr, SD3Tokens& tok, int step,
                                            CacheStepLog& rec) {
    const Tensor mod = tr.first_block_modulated_input(tok);
    const double change = prev_mod_.defined() ? relative_l1(mod, prev_mod_) : 0;
    prev_mod_ = mod; // TeaCache compares consecutive steps, computed or not
    rec.energy_change = change;
    auto d = tea_->decide(step, num_steps_, change);
    rec.accumulated = tea_->accumulated();
    if (d.action == cache::Action::Reuse && !residual_.defined()) d = {cache::Action::Full, {}, "store"};
    rec.full = d.action == cache::Action::Full;
    rec.why = d.why;
    const Tensor h0 = tok.hs;
    if (rec.full) {
        if (std::string(d.why) == "store") tea_->reset();
        tr.run_blocks(tok, int(tr.blocks.size()));
        residual_ = tok.hs - h0;
    } else {
        tok.hs = h0 + residual_;
    }
    return tr.head(tok);
}

Tensor DitCacheController::forward_taylorseer(SD3Transformer2DModelImpl& tr, SD3Tokens& tok, int step,
                                              CacheStepLog& rec) {
    const auto& p = std::get<TaylorSeerParams>(cfg_.params);
    auto d = seer_->decide(step);
    if (d.action == cache::Action::Reuse && taylor_.empty()) d = {cache::Action::Full, {}, "store"};
    rec.full = d.action == cache::Action::Full;
    rec.why = d.why;
    const Tensor h0 = tok.hs;
    if (rec.full) {
        tr.run_blocks(tok, int(tr.blocks.size()));
        const auto R = (tok.hs - h0).to(torch::kFloat);
        taylor_ = taylor_update(R, taylor_, taylor_step_ < 0 ? 1.0 : double(step - taylor_step_), p.order);
        taylor_step_ = step;
    } else {
        rec.forecast = true;
        tok.hs = h0 + taylor_forecast(taylor_, double(step - taylor_step_)).to(h0.scalar_type());
    }
    return tr.head(tok);
}

int DitCacheController::full_steps() const {
    int n = 0;
    for (const auto& r : log_) n += r.full ? 1 : 0;
    return n;
}

nlohmann::json DitCacheController::log_json() const {
    nlohmann::json steps = nlohmann::json::array();
    double ms = 0;
    for (const auto& r : log_) {
        steps.push_back({{"step", r.step},
                         {"full", r.full},
                         {"why", r.why},
                         {"change", r.energy_change},
                         {"accumulated", r.accumulated},
                         {"anchored_fraction", r.anchored_fraction},
                         {"drift", r.drift},
                         {"forecast", r.forecast},
                         {"noise_level", r.noise_level},
                         {"ms", r.ms}});
        ms += r.ms;
    }
    return {{"mode", cfg_.label},     {"resolved", cfg_.canonical()},     {"kind", cfg_.name()},
            {"params", cfg_.params_json()}, {"full_steps", full_steps()}, {"total_steps", log_.size()},
            {"transformer_ms", ms},   {"steps", steps}};
}

double DitCacheController::relative_l1(const Tensor& a, const Tensor& ref) {
    const auto x = a.to(torch::kFloat64), r = ref.to(torch::kFloat64);
    return ((x - r).abs().mean() / r.abs().mean()).item<double>();
}

std::vector<Tensor> DitCacheController::taylor_update(const Tensor& f, const std::vector<Tensor>& old,
                                                      double distance, int order) {
    std::vector<Tensor> d = {f};
    for (int i = 0; i < order && size_t(i) < old.size() && distance > 0; ++i) d.push_back((d[size_t(i)] - old[size_t(i)]) / distance);
    return d;
}

Tensor DitCacheController::taylor_forecast(const std::vector<Tensor>& d, double h) {
    const auto w = cache::TaylorSeerRule::weights(h, int(d.size()));
    Tensor out = d[0].clone();
    for (size_t i = 1; i < d.size(); ++i) out = out + d[i] * w[i];
    return out;
}

} // namespace anchor::unet
