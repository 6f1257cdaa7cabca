// The cache modes of anchor-sd as typed configurations, parsed once at the edge (the command line, a request field):
// jobs, servers and benches carry a CacheConfig, never a mode string. Each mode has one key table
// (cache/modes/key_table.h) that drives the parser, the canonical string, the JSON of the resolved parameters,
// `--cache help` and the tables of docs/caching.md. The presets `freq:fast` and `freq:quality` are key sets chosen
// from the measured speed/quality frontier (docs/caching.md cites the runs).
//
//   off                       every step runs the full UNet
//   deepcache:N[,branch=B]    DeepCache's uniform schedule (unet/cache/deepcache.h)
//   freq[:PRESET][,key=value,...] | freq:key=value,...   the frequency-anchored cache (unet/cache/freq_cache.h)
//   fbcache, teacache, taylorseer[:key=value,...]   the diffusion-transformer caches (SD 3 / 3.5 only;
//                                                   unet/cache/dit_cache.h, keys in unet/cache/dit_cache_config.h)
#pragma once

#include "cache/modes/key_table.h"
#include "unet/cache/dit_cache_params.h"
#include "unet/cache/freq_params.h"

#include <nlohmann/json.hpp>

#include <memory>
#include <string>
#include <variant>
#include <vector>

namespace anchor::unet {

class CacheController;
class UNet2DConditionModelImpl;

enum class CacheKind { Off, DeepCache, Freq, FbCache, TeaCache, TaylorSeer };

struct OffParams {};
struct DeepCacheParams {
    int interval = 3; // a full step every `interval` steps
    int branch = 0;   // the skip connection whose up-path input is cached (0: the shallowest)
};

struct CacheConfig {
    std::variant<OffParams, DeepCacheParams, FreqParams, FbCacheParams, TeaCacheParams, TaylorSeerParams> params;
    // The mode as the user wrote it ("freq", "freq:fast", "freq:thr=0.6"): what the grid, the timeline, the report
    // and the logs show. The resolved parameters are canonical() and params_json().
    std::string label = "off";

    CacheKind kind() const { return CacheKind(params.index()); }
    const char* name() const; // "off", "deepcache", "freq", "fbcache", "teacache", "taylorseer"
    std::string canonical() const;
    nlohmann::json params_json() const;
    int branch() const; // the DeepCache branch the mode caches (0 for off)
};

// Mode table: kind <-> name and the accepted syntax (drives --help and error messages).
struct CacheModeInfo {
    CacheKind kind;
    const char* name;
    const char* syntax;
    const char* help;
};
const std::vector<CacheModeInfo>& cache_mode_table();

// The key tables (one per mode with keys) and freq's presets (name -> the keys it sets).
const std::vector<cache::modes::ModeKey<DeepCacheParams>>& deepcache_keys();
const std::vector<cache::modes::ModeKey<FreqParams>>& freq_keys();
const std::vector<std::pair<std::string, std::string>>& freq_presets();

// The modes, presets and keys (`--cache help`), from the tables; cache_mode_help() is its first part (one line a mode).
std::string cache_help();
std::string cache_mode_help();
// Every key of every mode as JSON ({mode, key, values, default, advanced}): a server's /sdapi/v1/options lists them.
nlohmann::json cache_keys_json();
// The Markdown tables docs/caching.md holds (presets, freq's keys, freq's advanced keys, deepcache's keys).
std::string cache_docs_tables();

// Parses a mode. A malformed one throws ParamError(field) with one line: the mode, the key and its range, and the
// forms (never the whole help). Reads a profile=FILE here.
CacheConfig parse_cache_config(const std::string& text, const std::string& field = "cache");
// A list (cache/modes/mode_list.h: ';' or ',' separated; repeatable options give several lists), every mode parsed.
std::vector<CacheConfig> parse_cache_list(const std::string& list, const std::string& field = "compare");
std::vector<CacheConfig> parse_cache_list(const std::vector<std::string>& lists, const std::string& field = "compare");

// What a mode asks of the model, checked before any work: the branch exists in this UNet. ParamError(field).
void check_cache_config(const CacheConfig& c, const UNet2DConditionModelImpl& unet, const std::string& field = "cache");

// The controller (state) of a configuration, labelled as the configuration is.
std::unique_ptr<CacheController> make_cache_controller(const CacheConfig& c);

// parse_cache_config + make_cache_controller, for tests and tools that hold a literal mode string.
std::unique_ptr<CacheController> parse_cache_mode(const std::string& spec);

} // namespace anchor::unet
