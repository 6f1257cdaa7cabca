// Cross-step latent cache for masked diffusion LMs (`--cache anchor:...`).
//
// Between denoising steps most decoded tokens barely change their hidden states (dLLM-Cache, Liu et al. 2025;
// Fast-dLLM, Wu et al. 2025). Per layer and position the cache keeps K, V, the attention branch output and the
// *ungated* FFN branch output, each stamped with the step that computed it. At step s a position is ACTIVE
// (recomputed) in layer l when
//   * its token is [MASK] (or differs from the token its entry was computed with, i.e. it was just unmasked),
//   * its entry is older than the layer's staleness (s - stamp > stale_l),
//   * or it is among the top-rho anchored candidates whose value vector changed most (V-verify as dLLM-Cache: the
//     current V is computed for every position, cosine similarity to the cached V ranks them),
// and ANCHORED otherwise. With `masked=reuse` the first rule shrinks to the positions whose logits the sampler asks
// for (ancestral: those it unmasks now; confidence: every masked one of the block): a [MASK] position's input never
// changes, only its attention context and the time conditioning do, so like dLLM-Cache's response cache it can be
// reused for a few steps; ANCHORED positions: its cached attention/FFN outputs are reused with the CURRENT step's
// gates,
//   x += g_attn(t_s) * attn_cache,  x += g_ffn(t_s) * ffn_cache,
// which is exact with respect to the gate because the gate depends on t only. Queries, FFN and fresh K/V are
// computed for active positions only (gather/scatter); their queries attend over all keys (anchored ones from the
// cache). stale_l is the base staleness (or the calibrated profile's class staleness for (l, t)); when the mean
// gate of layer l at t exceeds tau_gate the layer may use `stale_high` (the branch output is passed through almost
// unattenuated, so the residual stream is dominated by the stable cached branch): cache::TimeGatePolicy with
// GateDirection::HighReuses decides it from the gate means the modulation computes. Every `refresh` steps (and at
// step 0) everything is recomputed. Mode `off` is the exact reference (dense forward every step).
//
// Block caches (Fast-dLLM, Wu et al. 2025, sec. 3.2), for semi-autoregressive decoding in blocks:
//   * `prefix`: at the first step of each block every position is computed; at the block's other steps only the
//     current block and the masked suffix after it are (queries, K/V, FFN), the prompt and the finished blocks
//     before it keep their K/V and branch outputs from the block's first step (Fast-dLLM's prefix KV cache);
//   * `dual`: only the current block is computed; the suffix is cached as well (Fast-dLLM's DualCache).
// `refresh=R` also recomputes everything every R steps (R = 1: every step, which equals `off` bit for bit).
//
// Adaptive refresh (Elastic-Cache, Nguyen-Tri et al. 2025, sec. 4), `prefix|dual:drift=G`: at each step and layer the
// cached token the current block attends to most (attention mass summed over the block's queries and the heads) is a
// probe of how far the cache has drifted: its key is recomputed from the layer's current input, and when the cosine
// similarity to its cached key falls below G this layer and every deeper one recompute every position (the deeper
// layers' inputs change with it). Shallow layers, whose states move least, keep their cache; a block's first step
// still recomputes everything. G = 0: off (dual/prefix as above); G = 1: every layer whose probe moved at all.
// The delayed cache of dKV-Cache (Ma et al. 2025) is the `anchor` rule's "token changed" term: a just-decoded
// position is recomputed once with its new token, then cached. `prefix|dual:decoded=reuse` applies it inside the
// current block too: its [MASK] positions are computed every step, a position decoded at an earlier step once more
// with its token, then it keeps its cached K/V and branch outputs until the next full step (dKV-Cache's delayed
// cache; the block then costs its masked positions, not its length). `masked=reuse` goes one step further for
// samplers that ask for few logits per step (ancestral): the block's [MASK] positions are reused too, each computed
// again when it is decoded or its entry is older than `stale` steps; the block then costs the positions being
// decoded, the just-decoded ones and the stale ones.
#pragma once

#include "cache/anchor_policy.h"
#include "cache/anchor_profile.h"
#include "cache/latent_cache.h"
#include "text/diffusion/mdlm_model.h"

#include <nlohmann/json.hpp>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace anchor::text {

enum class CacheMode { Off, Anchor, Prefix, Dual };
const EnumTable<CacheMode>& cache_mode_table(); // "off", "anchor", "prefix", "dual"

