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
// unattenuated, so the residual stream is dominated by the stable cached branch). Every `refresh` steps (and at
// step 0) everything is recomputed. Mode `off` is the exact reference (dense forward every step).
#pragma once

#include "cache/anchor_profile.h"
#include "text/mdlm_model.h"

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace anchor::text {

enum class CacheMode { Off, Anchor };

struct AnchorCacheSettings {
    double tau_gate = 0.95;
    int64_t stale = 2;       // max age of an anchored entry (steps)
    int64_t stale_high = -1; // staleness for layers whose gate mean exceeds tau_gate; -1 = 2 * stale
    double rho = 0.05;       // fraction of anchored candidates re-verified by value change
    int64_t refresh = 0;     // full recompute every R steps (0 = only step 0)
    std::string profile;     // calibrated anchor profile (JSON) giving per-layer, per-time staleness
    // masked=reuse: a [MASK] position whose logits are not asked for this step is anchored like a decoded one
    // (dLLM-Cache caches the whole response, masks included); the positions being decoded stay active.
    bool reuse_masked = false;
};

struct CacheSpec {
    CacheMode mode = CacheMode::Off;
    AnchorCacheSettings anchor;
    std::string to_string() const;
};

// "off" | "anchor" | "anchor:tau=0.95,stale=2,stale_high=4,rho=0.05,refresh=8,masked=reuse,profile=FILE" (any
// subset of keys).
// Throws UsageError naming the bad key/value and listing the valid keys.
CacheSpec parse_cache_spec(const std::string& s);
const std::vector<std::pair<std::string, std::string>>& cache_spec_keys(); // key -> help (for --help)

// Storage of the per-layer latents (K, V [H, L, d]; attention and FFN branch outputs [L, D]) with step stamps and the
// token each entry was computed with. Kept behind this interface so a general latent cache (cache/latent_cache.h)
// can replace the dense in-memory store.
class MdlmLatentStore {
public:
    enum Slot { K = 0, V = 1, Attn = 2, Ffn = 3 };
    virtual ~MdlmLatentStore() = default;
    virtual void reset(int64_t n_layers, int64_t length, int64_t n_heads, int64_t head_dim, int64_t hidden) = 0;
    // The full tensor of a slot (K/V: [H, L, d], Attn/Ffn: [L, D]); anchored rows are read from it.
    virtual torch::Tensor get(int64_t layer, Slot slot) = 0;
    // Writes rows `idx` (int64 [n]) of a slot; K/V values [H, n, d], Attn/Ffn [n, D].
    virtual void put(int64_t layer, Slot slot, const torch::Tensor& idx, const torch::Tensor& values) = 0;
    // Step stamp and token of each position's entry in `layer` (int64 [L]; stamp -1 = empty).
    virtual torch::Tensor& stamp(int64_t layer) = 0;
    virtual torch::Tensor& token(int64_t layer) = 0;
};
std::unique_ptr<MdlmLatentStore> make_dense_latent_store();

struct CacheStats {
    int64_t position_layers_total = 0;    // positions x layers over all steps
    int64_t position_layers_reused = 0;   // anchored ones
    int64_t full_steps = 0;               // steps where everything was recomputed
    std::vector<int64_t> active_per_step; // sum over layers of active positions
    double reused_fraction() const {
        return position_layers_total ? double(position_layers_reused) / double(position_layers_total) : 0.0;
    }
};

// Per-step, per-layer decisions for tests and --show-steps: which positions were active and why.
struct LayerDecision {
    int64_t layer = 0;
    int64_t staleness = 0;
    double gate_mean = 0.0;
    bool full = false;
    torch::Tensor active; // bool [L]
};

// The denoiser the sampler calls: logits for selected positions given the current tokens and time.
class MdlmDenoiser {
public:
    MdlmDenoiser(MdlmModel model, CacheSpec spec, std::unique_ptr<MdlmLatentStore> store = nullptr);

    // Clears the cache for a new sequence of `length` tokens.
    void reset(int64_t length);
    // ids: internal ids [L]; t: diffusion time in (0, 1]; step: global step index (0 = first);
    // positions: int64 [n] rows whose logits are wanted. Returns float logits [n, V] ([MASK] at -inf).
    torch::Tensor logits(const torch::Tensor& ids, double t, int64_t step, const torch::Tensor& positions);

    const CacheSpec& spec() const { return spec_; }
    const CacheStats& stats() const { return stats_; }
    const std::vector<LayerDecision>& last_decisions() const { return decisions_; }
    MdlmModel& model() { return model_; }

    // When set, each step's per-layer residual stream [L, D] (after the block) is passed here with the step's
    // internal ids [L] (calibration).
    std::function<void(int64_t step, int64_t layer, const torch::Tensor& ids, const torch::Tensor& hidden)>
        on_layer_output;
    // Scripted activity for tests: when set, replaces the rule-based active set of (step, layer).
    std::function<torch::Tensor(int64_t step, int64_t layer, const torch::Tensor& rule_active)> override_active;

private:
    torch::Tensor dense_hidden(const torch::Tensor& ids, const torch::Tensor& x0, const torch::Tensor& c, int64_t step);
    torch::Tensor cached_hidden(const torch::Tensor& ids, const torch::Tensor& x0, const torch::Tensor& c, int64_t step,
                                const torch::Tensor& positions);

    MdlmModel model_;
    CacheSpec spec_;
    std::unique_ptr<MdlmLatentStore> store_;
    cache::AnchorProfile profile_; // layer classes (cache/anchor_profile.h)
    bool has_profile_ = false;
    int64_t length_ = 0;
    int64_t total_steps_ = 0;
    Rope rope_;
    CacheStats stats_;
    std::vector<LayerDecision> decisions_;

public:
    // Total steps of the run (for profile time bins); set by the sampler.
    void set_total_steps(int64_t t) { total_steps_ = t; }
};

// The per-position activity rule for one layer, separated so tests can script it:
// active = masked | token changed | (step - stamp > staleness) | stamp < 0 | full; `masked_active` = false drops the
// first term (masked=reuse).
torch::Tensor rule_active(const torch::Tensor& ids, const torch::Tensor& stamp, const torch::Tensor& token,
                          int64_t mask_id, int64_t step, int64_t staleness, bool full, bool masked_active = true);

} // namespace anchor::text
