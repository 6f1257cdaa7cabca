// The cache modes' key tables, presets and parser (see cache_config.h).
#include "unet/cache/cache_config.h"

#include "cache/io/error.h"
#include "cache/modes/mode_list.h"
#include "unet/cache/deepcache.h"
#include "unet/cache/dit_cache_config.h"
#include "unet/cache/freq_cache.h"
#include "unet/model/unet_model.h"

#include <limits>
#include <stdexcept>

namespace anchor::unet {

namespace mode_keys = cache::modes;

namespace {

constexpr double kCacheKeyInf = std::numeric_limits<double>::infinity();
// The most skip connections of a supported UNet (SD 1.x/2.x: conv_in, 8 down layers, 3 downsamplers); the model at
// hand may have fewer (check_cache_config).
constexpr int kCacheMaxBranch = 11;
constexpr int kCacheMaxCount = 100000; // counts of steps: far past any schedule a server or the CLI accepts

std::string cache_forms() {
    std::string s;
    for (const auto& m : cache_mode_table()) s += (s.empty() ? "" : ", ") + std::string(m.syntax);
    for (const auto& [name, keys] : freq_presets()) s += ", freq:" + name;
    return s;
}

[[noreturn]] void bad_cache_mode(const std::string& field, const std::string& text, const std::string& why) {
    throw ParamError(field, "invalid cache mode '" + text + "': " + why + " (modes: " + cache_forms() +
                                "; `--cache help` lists every key)");
}

// Applies `items` with a table, the table's one-line errors prefixed by the mode.
template <class P>
void apply_mode_keys(const std::vector<mode_keys::ModeKey<P>>& table, P& p, const std::string& items, const std::string& mode,
           const std::string& field, const std::string& text) {
    try {
        mode_keys::apply_keys(table, p, items);
    } catch (const std::invalid_argument& e) {
        bad_cache_mode(field, text, mode + " " + e.what());
    }
}

} // namespace

// ---- tables ---------------------------------------------------------------------------------------------------------

const std::vector<CacheModeInfo>& cache_mode_table() {
    static const std::vector<CacheModeInfo> t = {
        {CacheKind::Off, "off", "off", "full UNet at every step"},
        {CacheKind::DeepCache, "deepcache", "deepcache:N[,branch=B]",
         "DeepCache uniform: full UNet every N steps, the shallow path of skip branch B in between"},
        {CacheKind::Freq, "freq", "freq[:tau=T,thr=A,...]",
         "frequency-anchored deep-feature cache: a full step when the shallow probe's low-band DCT energy change "
         "accumulates past thr or its forecast drifts; the cached feature's stable coefficients reused, the others "
         "forecast along the timestep"},
        {CacheKind::FbCache, "fbcache", "fbcache[:thr=T,...]",
         "SD 3 / 3.5: First-Block Cache, the remaining blocks reused while the first block's residual moves less than "
         "thr"},
        {CacheKind::TeaCache, "teacache", "teacache[:thr=T,...]",
         "SD 3 / 3.5: TeaCache, every block reused while the accumulated rescaled change of the first block's "
         "modulated input stays below thr"},
        {CacheKind::TaylorSeer, "taylorseer", "taylorseer[:interval=N,...]",
         "SD 3 / 3.5: TaylorSeer, the blocks every N steps, their residual forecast by a Taylor series in between"},
    };
    return t;
}

const std::vector<mode_keys::ModeKey<DeepCacheParams>>& deepcache_keys() {
    using P = DeepCacheParams;
    static const std::vector<mode_keys::ModeKey<P>> t = [] {
        std::vector<mode_keys::ModeKey<P>> k = {
            mode_keys::integer_key("interval", &P::interval, 1, kCacheMaxCount,
                               "a full UNet step every N steps (written first, without the key: deepcache:3)", false),
            mode_keys::integer_key("branch", &P::branch, 0, kCacheMaxBranch,
                               "the skip connection whose up-path input is cached; 0 is the shallowest (fastest reuse); "
                               "the model may have fewer",
                               false),
        };
        k[1].shown = [](const P& p) { return p.branch != 0; };
        return k;
    }();
    return t;
}

const std::vector<mode_keys::ModeKey<FreqParams>>& freq_keys() {
    using P = FreqParams;
    static const std::vector<mode_keys::ModeKey<P>> t = [] {
        std::vector<mode_keys::ModeKey<P>> k = {
            mode_keys::number_key("tau", &P::tau, 0, kCacheKeyInf,
                              "a cached coefficient whose energy change rate between the last two full steps is below "
                              "tau is reused as it is; the others are forecast",
                              true),
            mode_keys::number_key("thr", &P::thr, 0, kCacheKeyInf,
                              "a full step once the probe's accumulated low-band energy change reaches thr (lower: "
                              "more full steps)",
                              false, true),
            mode_keys::integer_key("max", &P::max_reuse, 0, kCacheMaxCount, "at most this many reuse steps in a row", true,
                               true, -1),
            mode_keys::number_key("span", &P::span, 0, kCacheKeyInf,
                              "a full step once ln sigma has fallen by this share of the loop's log-sigma range since "
                              "the last one (0: no bound)",
                              false),
            mode_keys::integer_key("band", &P::band, 1, 64, "the probe's low band u + v < band of the DCT", true),
            mode_keys::choice_key("extrapolate", &P::extrapolate, "1", "0",
                              "forecast the moving coefficients along the timestep (0: reuse the feature as it is)",
                              true, true),
            mode_keys::integer_key("order", &P::order, 1, 2, "forecast order: 1 linear, 2 TaylorSeer's second-order term",
                               true),
            mode_keys::number_key("drift", &P::drift, 0, kCacheKeyInf,
                              "a full step when some image's probe leaves its own forecast by more than this relative "
                              "residual (0: off; lower: safer, slower)",
                              false),
            mode_keys::integer_key("branch", &P::branch, 0, kCacheMaxBranch,
                               "the DeepCache branch of the cached feature; the model may have fewer", true),
            mode_keys::choice_key("probe", &P::probe_det, "det", "raw",
                              "det: decide on the input less the sampler's injected noise (Euler a, DDIM eta > 0)",
                              true),
            mode_keys::choice_key("correct", &P::correct, "1", "0",
                              "scale each image's forecast by the share of its own forecast the probe moved", true,
                              true),
            mode_keys::integer_key("skip", &P::skip, 0, kCacheMaxCount,
                               "up to N reuse steps in a row run no UNet layer (the output forecast; 0: off)", false),
            mode_keys::number_key("skipdrift", &P::skip_drift, 0, kCacheKeyInf,
                              "an output forecast only while the probe's drift is below this (0: no bound)", true),
            mode_keys::number_key("noise", &P::noise, 0, kCacheKeyInf,
                              "under injected noise, a full step once the noise since the last one reaches this share "
                              "of the noise level (0: off)",
                              true),
            mode_keys::number_key("noiseskip", &P::noise_skip, 0, kCacheKeyInf,
                              "under injected noise, a reuse step below this share holds the last denoised estimate "
                              "(0: off)",
                              true),
            mode_keys::number_key("lastsigma", &P::last_sigma, 0, kCacheKeyInf,
                              "the last step is full when its noise level is at least this, else a reuse (0: always "
                              "full)",
                              true),
            mode_keys::choice_key("last", &P::last, "1", "0", "0: the last step follows the rules like any other", true,
                              true),
            mode_keys::choice_key("attn", &P::attn_reuse, "reuse", "run",
                              "reuse: a shallow reuse step adds its attention layers' cached residuals instead of "
                              "running them (not under injected noise)",
                              true),
            mode_keys::integer_key("attnmax", &P::attn_max, 0, kCacheMaxCount,
                               "at most N shallow steps in a row reuse the attention residuals", true, true, -1),
            mode_keys::choice_key("decide", &P::per_image, "image", "batch",
                              "batch: one decision per step for a batch of images; image: each image alone (it comes "
                              "out as it would alone)",
                              false),
            mode_keys::choice_key("forecast", &P::forecast_denoised, "denoised", "output",
                              "what a step that runs no UNet layer forecasts: denoised: the denoised estimate x0, "
                              "turned into the output at the step's input; output: the model output (under injected "
                              "noise: x0 held)",
                              true),
            mode_keys::choice_key("noisepass", &P::noise_wiener, "wiener", "hold",
                              "under injected noise, what a reuse step lets of the noise since its last computed step "
                              "into the denoised estimate: wiener: each DCT coefficient's Wiener share; hold: none",
                              true),
            mode_keys::choice_key("shallowin", &P::shallow_det, "det", "raw",
                              "with probe=det, a shallow reuse step's input under injected noise: det: less the noise "
                              "since the last full step, its effect added back; raw: the step's own input",
                              true),
            mode_keys::choice_key("noisedrift", &P::noise_drift, "1", "0",
                              "with probe=det, the drift rule applies under injected noise too (on the input less the "
                              "noise)",
                              true),
            mode_keys::choice_key("noiserule", &P::noise_passed_rule, "passed", "all",
                              "what the noise rule measures: all: the noise injected since the last full step; "
                              "passed: its part the denoiser keeps (the Wiener share of the last estimate)",
                              true),
            mode_keys::choice_key("lastfc", &P::last_forecast, "1", "0",
                              "a reused last step extrapolates the denoised estimate of the two steps before it in ln "
                              "sigma, running no UNet layer",
                              true),
            mode_keys::number_key("target", &P::target, 0, 200,
                              "a quality target in dB of PSNR against the uncached image (about 95 % of images reach "
                              "it): thr, drift and skipdrift are scaled to it from their values (0: none)",
                              false),
            mode_keys::number_key("guard", &P::guard, 0, kCacheKeyInf,
                              "the per-image safety net: once the drift residuals of an image's reuse steps sum past "
                              "this, its remaining steps are full (0: off)",
                              true),
        };
        auto profile = mode_keys::make_key<P>("profile", "a file",
                                              "an anchor profile (anchor-sd calibrate) setting thr per range of steps",
                                              false);
        profile.set = [](P& p, const std::string& v) {
            if (v.empty()) throw mode_keys::BadKeyValue("must be a file, got ''");
            p.profile = v;
            p.profile_data = cache::AnchorProfile::load(v); // anchor::Error naming the file
            if (!p.profile_data.has_step_ranges())
                throw Error("anchor profile '" + v + "' has no step ranges (write one with anchor-sd calibrate)");
        };
        profile.get = [](const P& p) { return p.profile; };
        profile.json = [](const P& p) { return p.profile.empty() ? nlohmann::json() : nlohmann::json(p.profile); };
        profile.shown = [](const P& p) { return !p.profile.empty(); };
        k.push_back(profile);
        for (auto& key : k) {
            if (key.name == "last") key.shown = [](const P& p) { return !p.last; };
            if (key.name == "attnmax") key.shown = [](const P& p) { return p.attn_reuse; };
            if (key.name == "decide") key.shown = [](const P& p) { return p.per_image; };
            if (key.name == "guard") key.shown = [](const P& p) { return p.guard > 0; };
            if (key.name == "target") key.shown = [](const P& p) { return p.target > 0; };
            if (key.name == "noisepass") key.shown = [](const P& p) { return p.noise_wiener; };
            if (key.name == "shallowin") key.shown = [](const P& p) { return !p.shallow_det; };
            if (key.name == "noisedrift") key.shown = [](const P& p) { return p.noise_drift; };
            if (key.name == "lastfc") key.shown = [](const P& p) { return p.last_forecast; };
            if (key.name == "noiserule") key.shown = [](const P& p) { return p.noise_passed_rule; };
            if (key.name == "forecast") key.shown = [](const P& p) { return p.forecast_denoised != P{}.forecast_denoised; };
        }
        return k;
    }();
    return t;
}

// Chosen from one interleaved run that changed only `drift` (tests/bench/results/eval_cache_2026-12-04c/README.md,
// section 1); docs/caching.md quotes the figures.
const std::vector<std::pair<std::string, std::string>>& freq_presets() {
    static const std::vector<std::pair<std::string, std::string>> t = {{"fast", "drift=0.4"},
                                                                        {"quality", "drift=0.3"}};
    return t;
}

std::string FreqParams::describe() const {
    return "freq:" + mode_keys::keys_string(freq_keys(), *this);
}

std::string cache_mode_help() {
    std::string s;
    for (const auto& m : cache_mode_table()) s += std::string("  ") + m.syntax + "  -  " + m.help + "\n";
    return s;
}

std::string cache_help() {
    std::string s = "cache modes:\n" + cache_mode_help() + "freq presets:\n  freq  -  the defaults\n";
    for (const auto& [name, keys] : freq_presets()) s += "  freq:" + name + "  -  freq:" + keys + "\n";
    s += "freq keys (freq:key=value,...; after a preset: freq:fast,key=value):\n" +
         mode_keys::keys_help(freq_keys(), FreqParams{});
    s += "deepcache keys:\n" + mode_keys::keys_help(deepcache_keys(), DeepCacheParams{});
    s += dit_cache_help();
    return s;
}

nlohmann::json cache_keys_json() {
    nlohmann::json out = nlohmann::json::array();
    auto add = [&](const char* mode, const auto& table, const auto& defaults) {
        for (const auto& k : table)
            out.push_back({{"mode", mode},
                           {"key", k.name},
                           {"values", k.values},
                           {"default", k.get(defaults)},
                           {"advanced", k.advanced}});
    };
    add("deepcache", deepcache_keys(), DeepCacheParams{});
    add("freq", freq_keys(), FreqParams{});
    add_dit_cache_keys_json(out);
    return out;
}

std::string cache_docs_tables() {
    std::string s = "| preset | keys |\n|---|---|\n| `freq` | the defaults below |\n";
    for (const auto& [name, keys] : freq_presets()) s += "| `freq:" + name + "` | `" + keys + "` |\n";
    s += "\n" + mode_keys::keys_markdown(freq_keys(), FreqParams{}, false);
    s += "\n" + mode_keys::keys_markdown(freq_keys(), FreqParams{}, true);
    s += "\n" + mode_keys::keys_markdown(deepcache_keys(), DeepCacheParams{}, false);
    s += dit_cache_docs_tables();
    return s;
}

// ---- configurations -------------------------------------------------------------------------------------------------

const char* CacheConfig::name() const {
    return cache_mode_table()[params.index()].name;
}

std::string CacheConfig::canonical() const {
    if (const auto* d = std::get_if<DeepCacheParams>(&params))
        return "deepcache:" + std::to_string(d->interval) + (d->branch ? ",branch=" + std::to_string(d->branch) : "");
    if (const auto* f = std::get_if<FreqParams>(&params)) return f->describe();
    if (const auto* b = std::get_if<FbCacheParams>(&params)) return "fbcache:" + mode_keys::keys_string(fbcache_keys(), *b);
    if (const auto* t = std::get_if<TeaCacheParams>(&params))
        return "teacache:" + mode_keys::keys_string(teacache_keys(), *t);
    if (const auto* t = std::get_if<TaylorSeerParams>(&params))
        return "taylorseer:" + mode_keys::keys_string(taylorseer_keys(), *t);
    return "off";
}

nlohmann::json CacheConfig::params_json() const {
    if (const auto* d = std::get_if<DeepCacheParams>(&params)) return mode_keys::keys_json(deepcache_keys(), *d);
    if (const auto* f = std::get_if<FreqParams>(&params)) return mode_keys::keys_json(freq_keys(), *f);
    if (const auto* b = std::get_if<FbCacheParams>(&params)) return mode_keys::keys_json(fbcache_keys(), *b);
    if (const auto* t = std::get_if<TeaCacheParams>(&params)) return mode_keys::keys_json(teacache_keys(), *t);
    if (const auto* t = std::get_if<TaylorSeerParams>(&params)) return mode_keys::keys_json(taylorseer_keys(), *t);
    return nlohmann::json::object();
}

int CacheConfig::branch() const {
    if (const auto* d = std::get_if<DeepCacheParams>(&params)) return d->branch;
    if (const auto* f = std::get_if<FreqParams>(&params)) return f->branch;
    return 0;
}

CacheConfig parse_cache_config(const std::string& text, const std::string& field) {
    const auto colon = text.find(':');
    const std::string head = text.substr(0, colon);
    const std::string rest = colon == std::string::npos ? "" : text.substr(colon + 1);
    const CacheModeInfo* info = nullptr;
    for (const auto& m : cache_mode_table())
        if (head == m.name) info = &m;
    if (!info) bad_cache_mode(field, text, "unknown mode '" + head + "'");
    if (colon != std::string::npos && rest.empty()) bad_cache_mode(field, text, "empty parameter list after ':'");
    CacheConfig c;
    c.label = text;
    switch (info->kind) {
    case CacheKind::Off:
        if (colon != std::string::npos) bad_cache_mode(field, text, "'off' takes no parameters");
        c.params = OffParams{};
        break;
    case CacheKind::DeepCache: {
        if (rest.empty()) bad_cache_mode(field, text, "deepcache needs an interval N (deepcache:3)");
        DeepCacheParams d;
        // The interval comes first, without its key.
        const std::string items = rest.find('=') < rest.find(',') ? rest : "interval=" + rest;
        if (items.rfind("interval=", 0) != 0) bad_cache_mode(field, text, "deepcache needs an interval N first");
        apply_mode_keys(deepcache_keys(), d, items, "deepcache", field, text);
        c.params = d;
        break;
    }
    case CacheKind::Freq: {
        FreqParams p;
        std::string items = rest;
        // A preset first ("freq:fast" or "freq:fast,thr=0.6"): its keys, then the user's, which override them.
        const std::string first = items.substr(0, items.find(','));
        if (!first.empty() && first.find('=') == std::string::npos) {
            const std::string* keys = nullptr;
            std::string names;
            for (const auto& [name, k] : freq_presets()) {
                if (name == first) keys = &k;
                names += (names.empty() ? "" : ", ") + name;
            }
            if (!keys) bad_cache_mode(field, text, "'" + first + "' is neither a freq preset (" + names + ") nor key=value");
            apply_mode_keys(freq_keys(), p, *keys, "freq", field, text);
            if (items.size() > first.size() && items.size() == first.size() + 1)
                bad_cache_mode(field, text, "empty key list after the preset");
            items = items.size() > first.size() ? items.substr(first.size() + 1) : "";
        }
        if (!items.empty()) apply_mode_keys(freq_keys(), p, items, "freq", field, text);
        c.params = std::move(p);
        break;
    }
    case CacheKind::FbCache: {
        FbCacheParams p;
        if (!rest.empty()) apply_mode_keys(fbcache_keys(), p, rest, "fbcache", field, text);
        c.params = p;
        break;
    }
    case CacheKind::TeaCache: {
        TeaCacheParams p;
        if (!rest.empty()) apply_mode_keys(teacache_keys(), p, rest, "teacache", field, text);
        c.params = p;
        break;
    }
    case CacheKind::TaylorSeer: {
        TaylorSeerParams p;
        if (!rest.empty()) apply_mode_keys(taylorseer_keys(), p, rest, "taylorseer", field, text);
        c.params = p;
        break;
    }
    }
    return c;
}

std::vector<CacheConfig> parse_cache_list(const std::string& list, const std::string& field) {
    return parse_cache_list(std::vector<std::string>{list}, field);
}

std::vector<CacheConfig> parse_cache_list(const std::vector<std::string>& lists, const std::string& field) {
    std::vector<CacheConfig> out;
    for (const auto& m : mode_keys::split_mode_lists(lists, field)) out.push_back(parse_cache_config(m, field));
    return out;
}

void check_cache_config(const CacheConfig& c, const UNet2DConditionModelImpl& unet, const std::string& field) {
    if (c.kind() == CacheKind::Off) return;
    if (c.kind() != CacheKind::DeepCache && c.kind() != CacheKind::Freq)
        throw ParamError(field, "cache mode '" + c.label + "' applies to SD 3 / 3.5 (MMDiT) models only, not to a UNet");
    const int n = unet.num_skips();
    if (c.branch() >= n)
        throw ParamError(field, "invalid cache mode '" + c.label + "': this UNet has " + std::to_string(n) +
                                    " skip connections: branch must be an integer in [0, " + std::to_string(n - 1) +
                                    "], got " + std::to_string(c.branch()));
}

std::unique_ptr<CacheController> make_cache_controller(const CacheConfig& c) {
    std::unique_ptr<CacheController> ctl;
    if (const auto* d = std::get_if<DeepCacheParams>(&c.params))
        ctl = std::make_unique<DeepCacheDenoiser>(d->interval, d->branch);
    else if (const auto* f = std::get_if<FreqParams>(&c.params))
        ctl = std::make_unique<FreqAnchorDenoiser>(*f);
    else if (c.kind() != CacheKind::Off)
        throw ParamError("cache", "cache mode '" + c.label + "' applies to SD 3 / 3.5 (MMDiT) models only, not to a UNet");
    else
        ctl = std::make_unique<DeepCacheDenoiser>(0, 0);
    ctl->set_label(c.label);
    return ctl;
}

std::unique_ptr<CacheController> parse_cache_mode(const std::string& spec) {
    return make_cache_controller(parse_cache_config(spec));
}

} // namespace anchor::unet