// The defaults are the best setting measured on held-out prompts (tests/bench/results/mdlm_default_anchor_*.txt):
// for the 8 x 384 kjv-mdlm, the fastest whose gen-PPL and unigram entropy stay within 5 % and 2 % of off (stale=4,
// masked=reuse). Longer staleness is faster but leaves that band, more so than for the earlier 4 x 128 model: a
// stronger model's features move more between steps, so old entries cost more.
struct AnchorCacheSettings {
    double tau_gate = 0.95;
    int64_t stale = 4;       // max age of an anchored entry (steps)
    int64_t stale_high = -1; // staleness for layers whose gate mean exceeds tau_gate; -1 = 2 * stale
    double rho = 0.0;        // fraction of anchored candidates re-verified by value change
    int64_t refresh = 0;     // full recompute every R steps (0 = only step 0)
    std::string profile;     // calibrated anchor profile (JSON) giving per-layer, per-time staleness
    // masked=reuse: a [MASK] position whose logits are not asked for this step is anchored like a decoded one
    // (dLLM-Cache caches the whole response, masks included); the positions being decoded stay active.
    bool reuse_masked = true;
    bool fp16 = false;       // store the latents as float16 (half the bytes; results move by its rounding)
    double budget_mib = 0.0; // byte budget of the store in MiB (0 = unlimited); an evicted layer is recomputed
    // prefix/dual: Elastic-Cache's drift threshold G on the most-attended cached token's key (0 = off; see above).
    double drift = 0.0;
    // prefix/dual: the block's decoded positions are cached one step after decoding (dKV-Cache; see above).
    bool reuse_decoded = false;
    // prefix/dual `masked=reuse`: of the block's [MASK] positions only those whose logits the sampler asks for are
    // computed (ancestral: the ones it unmasks now); the others keep their latents from the block's first step until
    // they are older than `stale` steps. A [MASK] position's input never changes within a block, only its attention
    // context does, as for the suffix that DualCache already keeps (the anchor rule's masked=reuse applied inside
    // the block).
    bool reuse_block_masks = false;
    // prefix/dual `masked=reuse`: the staleness of the block's [MASK] rows (-1: `stale`, as every other row). A mask's
    // input never changes within a block; only the keys and values others read from it age, and DualCache keeps the
    // suffix's masks for a whole block.
    int64_t stale_masked = -1;
    // prefix/dual `window=W`: a block's first step recomputes only the W positions before the block (with W = the
    // block length, the previous block: decoded since the last block start) and the block itself (prefix: to the
    // end); the prompt, older blocks and the masked suffix keep their rows, as dKV-Cache keeps decoded tokens' keys
    // and values for good. -1 (the default): everything, Fast-dLLM's refresh.
    int64_t window = -1;
};

struct CacheSpec {
    CacheMode mode = CacheMode::Off;
    AnchorCacheSettings anchor;
    // The canonical string (the keys that differ from what the mode does anyway) and the resolved value of every key
    // of the mode, from the mode's key table.
    std::string to_string() const;
    nlohmann::json params_json() const;
};

// "off" | "anchor[:key=value,...]" | "prefix[:key=value,...]" | "dual[:key=value,...]": each mode's keys are declared
// once, in its key table (text/diffusion/mdlm_cache.cpp; prefix and dual share one), which drives this parser, to_string,
// params_json, cache_modes_help and cache_docs_tables. Throws text::ParamError (field "cache"), one line naming the
// mode, the key and its range (or the mode's keys).
CacheSpec parse_cache_spec(const std::string& s);
// "off, anchor[:key=value,...], prefix[:key=value,...], dual[:key=value,...]" (for errors and --help).
std::string cache_mode_forms();
// Every mode with its keys and defaults (`--cache help`).
std::string cache_modes_help();
// The Markdown tables of the keys (anchor's, then prefix and dual's; each documented, then advanced) that
// docs/caching.md holds (a test compares them).
std::string cache_docs_tables();

// The store (cache/latent_cache.h, one per denoiser) holds, per layer, five row-versioned entries keyed
// (namespace, layer, slot, anchor):
//   * namespace "mdlm/seq<N>": one sequence (request). reset() starts the next one and erases the previous one
//     (erase_namespace: O(its entries)); sequences never see each other's latents.
//   * layer: the block index.
//   * slot (MdlmSlot): K and V [H, L, d] (rows along dim 1), the attention and the ungated FFN branch outputs Attn,
//     Ffn [L, D] (rows along dim 0), and Token [L] int64, the token each position's latents were computed with.
//   * anchor 0: one entry covers every position of the sequence. Positions are the entry's rows, so a step writes its
//     active positions with one put_rows per slot and the position's version is the row's step stamp: per-position
//     staleness (the rule above) is fresh_rows of the Token entry, whose rows are written together with the other
//     four. One entry per position would cost a cat of L tensors before every attention.
// The store's statistics (hits, misses, stale rejections, evictions, bytes, rows written) and the denoiser's decisions
// (position-layers reused, full steps, drift refreshes) are one cache::CacheStats, part of each sample's result
// (SampleResult::cache).
// The store's slots: the block's latents (BlockLatent, same values), then the token ids.
enum class MdlmSlot : int32_t { K = 0, V = 1, Attn = 2, Ffn = 3, Token = 4 };
inline MdlmSlot slot_of(BlockLatent b) {
    return static_cast<MdlmSlot>(static_cast<int32_t>(b));
}

