#include "text/diffusion/mdlm_cache.h"

#include "cache/io/atomic_file.h"
#include "cache/io/error.h"
#include "cache/modes/key_table.h"
#include "text/params.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <fstream>
#include <numeric>
#include <sstream>

namespace anchor::text {

// ---- mode strings ---------------------------------------------------------------------------------------------------
//
// One key table per mode (cache/modes/key_table.h, as the SD modes in unet/cache/cache_config.cpp): it drives the parser,
// to_string, params_json, `--cache help` and the tables of docs/caching.md (a test compares them). prefix and dual
// share one table: they differ in what a step computes, not in their keys.

namespace {

namespace mode_keys = cache::modes;
using Settings = AnchorCacheSettings;
using Key = mode_keys::ModeKey<Settings>;

constexpr int64_t kMaxCount = 1000000000; // counts of steps and positions: far past any run

// One of two words; the error quotes both ("masked is 'yes': expected 'active' or 'reuse'").
Key word_key(std::string name, bool Settings::*m, const std::string& on, const std::string& off, std::string help,
             bool advanced) {
    auto k = mode_keys::choice_key(std::move(name), m, on, off, std::move(help), advanced);
    k.set = [m, on, off](Settings& p, const std::string& v) {
        if (v != on && v != off) throw mode_keys::BadKeyValue("is '" + v + "': expected '" + off + "' or '" + on + "'");
        p.*m = v == on;
    };
    return k;
}

// A count whose unset value (-1) defers to something else (`unset` says what, e.g. "2*stale"): written only when set.
Key deferring_key(std::string name, int64_t Settings::*m, const std::string& unset, std::string help, bool advanced) {
    auto k = mode_keys::integer_key(std::move(name), m, 0, kMaxCount, std::move(help), advanced);
    k.get = [m, unset](const Settings& p) { return p.*m < 0 ? unset : std::to_string(p.*m); };
    k.json = [m, unset](const Settings& p) { return p.*m < 0 ? nlohmann::json(unset) : nlohmann::json(p.*m); };
    k.shown = [m](const Settings& p) { return p.*m >= 0; };
    return k;
}

Key& shown_if(Key& k, std::function<bool(const Settings&)> shown) {
    k.shown = std::move(shown);
    return k;
}

const std::vector<Key>& anchor_keys() {
    static const std::vector<Key> t = [] {
        auto tau = mode_keys::make_key<Settings>("tau", "a number", "gate-mean threshold above which a layer uses "
                                                 "stale_high", true);
        tau.set = [](Settings& p, const std::string& v) { p.tau_gate = mode_keys::parse_number(v, "a number"); };
        tau.get = [](const Settings& p) { return mode_keys::format_number(p.tau_gate); };
        tau.json = [](const Settings& p) { return nlohmann::json(p.tau_gate); };
        auto profile = mode_keys::make_key<Settings>("profile", "a file",
                                                     "calibrated anchor profile JSON (anchor-text diffusion calibrate): "
                                                     "per-layer, per-time staleness",
                                                     false);
        profile.set = [](Settings& p, const std::string& v) {
            if (v.empty()) throw mode_keys::BadKeyValue("must be a file, got ''");
            p.profile = v; // read by MdlmDenoiser, which checks it against the model
        };
        profile.get = [](const Settings& p) { return p.profile; };
        profile.json = [](const Settings& p) { return p.profile.empty() ? nlohmann::json() : nlohmann::json(p.profile); };
        profile.shown = [](const Settings& p) { return !p.profile.empty(); };
        std::vector<Key> k = {
            tau,
            mode_keys::integer_key("stale", &Settings::stale, 0, kMaxCount, "max age in steps of an anchored entry",
                                   false),
            deferring_key("stale_high", &Settings::stale_high, "2*stale",
                          "staleness of the layers whose gate mean exceeds tau", true),
            mode_keys::number_key("rho", &Settings::rho, 0, 1,
                                  "fraction of the anchored positions re-verified by how much their value vector moved",
                                  true),
            mode_keys::integer_key("refresh", &Settings::refresh, 0, kMaxCount,
                                   "recompute everything every R steps (0: only the first step)", false),
            word_key("masked", &Settings::reuse_masked, "reuse", "active",
                     "reuse: of the [MASK] positions only those being decoded are recomputed (dLLM-Cache); active: "
                     "every one",
                     false),
            mode_keys::choice_key("fp16", &Settings::fp16, "1", "0",
                                  "1: store the cached latents as float16 (half the bytes; results move by its rounding)",
                                  true, true),
            mode_keys::number_key("budget", &Settings::budget_mib, 0, 1e9,
                                  "byte budget of the latent store in MiB (0: unlimited); an evicted layer is recomputed",
                                  false),
            profile,
        };
        shown_if(k[6], [](const Settings& p) { return p.fp16; });
        shown_if(k[7], [](const Settings& p) { return p.budget_mib > 0; });
        return k;
    }();
    return t;
}

const std::vector<Key>& block_keys() {
    static const std::vector<Key> t = [] {
        std::vector<Key> k = {
            mode_keys::integer_key("refresh", &Settings::refresh, 0, kMaxCount,
                                   "also recompute everything every R steps (0: only at each block's first step)",
                                   false),
            mode_keys::number_key("drift", &Settings::drift, 0, 1,
                                  "Elastic-Cache: when the key of the cached token the block attends to most moves "
                                  "(cosine similarity to its cached key below G), that layer and the deeper ones "
                                  "recompute everything (0: off)",
                                  false),
            word_key("decoded", &Settings::reuse_decoded, "reuse", "compute",
                     "reuse: dKV-Cache's delayed cache inside the block: a position decoded at an earlier step is "
                     "computed once more with its token, then reused until it is older than stale; compute: the whole "
                     "block every step",
                     false),
            word_key("masked", &Settings::reuse_block_masks, "reuse", "compute",
                     "reuse: of the block's [MASK] positions only those whose logits the sampler asks for are computed "
                     "(ancestral: the ones it unmasks now), the others keep their latents; compute: every one",
                     false),
            mode_keys::integer_key("stale", &Settings::stale, 0, kMaxCount,
                                   "with decoded=reuse or masked=reuse, a reused position is computed again after S "
                                   "steps",
                                   false),
            deferring_key("stale_masked", &Settings::stale_masked, "stale",
                          "with masked=reuse, the block's [MASK] positions are computed again after M steps", true),
            deferring_key("window", &Settings::window, "all",
                          "a block's first step recomputes only the W positions before the block (W = the block "
                          "length: the previous block) and the block; the prompt, older blocks and the masked suffix "
                          "keep their rows (all: every position, Fast-dLLM's refresh)",
                          true),
        };
        shown_if(k[0], [](const Settings& p) { return p.refresh > 0; });
        shown_if(k[1], [](const Settings& p) { return p.drift > 0; });
        shown_if(k[2], [](const Settings& p) { return p.reuse_decoded; });
        shown_if(k[3], [](const Settings& p) { return p.reuse_block_masks; });
        shown_if(k[4], [](const Settings& p) {
            return (p.reuse_decoded || p.reuse_block_masks) && p.stale != Settings{}.stale;
        });
        shown_if(k[5], [](const Settings& p) { return p.reuse_block_masks && p.stale_masked >= 0; });
        return k;
    }();
    return t;
}

const std::vector<Key>& keys_of(CacheMode m) {
    return m == CacheMode::Anchor ? anchor_keys() : block_keys();
}

// What each mode is, for `--cache help`.
struct ModeInfo {
    CacheMode mode;
    const char* syntax;
    const char* help;
};
const std::vector<ModeInfo>& mode_infos() {
    static const std::vector<ModeInfo> t = {
        {CacheMode::Off, "off", "dense forward at every step (the exact reference)"},
        {CacheMode::Anchor, "anchor[:key=value,...]", "cross-step latent cache (dLLM-Cache style)"},
        {CacheMode::Prefix, "prefix[:key=value,...]",
         "Fast-dLLM prefix KV cache: the prompt and the finished blocks are computed once per block"},
        {CacheMode::Dual, "dual[:key=value,...]",
         "Fast-dLLM DualCache: the masked suffix is cached too; only the current block is computed"},
    };
    return t;
}

[[noreturn]] void bad_mode(const std::string& text, const std::string& why) {
    throw ParamError("cache", "mode '" + text + "': " + why);
}

// Names the mode of a key the table lacks (apply_keys would only list this mode's keys): an anchor key under a block
// mode or the reverse is a mistake worth its own words.
void check_key_names(CacheMode mode, const std::string& head, const std::string& items, const std::string& text) {
    const auto& table = keys_of(mode);
    for (size_t b = 0; b <= items.size();) {
        const size_t e = std::min(items.find(',', b), items.size());
        const std::string item = items.substr(b, e - b);
        b = e + 1;
        const auto eq = item.find('=');
        if (eq == std::string::npos) continue; // apply_keys says what it expected
        const std::string name = item.substr(0, eq);
        if (mode_keys::find_key(table, name)) continue;
        if (mode == CacheMode::Anchor && mode_keys::find_key(block_keys(), name))
            bad_mode(text, "option " + name + " is for prefix and dual (block caches), not anchor");
        bad_mode(text, "option '" + name + "' is unknown for " + head + " (its keys: " + mode_keys::key_names(table) +
                           ")");
    }
}

} // namespace

const EnumTable<CacheMode>& cache_mode_table() {
    static const EnumTable<CacheMode> t = {{"off", CacheMode::Off},
                                           {"anchor", CacheMode::Anchor},
                                           {"prefix", CacheMode::Prefix},
                                           {"dual", CacheMode::Dual}};
    return t;
}

std::string cache_mode_forms() {
    std::string s;
    for (const auto& m : mode_infos()) s += (s.empty() ? "" : ", ") + std::string(m.syntax);
    return s;
}

std::string cache_modes_help() {
    std::string s;
    for (const auto& m : mode_infos()) s += std::string(m.syntax) + ": " + m.help + "\n";
    s += "anchor keys (anchor:key=value,...):\n" + mode_keys::keys_help(anchor_keys(), Settings{});
    s += "  default: " + CacheSpec{CacheMode::Anchor, Settings{}}.to_string() + "\n";
    s += "prefix and dual keys (dual:key=value,...):\n" + mode_keys::keys_help(block_keys(), Settings{});
    s += "prefix and dual need --block-length (semi-autoregressive blocks); with one block, dual is prefix.";
    return s;
}

std::string cache_docs_tables() {
    std::string s = mode_keys::keys_markdown(anchor_keys(), Settings{}, false);
    s += "\n" + mode_keys::keys_markdown(anchor_keys(), Settings{}, true);
    s += "\n" + mode_keys::keys_markdown(block_keys(), Settings{}, false);
    s += "\n" + mode_keys::keys_markdown(block_keys(), Settings{}, true);
    return s;
}

std::string CacheSpec::to_string() const {
    if (mode == CacheMode::Off) return "off";
    const std::string keys = mode_keys::keys_string(keys_of(mode), anchor);
    return enum_name(cache_mode_table(), mode) + (keys.empty() ? "" : ":" + keys);
}

nlohmann::json CacheSpec::params_json() const {
    if (mode == CacheMode::Off) return nlohmann::json::object();
    return mode_keys::keys_json(keys_of(mode), anchor);
}

CacheSpec parse_cache_spec(const std::string& s) {
    CacheSpec spec;
    const auto colon = s.find(':');
    const std::string head = s.substr(0, colon);
    const CacheMode* mode = nullptr;
    for (const auto& [name, m] : cache_mode_table())
        if (name == head) mode = &m;
    if (!mode || (*mode == CacheMode::Off && colon != std::string::npos))
        throw ParamError("cache", "mode '" + s + "' is unknown (expected one of " + cache_mode_forms() +
                                      "; --cache help lists them)");
    spec.mode = *mode;
    if (spec.mode == CacheMode::Off || colon == std::string::npos) return spec;
    const std::string items = s.substr(colon + 1);
    if (items.empty()) bad_mode(s, "empty key list after ':'");
    check_key_names(spec.mode, head, items, s);
    try {
        mode_keys::apply_keys(keys_of(spec.mode), spec.anchor, items);
    } catch (const std::invalid_argument& e) {
        bad_mode(s, e.what());
    }
    return spec;
}

// ---- denoiser -------------------------------------------------------------------------------------------------------

torch::Tensor rule_active_fresh(const torch::Tensor& ids, const torch::Tensor& fresh, const torch::Tensor& token,
                                int64_t mask_id, bool full, bool masked_active) {
    if (full) return torch::ones(ids.sizes(), torch::kBool);
    auto a = (ids != token) | ~fresh;
    return masked_active ? a | (ids == mask_id) : a;
}

torch::Tensor rule_active(const torch::Tensor& ids, const torch::Tensor& stamp, const torch::Tensor& token,
                          int64_t mask_id, int64_t step, int64_t staleness, bool full, bool masked_active) {
    return rule_active_fresh(ids, cache::LatentCache::rows_fresh(stamp, step, staleness), token, mask_id, full,
                             masked_active);
}

namespace {
cache::LatentCacheOptions store_options(const CacheSpec& spec) {
    cache::LatentCacheOptions o;
    o.fp16_storage = spec.anchor.fp16;
    o.byte_budget = static_cast<size_t>(spec.anchor.budget_mib * 1024.0 * 1024.0);
    return o;
}
} // namespace

MdlmDenoiser::MdlmDenoiser(MdlmModel model, CacheSpec spec)
    : model_(std::move(model)), spec_(std::move(spec)), store_(store_options(spec_)),
      gate_policy_(spec_.anchor.tau_gate, cache::GateDirection::HighReuses) {
    if (spec_.mode == CacheMode::Anchor && !spec_.anchor.profile.empty()) {
        profile_ = cache::AnchorProfile::load(spec_.anchor.profile);
        has_profile_ = true;
        if (!profile_.has_layer_classes())
            throw Error("anchor profile '" + spec_.anchor.profile +
                        "' has no layer classes (a Stable Diffusion step-range profile?); calibrate one with "
                        "'anchor-text diffusion calibrate'");
        if (profile_.n_layers != model_->config().n_blocks)
            throw Error("anchor profile '" + spec_.anchor.profile + "' has " + std::to_string(profile_.n_layers) +
                        " layers, the model " + std::to_string(model_->config().n_blocks));
    }
}

void MdlmDenoiser::create_layer(int64_t l) {
    const auto& c = model_->config();
    const int64_t L = length_, H = c.n_heads, d = c.head_dim(), D = c.hidden_size;
    const auto none = cache::LatentCache::kUnwritten;
    // Zero-filled (never read before written: a layer without written rows is recomputed in full). The latents live
    // where the model runs, in its dtype; the tokens they were computed with are host bookkeeping.
    const auto& pl = model_->placement();
    const auto opts = torch::TensorOptions().device(pl.device).dtype(pl.dtype);
    store_.put(key(l, MdlmSlot::K), torch::zeros({H, L, d}, opts), none, cache::RowVersioned{1});
    store_.put(key(l, MdlmSlot::V), torch::zeros({H, L, d}, opts), none, cache::RowVersioned{1});
    store_.put(key(l, MdlmSlot::Attn), torch::zeros({L, D}, opts), none, cache::RowVersioned{0});
    store_.put(key(l, MdlmSlot::Ffn), torch::zeros({L, D}, opts), none, cache::RowVersioned{0});
    store_.put(key(l, MdlmSlot::Token), torch::full({L}, -1, torch::kInt64), none, cache::RowVersioned{0});
    for (auto slot : {MdlmSlot::K, MdlmSlot::V, MdlmSlot::Attn, MdlmSlot::Ffn, MdlmSlot::Token})
        if (!store_.contains(key(l, slot)))
            throw Error("the latent store's budget (" + std::to_string(store_.options().byte_budget) +
                        " bytes) cannot hold one layer of a " + std::to_string(L) + "-token sequence");
}

torch::Tensor MdlmDenoiser::read(int64_t l, MdlmSlot slot) {
    auto t = store_.get(key(l, slot), 0);
    if (!t) throw Error("latent store: " + key(l, slot).str() + " was evicted while its layer was computed");
    return *t;
}

void MdlmDenoiser::write(int64_t l, MdlmSlot slot, const torch::Tensor& idx, const torch::Tensor& rows, int64_t step) {
    if (!store_.put_rows(key(l, slot), idx, rows, step))
        throw Error("latent store: " + key(l, slot).str() + " was evicted while its layer was computed");
}

class MdlmDenoiser::LayerLatents final : public BlockLatents {
public:
    LayerLatents(MdlmDenoiser& d, int64_t layer, int64_t step) : d_(d), layer_(layer), step_(step) {}
    torch::Tensor read(BlockLatent which) override { return d_.read(layer_, slot_of(which)); }
    void write(BlockLatent which, const torch::Tensor& idx, const torch::Tensor& rows) override {
        d_.write(layer_, slot_of(which), idx, rows, step_);
    }

private:
    MdlmDenoiser& d_;
    int64_t layer_, step_;
};

void MdlmDenoiser::begin_block(int64_t lo, int64_t hi) {
    block_lo_ = lo;
    block_hi_ = hi;
    block_started_ = true;
}

cache::CacheStats MdlmDenoiser::stats() const {
    cache::CacheStats s = store_.stats();
    s += decision_counts_; // its store counters are 0: the sum adds the decisions
    return s;
}

void MdlmDenoiser::reset(int64_t length) {
    const auto& c = model_->config();
    length_ = length;
    block_lo_ = 0, block_hi_ = length;
    block_started_ = true;
    const auto& pl = model_->placement();
    rope_ = model_->rope(length, torch::TensorOptions().dtype(pl.dtype).device(pl.device));
    if (!ns_.empty()) store_.erase_namespace(ns_);
    ns_ = "mdlm/seq" + std::to_string(sequence_++);
    store_.reset_stats();
    if (spec_.mode != CacheMode::Off)
        for (int64_t l = 0; l < c.n_blocks; ++l) create_layer(l);
    decision_counts_ = cache::CacheStats{};
    decisions_.clear();
    at_time_.clear();
}

const MdlmDenoiser::TimeEntry& MdlmDenoiser::at_time(double t) {
    auto it = at_time_.find(t);
    if (it != at_time_.end()) return it->second;
    if (at_time_.size() >= 1024) at_time_.clear(); // bounded: a sequence sampled at more distinct times recomputes
    TimeEntry e;
    e.cond = model_->step_conditioning(torch::full({1}, t, torch::kFloat32));
    for (const auto& m : e.cond.blocks)
        e.gate_means.push_back(0.5 * (m.gate_attn.mean().item<double>() + m.gate_ffn.mean().item<double>()));
    return at_time_.emplace(t, std::move(e)).first->second;
}

torch::Tensor MdlmDenoiser::logits(const torch::Tensor& ids, double t, int64_t step, const torch::Tensor& positions) {
    torch::NoGradGuard ng;
    if (ids.dim() != 1) throw Error("MdlmDenoiser::logits: ids must be 1-D");
    if (ids.size(0) != length_) reset(ids.size(0));
    const auto& at = at_time(t);
    const auto dev = model_->placement().device;
    auto h = spec_.mode == CacheMode::Off
                 ? dense_hidden(ids, model_->embed(ids.unsqueeze(0)), at, step).index_select(1, positions.to(dev))
                 : cached_hidden(ids, at, step, positions);
    // The samplers are host code with a CPU generator: one copy of the asked positions' logits per step.
    return model_->head(h, at.cond).squeeze(0).to(torch::kCPU, torch::kFloat32);
}

torch::Tensor MdlmDenoiser::dense_hidden(const torch::Tensor& ids, const torch::Tensor& x0, const TimeEntry& at,
                                         int64_t step) {
    auto x = x0;
    int64_t l = 0;
    for (auto& b : model_->block_list) {
        x = b->forward(x, at.cond.blocks[static_cast<size_t>(l)], rope_);
        if (on_layer_output) on_layer_output(step, l, ids, x[0]);
        ++l;
    }
    decision_counts_.position_layers_total += length_ * static_cast<int64_t>(model_->block_list.size());
    decision_counts_.active_per_step.push_back(length_ * static_cast<int64_t>(model_->block_list.size()));
    decision_counts_.full_steps++;
    return x;
}

namespace {
// Elastic-Cache's probe: the cached (not recomputed) position the block's queries attend to most at this layer, from
// the block's current queries and the cached keys; -1 when every position is in the block.
int64_t most_attended_cached(MdlmBlockImpl& b, const torch::Tensor& x, const BlockModulation& m,
                             const torch::Tensor& block_idx, const torch::Tensor& block_active,
                             const torch::Tensor& keys, const Rope& rope) {
    if (block_idx.size(0) == 0 || block_idx.size(0) == x.size(1)) return -1;
    torch::Tensor q, k, v;
    const auto idx = block_idx.to(x.device());
    b.qkv(b.attn_input(x.index_select(1, idx), m), rope.select(idx), q, k, v); // q [1, H, n, d]
    const double scale = 1.0 / std::sqrt(double(q.size(-1)));
    auto p = torch::softmax(torch::matmul(q[0], keys.transpose(1, 2)).to(torch::kFloat32) * scale, -1); // [H, n, L]
    auto mass = p.sum(std::vector<int64_t>{0, 1}).masked_fill(block_active.to(p.device()), -1.0);
    return mass.argmax().item<int64_t>();
}

// Cosine similarity of position `pos`'s key recomputed from the layer's current input with its cached key.
double key_similarity(MdlmBlockImpl& b, const torch::Tensor& x, const BlockModulation& m, int64_t pos,
                      const torch::Tensor& keys, const Rope& rope) {
    const auto idx = torch::full({1}, pos, torch::dtype(torch::kInt64).device(x.device()));
    torch::Tensor q, k, v;
    b.qkv(b.attn_input(x.index_select(1, idx), m), rope.select(idx), q, k, v); // k [1, H, 1, d]
    auto now = k[0].select(1, 0).reshape(-1), old = keys.select(1, pos).reshape(-1);
    return torch::cosine_similarity(now.to(torch::kFloat32), old.to(torch::kFloat32), 0, 1e-8).item<double>();
}
} // namespace

torch::Tensor MdlmDenoiser::cached_hidden(const torch::Tensor& ids, const TimeEntry& at, int64_t step,
                                          const torch::Tensor& positions) {
    const auto& a = spec_.anchor;
    const auto& cfg = model_->config();
    const int64_t mask_id = model_->internal_mask_id();
    bool full = step == 0 || (a.refresh > 0 && step % a.refresh == 0);
    const bool block_mode = spec_.mode == CacheMode::Prefix || spec_.mode == CacheMode::Dual;
    torch::Tensor block_active; // prefix: [lo, L); dual: [lo, hi)
    // window=W: a block's first step (not a scheduled refresh) recomputes [lo - W, hi) rather than everything.
    const bool windowed = block_mode && block_started_ && !full && a.window >= 0;
    if (block_mode) {
        full = full || (block_started_ && !windowed);
        block_started_ = false;
        block_active = torch::zeros({length_}, torch::kBool);
        const int64_t hi = spec_.mode == CacheMode::Dual ? block_hi_ : length_;
        block_active.narrow(0, block_lo_, hi - block_lo_).fill_(true);
    }
    decisions_.clear();
    // The gates depend on t only: every layer's modulation and gate mean (at_time), then one gate decision for the
    // step.
    const auto& mods = at.cond.blocks;
    cache::StepSignals signals;
    signals.step = static_cast<int>(step);
    signals.num_steps = static_cast<int>(total_steps_);
    signals.layer_gates = at.gate_means;
    const auto gate = gate_policy_.decide(signals);
    int64_t active_total = 0;
    bool drifted = false; // drift=G: a shallower layer's probe moved, so this and every deeper layer recompute
    const auto block_idx = block_mode ? torch::nonzero(block_active).reshape(-1) : torch::Tensor();
    // Which positions layer l recomputes at this step, and why. x, the layer's input, is read by the drift probe and
    // V-verify only.
    auto plan = [&](int64_t l, const torch::Tensor& x) {
        auto& b = model_->block_list[static_cast<size_t>(l)];
        const auto& m = mods[static_cast<size_t>(l)];
        LayerDecision dec;
        dec.layer = l;
        dec.gate_mean = signals.layer_gates[static_cast<size_t>(l)];
        int64_t stale = has_profile_ ? profile_.staleness(l, step, total_steps_) : a.stale;
        if (gate.layers[static_cast<size_t>(l)] == cache::Action::Reuse)
            stale = a.stale_high >= 0 ? a.stale_high : 2 * stale;
        dec.staleness = stale;
        // Per-position staleness from the store's row stamps. A layer with rows never written is recomputed in full,
        // and so is one that lost an entry to the byte budget (created again, empty).
        bool present = true;
        for (auto slot : {MdlmSlot::K, MdlmSlot::V, MdlmSlot::Attn, MdlmSlot::Ffn, MdlmSlot::Token})
            present = present && store_.contains(key(l, slot));
        if (!present) create_layer(l);
        const auto rows = *store_.fresh_rows(key(l, MdlmSlot::Token), step, stale);
        if (block_mode && a.drift > 0 && !full && !drifted && rows.unwritten == 0) {
            dec.probe = most_attended_cached(*b, x, m, block_idx, block_active, read(l, MdlmSlot::K), rope_);
            if (dec.probe >= 0) {
                dec.probe_cos = key_similarity(*b, x, m, dec.probe, read(l, MdlmSlot::K), rope_);
                drifted = dec.probe_cos < a.drift;
                if (drifted) decision_counts_.drift_refreshes++;
            }
        }
        dec.full = full || drifted || rows.unwritten > 0;
        torch::Tensor active;
        if (block_mode) {
            active = dec.full ? torch::ones({length_}, torch::kBool) : block_active.clone();
            if (windowed && !dec.full) {
                const int64_t w0 = std::max<int64_t>(0, block_lo_ - a.window);
                active.narrow(0, w0, block_lo_ - w0).fill_(true);
            }
            // decoded=reuse: of the block, only its masks and the positions whose cached rows were computed with
            // another token (decoded since) or have gone stale.
            if (!dec.full && !windowed && (a.reuse_decoded || a.reuse_block_masks)) {
                auto fresh = rows.fresh;
                if (a.reuse_block_masks && a.stale_masked >= 0 && a.stale_masked != stale) {
                    const auto stamps = *store_.row_steps(key(l, MdlmSlot::Token));
                    fresh = torch::where(ids == mask_id, cache::LatentCache::rows_fresh(stamps, step, a.stale_masked),
                                         fresh);
                }
                auto keep =
                    rule_active_fresh(ids, fresh, read(l, MdlmSlot::Token), mask_id, false, !a.reuse_block_masks);
                // decoded=compute: every decoded position of the block stays active; masked=compute: every mask.
                if (!a.reuse_decoded) keep |= ids.ne(mask_id);
                active &= keep;
                if (a.reuse_block_masks) active.index_fill_(0, positions, true);
            }
        } else {
            active = rule_active_fresh(ids, rows.fresh, read(l, MdlmSlot::Token), mask_id, dec.full, !a.reuse_masked);
            if (a.reuse_masked) active.index_fill_(0, positions, true);
        }
        // V-verify (dLLM-Cache): among anchored candidates re-activate the rho fraction whose value vectors moved
        // most (lowest cosine similarity between the current V and the cached V).
        if (!block_mode && !dec.full && a.rho > 0) {
            auto cidx = torch::nonzero(~active).reshape(-1);
            int64_t nc = cidx.size(0), nv = static_cast<int64_t>(std::ceil(a.rho * static_cast<double>(nc)));
            if (nc > 0 && nv > 0) {
                const auto cidx_x = cidx.to(x.device());
                auto v_now = b->value(b->attn_input(x.index_select(1, cidx_x), m))[0]; // [H, nc, d]
                auto v_old = read(l, MdlmSlot::V).index_select(1, cidx_x);
                auto flat_now = v_now.permute({1, 0, 2}).reshape({nc, -1});
                auto flat_old = v_old.permute({1, 0, 2}).reshape({nc, -1});
                auto cos = torch::cosine_similarity(flat_now, flat_old, 1, 1e-8);
                auto worst = std::get<1>(torch::topk(cos, std::min(nv, nc), 0, /*largest=*/false));
                active.index_fill_(0, cidx.index_select(0, worst.to(torch::kCPU)), true);
            }
        }
        if (override_active) active = override_active(step, l, active);
        dec.active = active;
        return dec;
    };
    // After layer l ran: the tokens its rows were computed with, the statistics and the record.
    auto finish = [&](LayerDecision&& dec, const torch::Tensor& idx) {
        if (idx.size(0) > 0) write(dec.layer, MdlmSlot::Token, idx, ids.index_select(0, idx), step);
        active_total += idx.size(0);
        decisions_.push_back(std::move(dec));
    };
    torch::Tensor h;
    // Without the drift probe, V-verify, per-layer outputs or a byte budget (which may evict a planned layer while an
    // earlier one is written) no layer's plan depends on the step's computation: every plan first. When every layer
    // then takes the few-row path, only the positions some layer recomputes (and those whose logits are asked for)
    // are carried through the stack; the others' residual streams are never read.
    const bool sequential = (block_mode && a.drift > 0) || (!block_mode && a.rho > 0) || on_layer_output ||
                            store_.options().byte_budget > 0;
    std::vector<LayerDecision> plans; // every layer's, when planned ahead
    std::vector<torch::Tensor> idx;   // their active positions
    if (!sequential) {
        auto carried = torch::zeros({length_}, torch::kBool);
        carried.index_fill_(0, positions, true);
        for (int64_t l = 0; l < cfg.n_blocks; ++l) {
            plans.push_back(plan(l, {}));
            idx.push_back(torch::nonzero(plans.back().active).reshape(-1));
            carried |= plans.back().active;
        }
        const auto rows = torch::nonzero(carried).reshape(-1);
        const auto x0 = model_->embed(ids.index_select(0, rows).unsqueeze(0));
        bool few = true;
        for (int64_t l = 0; few && l < cfg.n_blocks; ++l)
            few = model_->block_list[static_cast<size_t>(l)]->rows_path_applies(idx[size_t(l)].size(0), length_, x0,
                                                                                rope_);
        if (few) {
            auto where = torch::full({length_}, -1, torch::kInt64); // each carried position's row in x
            where.index_copy_(0, rows, torch::arange(rows.size(0), torch::kInt64));
            auto x = x0;
            for (int64_t l = 0; l < cfg.n_blocks; ++l) {
                const auto& i = idx[size_t(l)];
                LayerLatents latents(*this, l, step);
                x = model_->block_list[static_cast<size_t>(l)]->forward_rows(
                    x, rows, mods[static_cast<size_t>(l)], rope_, i, where.index_select(0, i), latents);
                finish(std::move(plans[size_t(l)]), i);
            }
            h = x.index_select(1, where.index_select(0, positions));
        }
    }
    if (!h.defined()) { // the whole sequence through the stack, each layer planned now unless it was ahead
        auto x = model_->embed(ids.unsqueeze(0));
        for (int64_t l = 0; l < cfg.n_blocks; ++l) {
            auto dec = plans.empty() ? plan(l, x) : std::move(plans[size_t(l)]);
            const auto i = idx.empty() ? torch::nonzero(dec.active).reshape(-1) : idx[size_t(l)];
            LayerLatents latents(*this, l, step);
            x = model_->block_list[static_cast<size_t>(l)]->forward_cached(x, mods[static_cast<size_t>(l)], rope_, i,
                                                                           latents);
            if (on_layer_output) on_layer_output(step, l, ids, x[0]);
            finish(std::move(dec), i);
        }
        h = x.index_select(1, positions.to(x.device()));
    }
    decision_counts_.position_layers_total += length_ * cfg.n_blocks;
    decision_counts_.position_layers_reused += length_ * cfg.n_blocks - active_total;
    decision_counts_.active_per_step.push_back(active_total);
    if (active_total == length_ * cfg.n_blocks) decision_counts_.full_steps++;
    return h;
}

} // namespace anchor::text
