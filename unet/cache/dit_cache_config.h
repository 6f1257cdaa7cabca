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
// The freq keys the transformer's freq implements (thr, tau, max, span, band, extrapolate, order, drift, last,
// lastsigma); the others (UNet-specific: branch, attn, skip, probe, noise, ...) refused when set to a value other than
// their default. ParamError(field) naming the mode and what does not apply.
void check_dit_cache_config(const CacheConfig& c, const std::string& field = "cache");

} // namespace anchor::unet