// Per-step, per-layer decisions for tests and --show-steps: which positions were active and why.
struct LayerDecision {
    int64_t layer = 0;
    int64_t staleness = 0;
    double gate_mean = 0.0;
    bool full = false;
    torch::Tensor active; // bool [L]
    // drift=G: the probe (most-attended cached position, -1 when none was probed) and its key's cosine similarity.
    int64_t probe = -1;
    double probe_cos = 1.0;
};

// The denoiser the sampler calls: logits for selected positions given the current tokens and time.
class MdlmDenoiser {
public:
    MdlmDenoiser(MdlmModel model, CacheSpec spec);

    // Clears the cache for a new sequence of `length` tokens.
    void reset(int64_t length);
    // The sampler starts decoding positions [lo, hi) (semi-autoregressive block): the block caches recompute
    // everything at the next step and then only the block (dual) or the block and its suffix (prefix).
    void begin_block(int64_t lo, int64_t hi);
    // ids: internal ids [L]; t: diffusion time in (0, 1]; step: global step index (0 = first);
    // positions: int64 [n] rows whose logits are wanted. Returns float logits [n, V] ([MASK] at -inf).
    torch::Tensor logits(const torch::Tensor& ids, double t, int64_t step, const torch::Tensor& positions);

    const CacheSpec& spec() const { return spec_; }
    // The latent store's statistics and the decisions since the last reset (the store's all zero in mode off).
    cache::CacheStats stats() const;
    const std::vector<LayerDecision>& last_decisions() const { return decisions_; }
    const cache::LatentCache& store() const { return store_; }
    MdlmModel& model() { return model_; }

    // When set, each step's per-layer residual stream [L, D] (after the block) is passed here with the step's
    // internal ids [L] (calibration).
    std::function<void(int64_t step, int64_t layer, const torch::Tensor& ids, const torch::Tensor& hidden)>
        on_layer_output;
    // Scripted activity for tests: when set, replaces the rule-based active set of (step, layer).
    std::function<torch::Tensor(int64_t step, int64_t layer, const torch::Tensor& rule_active)> override_active;

private:
    struct TimeEntry;
    torch::Tensor dense_hidden(const torch::Tensor& ids, const torch::Tensor& x0, const TimeEntry& at, int64_t step);
    // The residual stream after the blocks at `positions` [1, n, D].
    torch::Tensor cached_hidden(const torch::Tensor& ids, const TimeEntry& at, int64_t step,
                                const torch::Tensor& positions);
    cache::CacheKey key(int64_t layer, MdlmSlot slot) const { return {ns_, int32_t(layer), int32_t(slot), 0}; }
    void create_layer(int64_t layer); // every slot of `layer` with no row written
    torch::Tensor read(int64_t layer, MdlmSlot slot);
    void write(int64_t layer, MdlmSlot slot, const torch::Tensor& idx, const torch::Tensor& rows, int64_t step);
    class LayerLatents; // one layer's latents at one step, for MdlmBlockImpl::forward_cached

    MdlmModel model_;
    CacheSpec spec_;
    cache::LatentCache store_;
    // A layer whose gate mean exceeds tau_gate uses stale_high (the policy's Reuse).
    cache::TimeGatePolicy gate_policy_;
    std::string ns_;               // namespace of the current sequence
    int64_t sequence_ = 0;         // sequences started
    cache::AnchorProfile profile_; // layer classes (cache/anchor_profile.h)
    bool has_profile_ = false;
    int64_t length_ = 0;
    int64_t total_steps_ = 0;
    int64_t block_lo_ = 0, block_hi_ = 0;
    bool block_started_ = false; // begin_block since the last step: the next step recomputes everything
    Rope rope_;
    // StepConditioning and the per-layer gate means at each t of the sequence (the same t recur in every block).
    struct TimeEntry {
        StepConditioning cond;
        std::vector<double> gate_means;
    };
    std::map<double, TimeEntry> at_time_;
    const TimeEntry& at_time(double t);
    cache::CacheStats decision_counts_; // the decision counters only (the store counts its own)
    std::vector<LayerDecision> decisions_;

public:
    // Total steps of the run (for profile time bins); set by the sampler.
    void set_total_steps(int64_t t) { total_steps_ = t; }
};

// The per-position activity rule for one layer, separated so tests can script it:
// active = masked | token changed | not fresh | full, where fresh = cache::LatentCache::rows_fresh(stamp, step,
// staleness) (written, 0 <= step - stamp <= staleness); `masked_active` = false drops the first term (masked=reuse).
torch::Tensor rule_active(const torch::Tensor& ids, const torch::Tensor& stamp, const torch::Tensor& token,
                          int64_t mask_id, int64_t step, int64_t staleness, bool full, bool masked_active = true);
// The same rule given the fresh rows (bool [L]).
torch::Tensor rule_active_fresh(const torch::Tensor& ids, const torch::Tensor& fresh, const torch::Tensor& token,
                                int64_t mask_id, bool full, bool masked_active = true);

} // namespace anchor::text
