#include "text/mdlm_cache.h"

#include "cache/io/atomic_file.h"
#include "cache/io/error.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <fstream>
#include <numeric>
#include <sstream>

namespace anchor::text {

// ---- mode strings ---------------------------------------------------------------------------------------------------

const std::vector<std::pair<std::string, std::string>>& cache_spec_keys() {
    static const std::vector<std::pair<std::string, std::string>> keys = {
        {"tau", "gate-mean threshold above which a layer uses stale_high (default 0.95)"},
        {"stale", "max age in steps of an anchored entry (default 2)"},
        {"stale_high", "staleness of layers whose gate mean exceeds tau (default 2*stale)"},
        {"rho", "fraction of anchored positions re-verified by value change, 0..1 (default 0.05)"},
        {"refresh", "recompute everything every R steps, 0 = only the first step (default 0)"},
        {"masked",
         "active: every [MASK] position is recomputed (default); reuse: only those being decoded (dLLM-Cache)"},
        {"profile", "calibrated anchor profile JSON (per-layer, per-time staleness)"}};
    return keys;
}

std::string CacheSpec::to_string() const {
    if (mode == CacheMode::Off) return "off";
    std::ostringstream os;
    os << "anchor:tau=" << anchor.tau_gate << ",stale=" << anchor.stale;
    if (anchor.stale_high >= 0) os << ",stale_high=" << anchor.stale_high;
    os << ",rho=" << anchor.rho << ",refresh=" << anchor.refresh;
    if (anchor.reuse_masked) os << ",masked=reuse";
    if (!anchor.profile.empty()) os << ",profile=" << anchor.profile;
    return os.str();
}

CacheSpec parse_cache_spec(const std::string& s) {
    CacheSpec spec;
    if (s == "off") return spec;
    std::string head = s.substr(0, s.find(':'));
    if (head != "anchor")
        throw UsageError("unknown cache mode '" + s + "' (expected 'off' or 'anchor[:key=value,...]')");
    spec.mode = CacheMode::Anchor;
    if (s.size() <= head.size() + 1) return spec;
    std::string rest = s.substr(head.size() + 1);
    std::stringstream ss(rest);
    std::string item;
    auto valid_keys = [] {
        std::string k;
        for (const auto& [n, h] : cache_spec_keys()) k += (k.empty() ? "" : ", ") + n;
        return k;
    };
    while (std::getline(ss, item, ',')) {
        auto eq = item.find('=');
        if (eq == std::string::npos)
            throw UsageError("cache option '" + item + "' is not key=value (keys: " + valid_keys() + ")");
        std::string k = item.substr(0, eq), v = item.substr(eq + 1);
        auto num = [&](double lo, double hi) {
            size_t used = 0;
            double d = 0;
            try {
                d = std::stod(v, &used);
            } catch (...) {
                used = 0;
            }
            if (used != v.size() || v.empty() || !(d >= lo && d <= hi))
                throw UsageError("cache option " + k + "=" + v + ": expected a number in [" + std::to_string(lo) +
                                 ", " + std::to_string(hi) + "]");
            return d;
        };
        auto integer = [&](int64_t lo) {
            double d = num(static_cast<double>(lo), 1e9);
            if (d != std::floor(d)) throw UsageError("cache option " + k + "=" + v + ": expected an integer");
            return static_cast<int64_t>(d);
        };
        if (k == "tau")
            spec.anchor.tau_gate = num(-1e9, 1e9);
        else if (k == "stale")
            spec.anchor.stale = integer(0);
        else if (k == "stale_high")
            spec.anchor.stale_high = integer(0);
        else if (k == "rho")
            spec.anchor.rho = num(0.0, 1.0);
        else if (k == "refresh")
            spec.anchor.refresh = integer(0);
        else if (k == "masked") {
            if (v != "active" && v != "reuse")
                throw UsageError("cache option masked=" + v + ": expected 'active' or 'reuse'");
            spec.anchor.reuse_masked = v == "reuse";
        } else if (k == "profile") {
            if (v.empty()) throw UsageError("cache option profile= needs a file");
            spec.anchor.profile = v;
        } else
            throw UsageError("unknown cache option '" + k + "' (keys: " + valid_keys() + ")");
    }
    return spec;
}

// ---- storage --------------------------------------------------------------------------------------------------------

namespace {
class DenseLatentStore : public MdlmLatentStore {
public:
    void reset(int64_t n_layers, int64_t L, int64_t H, int64_t d, int64_t D) override {
        slots_.assign(static_cast<size_t>(n_layers), {});
        stamps_.clear();
        tokens_.clear();
        for (auto& s : slots_) {
            // Zero-filled (never read before written: every position is active at step 0).
            s[K] = torch::zeros({H, L, d});
            s[V] = torch::zeros({H, L, d});
            s[Attn] = torch::zeros({L, D});
            s[Ffn] = torch::zeros({L, D});
            stamps_.push_back(torch::full({L}, -1, torch::kInt64));
            tokens_.push_back(torch::full({L}, -1, torch::kInt64));
        }
    }
    torch::Tensor get(int64_t layer, Slot slot) override { return slots_.at(layer)[slot]; }
    void put(int64_t layer, Slot slot, const torch::Tensor& idx, const torch::Tensor& values) override {
        auto& t = slots_.at(layer)[slot];
        t.index_copy_(slot == K || slot == V ? 1 : 0, idx, values);
    }
    torch::Tensor& stamp(int64_t layer) override { return stamps_.at(layer); }
    torch::Tensor& token(int64_t layer) override { return tokens_.at(layer); }

private:
    std::vector<std::array<torch::Tensor, 4>> slots_;
    std::vector<torch::Tensor> stamps_, tokens_;
};
} // namespace

std::unique_ptr<MdlmLatentStore> make_dense_latent_store() {
    return std::make_unique<DenseLatentStore>();
}

// ---- denoiser -------------------------------------------------------------------------------------------------------

torch::Tensor rule_active(const torch::Tensor& ids, const torch::Tensor& stamp, const torch::Tensor& token,
                          int64_t mask_id, int64_t step, int64_t staleness, bool full, bool masked_active) {
    if (full) return torch::ones(ids.sizes(), torch::kBool);
    auto a = (ids != token) | (stamp < 0) | ((step - stamp) > staleness);
    return masked_active ? a | (ids == mask_id) : a;
}

MdlmDenoiser::MdlmDenoiser(MdlmModel model, CacheSpec spec, std::unique_ptr<MdlmLatentStore> store)
    : model_(std::move(model)), spec_(std::move(spec)), store_(std::move(store)) {
    if (!store_) store_ = make_dense_latent_store();
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

void MdlmDenoiser::reset(int64_t length) {
    const auto& c = model_->config();
    length_ = length;
    rope_ = model_->rope(length, torch::TensorOptions().dtype(torch::kFloat32));
    if (spec_.mode == CacheMode::Anchor) store_->reset(c.n_blocks, length, c.n_heads, c.head_dim(), c.hidden_size);
    stats_ = CacheStats{};
    decisions_.clear();
}

torch::Tensor MdlmDenoiser::logits(const torch::Tensor& ids, double t, int64_t step, const torch::Tensor& positions) {
    torch::NoGradGuard ng;
    if (ids.dim() != 1) throw Error("MdlmDenoiser::logits: ids must be 1-D");
    if (ids.size(0) != length_) reset(ids.size(0));
    auto c = model_->conditioning(torch::full({1}, t, torch::kFloat32));
    auto x0 = model_->embed(ids.unsqueeze(0));
    auto h = spec_.mode == CacheMode::Off ? dense_hidden(ids, x0, c, step) : cached_hidden(ids, x0, c, step, positions);
    return model_->head(h.index_select(1, positions), c).squeeze(0);
}

torch::Tensor MdlmDenoiser::dense_hidden(const torch::Tensor& ids, const torch::Tensor& x0, const torch::Tensor& c,
                                         int64_t step) {
    auto x = x0;
    int64_t l = 0;
    for (auto& b : model_->block_list) {
        x = b->forward(x, b->modulation(c), rope_);
        if (on_layer_output) on_layer_output(step, l, ids, x[0]);
        ++l;
    }
    stats_.position_layers_total += length_ * static_cast<int64_t>(model_->block_list.size());
    stats_.active_per_step.push_back(length_ * static_cast<int64_t>(model_->block_list.size()));
    stats_.full_steps++;
    return x;
}

torch::Tensor MdlmDenoiser::cached_hidden(const torch::Tensor& ids, const torch::Tensor& x0, const torch::Tensor& c,
                                          int64_t step, const torch::Tensor& positions) {
    const auto& a = spec_.anchor;
    const auto& cfg = model_->config();
    const int64_t mask_id = model_->internal_mask_id();
    bool full = step == 0 || (a.refresh > 0 && step % a.refresh == 0);
    decisions_.clear();
    auto x = x0;
    int64_t active_total = 0;
    for (int64_t l = 0; l < cfg.n_blocks; ++l) {
        auto& b = model_->block_list[static_cast<size_t>(l)];
        auto m = b->modulation(c);
        double gate_mean = 0.5 * (m.gate_attn.mean().item<double>() + m.gate_ffn.mean().item<double>());
        int64_t stale = has_profile_ ? profile_.staleness(l, step, total_steps_) : a.stale;
        if (gate_mean > a.tau_gate) stale = a.stale_high >= 0 ? a.stale_high : 2 * stale;
        bool layer_full = full || store_->stamp(l).lt(0).any().item<bool>();
        auto active =
            rule_active(ids, store_->stamp(l), store_->token(l), mask_id, step, stale, layer_full, !a.reuse_masked);
        if (a.reuse_masked) active.index_fill_(0, positions, true);
        // V-verify (dLLM-Cache): among anchored candidates re-activate the rho fraction whose value vectors moved
        // most (lowest cosine similarity between the current V and the cached V).
        if (!layer_full && a.rho > 0) {
            auto cidx = torch::nonzero(~active).reshape(-1);
            int64_t nc = cidx.size(0), nv = static_cast<int64_t>(std::ceil(a.rho * static_cast<double>(nc)));
            if (nc > 0 && nv > 0) {
                auto v_now = b->value(b->attn_input(x.index_select(1, cidx), m))[0]; // [H, nc, d]
                auto v_old = store_->get(l, MdlmLatentStore::V).index_select(1, cidx);
                auto flat_now = v_now.permute({1, 0, 2}).reshape({nc, -1});
                auto flat_old = v_old.permute({1, 0, 2}).reshape({nc, -1});
                auto cos = torch::cosine_similarity(flat_now, flat_old, 1, 1e-8);
                auto worst = std::get<1>(torch::topk(cos, std::min(nv, nc), 0, /*largest=*/false));
                active.index_fill_(0, cidx.index_select(0, worst), true);
            }
        }
        if (override_active) active = override_active(step, l, active);
        auto idx = torch::nonzero(active).reshape(-1);
        const int64_t na = idx.size(0);
        if (na > 0) {
            torch::Tensor q, k, v;
            b->qkv(b->attn_input(x.index_select(1, idx), m), rope_.select(idx), q, k, v);
            store_->put(l, MdlmLatentStore::K, idx, k[0]);
            store_->put(l, MdlmLatentStore::V, idx, v[0]);
            auto attn = b->attend(q, store_->get(l, MdlmLatentStore::K).unsqueeze(0),
                                  store_->get(l, MdlmLatentStore::V).unsqueeze(0));
            store_->put(l, MdlmLatentStore::Attn, idx, attn[0]);
        }
        auto y = x + m.gate_attn * store_->get(l, MdlmLatentStore::Attn).unsqueeze(0);
        if (na > 0) store_->put(l, MdlmLatentStore::Ffn, idx, b->ffn(y.index_select(1, idx), m)[0]);
        x = y + m.gate_ffn * store_->get(l, MdlmLatentStore::Ffn).unsqueeze(0);
        store_->stamp(l).index_fill_(0, idx, step);
        store_->token(l).index_copy_(0, idx, ids.index_select(0, idx));
        if (on_layer_output) on_layer_output(step, l, ids, x[0]);
        active_total += na;
        decisions_.push_back({l, stale, gate_mean, layer_full, active});
    }
    stats_.position_layers_total += length_ * cfg.n_blocks;
    stats_.position_layers_reused += length_ * cfg.n_blocks - active_total;
    stats_.active_per_step.push_back(active_total);
    if (active_total == length_ * cfg.n_blocks) stats_.full_steps++;
    return x;
}

} // namespace anchor::text
