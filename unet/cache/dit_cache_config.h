// The key tables of the diffusion-transformer cache modes (fbcache, teacache, taylorseer; their parameters:
// unet/cache/dit_cache_params.h), and which modes and freq keys apply to SD 3 / 3.5's MMDiT. cache_config.cpp parses
// the modes with these tables; `--cache help` and docs/caching.md list them.
#pragma once

#include "cache/modes/key_table.h"
#include "unet/cache/cache_config.h"
#include "unet/cache/dit_cache_params.h"

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace anchor::unet {

const std::vector<cache::modes::ModeKey<FbCacheParams>>& fbcache_keys();
const std::vector<cache::modes::ModeKey<TeaCacheParams>>& teacache_keys();
const std::vector<cache::modes::ModeKey<TaylorSeerParams>>& taylorseer_keys();

// The three modes' help lines (cache_help), key tables (cache_docs_tables) and keys as JSON (cache_keys_json).
std::string dit_cache_help();
std::string dit_cache_docs_tables();
void add_dit_cache_keys_json(nlohmann::json& out);

// Whether a mode runs on SD 3 / 3.5's transformer: off, freq, fbcache, teacache, taylorseer (not deepcache, which
// caches a UNet's skip branch).
bool cache_applies_to_dit(CacheKind k);
// The freq keys the transformer's freq implements (thr, tau, max, span, band, extrapolate, order, drift, skip,
// skipdrift, last, lastsigma); the others (UNet-specific: branch, attn, skip, probe, noise, ...) refused when set to a value other than
// their default. ParamError(field) naming the mode and what does not apply.
void check_dit_cache_config(const CacheConfig& c, const std::string& field = "cache");

// freq's defaults on the transformer: FreqParams{} (the UNet's, unchanged) with the keys the MMDiT demo model's tuning
// chose (docs/caching.md, "freq on a transformer"): its probe changes less per step than conv_in's, and a reuse step
// there costs a block where the UNet's costs its shallow path.
FreqParams dit_freq_defaults();
// The keys whose transformer default differs from the UNet's, as "key=value,..." (the docs table and --cache help).
std::string dit_freq_default_keys();
// The configuration the transformer runs: for freq, the keys the user wrote (a preset's, then the list's, read back
// from the label as the parser reads them) over dit_freq_defaults(), so `freq` and `freq:thr=0.2` take the DiT
// defaults for the keys they do not name. A configuration that its label does not parse back to (one built in code)
// runs as given. Other modes unchanged.
CacheConfig resolve_dit_cache_config(const CacheConfig& c);

} // namespace anchor::unet
