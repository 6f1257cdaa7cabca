// Key tables of the diffusion-transformer cache modes (see dit_cache_config.h).
#include "unet/cache/dit_cache_config.h"

#include "cache/io/error.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

namespace anchor::unet {

namespace dit_keys = cache::modes;

namespace {
constexpr double kDitKeyInf = std::numeric_limits<double>::infinity();
constexpr int kDitMaxCount = 100000;

std::string dit_coef_string(const std::vector<double>& c) {
    std::string s;
    for (double v : c) { // every digit the default coefficients have, so that the string reads back the same
        char b[32];
        std::snprintf(b, sizeof(b), "%.10g", v);
        s += (s.empty() ? "" : "/") + std::string(b);
    }
    return s;
}
} // namespace

const std::vector<dit_keys::ModeKey<FbCacheParams>>& fbcache_keys() {
    using P = FbCacheParams;
    static const std::vector<dit_keys::ModeKey<P>> t = [] {
        std::vector<dit_keys::ModeKey<P>> k = {
            dit_keys::number_key("thr", &P::thr, 0, kDitKeyInf,
                                 "the remaining blocks are reused while the first block's residual moved by less than "
                                 "thr (relative L1) since the last computed step (0: never)",
                                 false),
            dit_keys::integer_key("max", &P::max_reuse, 0, kDitMaxCount, "at most this many reuse steps in a row",
                                  false, true, -1),
            dit_keys::integer_key("warmup", &P::warmup, 0, kDitMaxCount, "the first N steps always computed", false),
        };
        return k;
    }();
    return t;
}

const std::vector<dit_keys::ModeKey<TeaCacheParams>>& teacache_keys() {
    using P = TeaCacheParams;
    static const std::vector<dit_keys::ModeKey<P>> t = [] {
        std::vector<dit_keys::ModeKey<P>> k = {
            dit_keys::number_key("thr", &P::thr, 0, kDitKeyInf,
                                 "every block is reused while the accumulated rescaled change of the first block's "
                                 "modulated input stays below thr (0: never)",
                                 false),
        };
        auto coef = dit_keys::make_key<P>("coef", "numbers separated by /, highest degree first",
                                          "the rescale polynomial of the relative L1 change (default: TeaCache's "
                                          "FLUX.1 coefficients)",
                                          false);
        coef.set = [](P& p, const std::string& v) {
            std::vector<double> c;
            size_t a = 0;
            while (a <= v.size()) {
                const size_t b = std::min(v.find('/', a), v.size());
                c.push_back(dit_keys::parse_number(v.substr(a, b - a), "numbers separated by /"));
                a = b + 1;
            }
            if (c.size() > 12) throw dit_keys::BadKeyValue("must have at most 12 coefficients, got " + std::to_string(c.size()));
            p.coefficients = c;
        };
        coef.get = [](const P& p) { return dit_coef_string(p.coefficients); };
        coef.json = [](const P& p) { return nlohmann::json(p.coefficients); };
        coef.shown = [](const P& p) { return p.coefficients != TeaCacheParams{}.coefficients; };
        k.push_back(coef);
        return k;
    }();
    return t;
}

const std::vector<dit_keys::ModeKey<TaylorSeerParams>>& taylorseer_keys() {
    using P = TaylorSeerParams;
    static const std::vector<dit_keys::ModeKey<P>> t = {
        dit_keys::integer_key("interval", &P::interval, 1, kDitMaxCount,
                              "the blocks run every N steps; in between their residual is forecast (1: every step)",
                              false),
        dit_keys::integer_key("order", &P::order, 1, 2,
                              "the forecast's Taylor order: 1 linear, 2 with the second-order term", false),
        dit_keys::integer_key("warmup", &P::warmup, 0, kDitMaxCount, "the first N steps always computed", false),
    };
    return t;
}

FreqParams dit_freq_defaults() {
    FreqParams p;
    // The first block's probe changes less per step than conv_in's, so the accumulated change needs a lower bound
    // (chosen on the MMDiT demo model: docs/caching.md, "How the defaults were chosen"). skip and skipdrift keep the
    // UNet's values, written out because they are what makes the transformer's reuse cheap: a skip step runs no block.
    p.thr = 0.12;
    p.skip = 1;
    p.skip_drift = 0.35;
    return p;
}

std::string dit_freq_default_keys() {
    const FreqParams unet, dit = dit_freq_defaults();
    std::string s;
    for (const auto& k : freq_keys())
        if (k.get(dit) != k.get(unet)) s += (s.empty() ? "" : ",") + k.name + "=" + k.get(dit);
    return s;
}

CacheConfig resolve_dit_cache_config(const CacheConfig& c) {
    if (!std::holds_alternative<FreqParams>(c.params)) return c;
    try {
        if (parse_cache_config(c.label).canonical() != c.canonical()) return c; // built in code: as given
    } catch (const std::exception&) {
        return c;
    }
    const auto colon = c.label.find(':');
    std::string items = colon == std::string::npos ? "" : c.label.substr(colon + 1);
    FreqParams p = dit_freq_defaults();
    const std::string first = items.substr(0, items.find(','));
    if (!first.empty() && first.find('=') == std::string::npos) { // a preset's keys first, as the parser applies them
        for (const auto& [name, keys] : freq_presets())
            if (name == first) dit_keys::apply_keys(freq_keys(), p, keys);
        items = items.size() > first.size() ? items.substr(first.size() + 1) : "";
    }
    if (!items.empty()) dit_keys::apply_keys(freq_keys(), p, items);
    CacheConfig out = c;
    out.params = std::move(p);
    return out;
}

std::string dit_cache_help() {
    return "freq on SD 3 / 3.5 (MMDiT): the keys above, with these defaults: " + dit_freq_default_keys() + "\n" +
           "fbcache keys (SD 3 / 3.5):\n" + dit_keys::keys_help(fbcache_keys(), FbCacheParams{}) +
           "teacache keys (SD 3 / 3.5):\n" + dit_keys::keys_help(teacache_keys(), TeaCacheParams{}) +
           "taylorseer keys (SD 3 / 3.5):\n" + dit_keys::keys_help(taylorseer_keys(), TaylorSeerParams{});
}

std::string dit_cache_docs_tables() {
    std::string freq = "\n| freq key on SD 3 / 3.5 (MMDiT) | UNet default | MMDiT default |\n|---|---|---|\n";
    const FreqParams unet, dit = dit_freq_defaults();
    for (const auto& k : freq_keys())
        if (k.get(dit) != k.get(unet)) freq += "| `" + k.name + "` | " + k.get(unet) + " | " + k.get(dit) + " |\n";
    return freq + "\n" + dit_keys::keys_markdown(fbcache_keys(), FbCacheParams{}, false) + "\n" +
           dit_keys::keys_markdown(teacache_keys(), TeaCacheParams{}, false) + "\n" + dit_keys::keys_markdown(taylorseer_keys(), TaylorSeerParams{}, false);
}

void add_dit_cache_keys_json(nlohmann::json& out) {
    auto add = [&](const char* mode, const auto& table, const auto& defaults) {
        for (const auto& k : table)
            out.push_back({{"mode", mode},
                           {"key", k.name},
                           {"values", k.values},
                           {"default", k.get(defaults)},
                           {"advanced", k.advanced}});
    };
    add("fbcache", fbcache_keys(), FbCacheParams{});
    add("teacache", teacache_keys(), TeaCacheParams{});
    add("taylorseer", taylorseer_keys(), TaylorSeerParams{});
}

bool cache_applies_to_dit(CacheKind k) {
    return k != CacheKind::DeepCache;
}

void check_dit_cache_config(const CacheConfig& c, const std::string& field) {
    if (!cache_applies_to_dit(c.kind()))
        throw ParamError(field, "cache mode '" + c.label +
                                    "' does not apply to SD 3 / 3.5 (MMDiT) models; their modes: off, freq, fbcache, "
                                    "teacache, taylorseer");
    const auto* f = std::get_if<FreqParams>(&c.params);
    if (!f) return;
    static const std::vector<std::string> dit_freq_keys = {"thr",   "tau",   "max",  "span", "band",     "extrapolate",
                                                           "order", "drift", "skip", "skipdrift", "last", "lastsigma"};
    const FreqParams d;
    std::string bad;
    for (const auto& k : freq_keys()) {
        if (std::find(dit_freq_keys.begin(), dit_freq_keys.end(), k.name) != dit_freq_keys.end()) continue;
        if (k.get(*f) != k.get(d)) bad += (bad.empty() ? "" : ", ") + k.name + "=" + k.get(*f);
    }
    if (!bad.empty())
        throw ParamError(field, "cache mode '" + c.label + "': freq on SD 3 / 3.5 (MMDiT) takes the keys thr, tau, "
                                                           "max, span, band, extrapolate, order, drift, skip, "
                                                           "skipdrift, last, lastsigma; not " +
                                    bad);
}

} // namespace anchor::unet
