// The published masked-diffusion LM families (dlm_model.h): configs, loaders and the range forward with a K/V cache.
#include "text/diffusion/families/dlm_model.h"

#include "cache/io/error.h"
#include "cache/io/json_config.h"
#include "cache/io/model_source.h"
#include "cache/io/weight_map.h"
#include "cache/util/strings.h"
#include "text/gpt2/gpt2_tokenizer.h"
#include "text/io/gguf.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>

namespace fs = std::filesystem;

namespace anchor::text {

const EnumTable<DlmFamily>& dlm_family_table() {
    static const EnumTable<DlmFamily> t = {
        {"diffugpt", DlmFamily::DiffuGpt}, {"llada", DlmFamily::Llada}, {"dream", DlmFamily::Dream}};
    return t;
}

void DlmConfig::validate() const {
    auto bad = [&](const std::string& why) {
        throw Error(enum_name(dlm_family_table(), family) + " config: " + why + " (" + describe() + ")");
    };
    if (vocab_size < 2 || hidden_size < 1 || n_layers < 1 || n_heads < 1 || n_kv_heads < 1) bad("sizes must be >= 1");
    if (hidden_size % n_heads != 0) bad("hidden size must be divisible by the head count");
    if (n_heads % n_kv_heads != 0) bad("the head count must be a multiple of the K/V head count");
    if (family != DlmFamily::DiffuGpt && (intermediate_size < 1 || head_dim() % 2 != 0))
        bad("intermediate size must be >= 1 and the head width even (rotary positions)");
    if (mask_token_id < 0 || mask_token_id >= vocab_size)
        bad("mask token id " + std::to_string(mask_token_id) + " outside the vocabulary [0, " +
            std::to_string(vocab_size) + ")");
    if (!(norm_eps > 0)) bad("norm eps must be > 0");
}

std::string DlmConfig::describe() const {
    std::ostringstream os;
    os << enum_name(dlm_family_table(), family) << " layers=" << n_layers << " hidden=" << hidden_size
       << " heads=" << n_heads << " kv_heads=" << n_kv_heads << " ffn=" << intermediate_size << " vocab=" << vocab_size
       << " mask=" << mask_token_id << " shift=" << (shift ? 1 : 0);
    return os.str();
}

torch::Tensor DlmModel::logits(const torch::Tensor& ids) {
    return forward(ids, 0, ids.size(-1), nullptr);
}

void DlmModel::set_qgemm(kernels::QGemmArithmetic a) {
    if (const auto why = kernels::qgemm_arithmetic_unavailable(a); !why.empty()) throw ParamError("gemm", why);
    qgemm_ = a;
}

namespace {

// softmax(q k^T / sqrt(d)) v over every key (bidirectional), K/V heads shared by groups of query heads.
torch::Tensor dlm_attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
    const int64_t group = q.size(1) / k.size(1);
    auto kk = group > 1 ? k.repeat_interleave(group, 1) : k;
    auto vv = group > 1 ? v.repeat_interleave(group, 1) : v;
    const double scale = 1.0 / std::sqrt(double(q.size(-1)));
    return torch::matmul(torch::softmax(torch::matmul(q, kk.transpose(-2, -1)) * scale, -1), vv);
}

// Writes rows [lo, hi) of a layer's K/V into the cache (allocated for L positions) and returns the whole cached K/V.
std::pair<torch::Tensor, torch::Tensor> dlm_cache_rows(DlmKvCache* kv, size_t layer, int64_t L, int64_t lo,
                                                      const torch::Tensor& k, const torch::Tensor& v) {
    if (!kv) return {k, v};
    if (kv->k.size() <= layer) {
        kv->k.resize(layer + 1), kv->v.resize(layer + 1);
    }
    auto& K = kv->k[layer];
    auto& V = kv->v[layer];
    if (!K.defined() || K.size(2) != L) {
        auto shape = k.sizes().vec();
        shape[2] = L;
        K = torch::zeros(shape, k.options()), V = torch::zeros(shape, v.options());
    }
    K.narrow(2, lo, k.size(2)).copy_(k);
    V.narrow(2, lo, v.size(2)).copy_(v);
    return {K, V};
}

void dlm_check_range(const torch::Tensor& ids, int64_t lo, int64_t hi, const DlmKvCache* kv, int64_t max_pos) {
    if (ids.dim() != 2 || ids.size(0) != 1) throw Error("diffusion LM forward: ids must be [1, L]");
    const int64_t L = ids.size(1);
    if (!(0 <= lo && lo < hi && hi <= L))
        throw Error("diffusion LM forward: range [" + std::to_string(lo) + ", " + std::to_string(hi) +
                    ") outside the " + std::to_string(L) + " positions");
    if (!kv && (lo != 0 || hi != L)) throw Error("diffusion LM forward: a partial range needs a K/V cache");
    if (kv && (lo != 0 || hi != L) && kv->length() != L)
        throw Error("diffusion LM forward: the K/V cache holds " + std::to_string(kv->length()) + " positions, not " +
                    std::to_string(L) + " (run the whole sequence first)");
    if (max_pos > 0 && L > max_pos)
        throw Error("diffusion LM forward: " + std::to_string(L) + " positions exceed the model's " +
                    std::to_string(max_pos));
}

// ---- DiffuGPT: the GPT-2 modules, attention without the causal mask -----------------------------------------------

class DiffuGptModel : public DlmModel {
public:
    DiffuGptModel(DlmConfig c, Gpt2Model m) : DlmModel(std::move(c)), gpt2_(std::move(m)) {}

    torch::Tensor forward(const torch::Tensor& ids, int64_t lo, int64_t hi, DlmKvCache* kv) override {
        torch::NoGradGuard ng;
        dlm_check_range(ids, lo, hi, kv, cfg_.max_positions);
        const int64_t L = ids.size(1), n = hi - lo, C = cfg_.hidden_size, H = cfg_.n_heads, D = cfg_.head_dim();
        auto& m = *gpt2_;
        auto rows = ids.narrow(1, lo, n).to(torch::kLong);
        auto x = m.wte(rows) + m.wpe(torch::arange(lo, hi, torch::kLong));
        for (size_t l = 0; l < m.h->size(); ++l) {
            auto& b = *m.h[l]->as<Gpt2BlockImpl>();
            auto qkv = b.attn->c_attn(b.ln_1(x)).split(C, 2);
            auto heads = [&](const torch::Tensor& t) { return t.reshape({1, n, H, D}).transpose(1, 2); };
            auto [K, V] = dlm_cache_rows(kv, l, L, lo, heads(qkv[1]), heads(qkv[2]));
            auto y = dlm_attend(heads(qkv[0]), K, V).transpose(1, 2).reshape({1, n, C});
            x = x + b.attn->c_proj(y);
            x = x + b.mlp(b.ln_2(x));
        }
        return torch::matmul(m.ln_f(x), m.lm_head().t()).to(torch::kFloat32);
    }
    int64_t weight_bytes() const override {
        int64_t n = 0;
        for (const auto& p : gpt2_->parameters()) n += p.numel() * int64_t(p.element_size());
        return n;
    }

private:
    Gpt2Model gpt2_;
};

// ---- LLaDA / Dream: LLaMA-style blocks -----------------------------------------------------------------------------

using kernels::QWeight;
using kernels::QWeightType;

struct LlamaLayerWeights {
    torch::Tensor attn_norm, qb, kb, vb, ffn_norm;
    QWeight q, k, v, o, gate, up, down;
};

class LlamaLikeModel : public DlmModel {
public:
    LlamaLikeModel(DlmConfig c, QWeight embed, std::vector<LlamaLayerWeights> layers, torch::Tensor norm,
                   QWeight head)
        : DlmModel(std::move(c)), embed_(std::move(embed)), layers_(std::move(layers)), norm_(std::move(norm)),
          head_(std::move(head)) {
        // Rotary inverse frequencies in float32 as LLaMA / Qwen2 compute them: 1 / theta^(2i / d).
        const int64_t d = cfg_.head_dim();
        inv_freq_ = 1.0 / torch::pow(torch::tensor(cfg_.rope_theta, torch::kFloat32),
                                     torch::arange(0, d, 2, torch::kLong).to(torch::kFloat32) / double(d));
    }

    torch::Tensor forward(const torch::Tensor& ids, int64_t lo, int64_t hi, DlmKvCache* kv) override {
        torch::NoGradGuard ng;
        dlm_check_range(ids, lo, hi, kv, 0);
        const int64_t L = ids.size(1), n = hi - lo, C = cfg_.hidden_size, H = cfg_.n_heads, KV = cfg_.n_kv_heads,
                      D = cfg_.head_dim();
        auto x = embed_.gather_rows(ids.narrow(1, lo, n).reshape({n})).reshape({1, n, C});
        auto freqs = torch::outer(torch::arange(lo, hi, torch::kLong).to(torch::kFloat32), inv_freq_);
        auto emb = torch::cat({freqs, freqs}, -1);
        auto cos = emb.cos(), sin = emb.sin();
        auto rope = [&](const torch::Tensor& t) { // rotate-half (LLaMA, Qwen2, LLaDA's RotaryEmbedding)
            auto t1 = t.narrow(-1, 0, D / 2), t2 = t.narrow(-1, D / 2, D / 2);
            return t * cos + torch::cat({-t2, t1}, -1) * sin;
        };
        auto lin = [a = qgemm_](const torch::Tensor& h, const QWeight& w, const torch::Tensor& b) {
            return kernels::qlinear_with(h, w, b, a);
        };
        for (size_t l = 0; l < layers_.size(); ++l) {
            const auto& w = layers_[l];
            auto h = rms(x, w.attn_norm);
            auto q = rope(lin(h, w.q, w.qb).view({1, n, H, D}).transpose(1, 2));
            auto k = rope(lin(h, w.k, w.kb).view({1, n, KV, D}).transpose(1, 2));
            auto v = lin(h, w.v, w.vb).view({1, n, KV, D}).transpose(1, 2);
            auto [K, V] = dlm_cache_rows(kv, l, L, lo, k, v);
            auto y = dlm_attend(q, K, V).transpose(1, 2).reshape({1, n, C});
            x = x + lin(y, w.o, {});
            h = rms(x, w.ffn_norm);
            // SwiGLU (Shazeer 2020): down(silu(gate h) * up h).
            x = x + lin(torch::silu(lin(h, w.gate, {})) * lin(h, w.up, {}), w.down, {});
        }
        return lin(rms(x, norm_), head_, {}).to(torch::kFloat32);
    }
    int64_t weight_bytes() const override {
        auto b = [](const torch::Tensor& t) { return t.defined() ? t.numel() * int64_t(t.element_size()) : 0; };
        int64_t n = embed_.bytes() + b(norm_) + (cfg_.tie_embeddings ? 0 : head_.bytes());
        for (const auto& w : layers_) {
            for (const auto* t : {&w.attn_norm, &w.qb, &w.kb, &w.vb, &w.ffn_norm}) n += b(*t);
            for (const auto* q : {&w.q, &w.k, &w.v, &w.o, &w.gate, &w.up, &w.down}) n += q->bytes();
        }
        return n;
    }

private:
    torch::Tensor rms(const torch::Tensor& x, const torch::Tensor& w) const {
        return x * torch::rsqrt(x.pow(2).mean(-1, true) + cfg_.norm_eps) * w;
    }
    QWeight embed_;
    std::vector<LlamaLayerWeights> layers_;
    torch::Tensor norm_, inv_freq_;
    QWeight head_;
};

// ---- loading -------------------------------------------------------------------------------------------------------

nlohmann::json dlm_read_json(const fs::path& p) {
    std::ifstream f(p);
    if (!f) return nullptr;
    try {
        return nlohmann::json::parse(f);
    } catch (const std::exception& e) {
        throw Error("cannot parse '" + p.string() + "': " + e.what());
    }
}

fs::path dlm_folder_of(const std::string& path) {
    std::error_code ec;
    return fs::is_directory(path, ec) ? fs::path(path) : fs::path(path).parent_path();
}

// Ids of named added tokens from tokenizer.json / added_tokens.json next to the weights.
std::map<std::string, int64_t> dlm_added_tokens(const fs::path& dir) {
    std::map<std::string, int64_t> out;
    const auto at = dlm_read_json(dir / "added_tokens.json");
    if (at.is_object())
        for (const auto& [k, v] : at.items())
            if (v.is_number_integer()) out[k] = v.get<int64_t>();
    const auto tj = dlm_read_json(dir / "tokenizer.json");
    if (tj.is_object() && tj.contains("added_tokens") && tj["added_tokens"].is_array())
        for (const auto& t : tj["added_tokens"])
            if (t.contains("content") && t.contains("id") && t["content"].is_string())
                out[t["content"].get<std::string>()] = t["id"].get<int64_t>();
    return out;
}

std::vector<int64_t> dlm_id_list(const nlohmann::json& j, const std::string& key) {
    std::vector<int64_t> out;
    if (!j.is_object() || !j.contains(key)) return out;
    const auto& v = j[key];
    if (v.is_number_integer()) out.push_back(v.get<int64_t>());
    if (v.is_array())
        for (const auto& e : v)
            if (e.is_number_integer()) out.push_back(e.get<int64_t>());
    return out;
}

std::string dlm_shape_str(const std::vector<int64_t>& s) {
    std::string o = "[";
    for (size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
    return o + "]";
}

// Takes named tensors out of a WeightMap as float32, collecting every problem for one error at the end.
class DlmTensorTaker {
public:
    DlmTensorTaker(const WeightMap& w, std::string path) : w_(w), path_(std::move(path)) {}
    torch::Tensor take(const std::string& name, const std::vector<int64_t>& shape, bool optional = false) {
        if (!w_.has(name)) {
            if (!optional) problems_.push_back("missing '" + name + "' " + dlm_shape_str(shape));
            return {};
        }
        used_.insert(name);
        const auto s = w_.shape(name);
        if (s != shape) {
            problems_.push_back("'" + name + "' in '" + w_.source(name) + "': expected shape " + dlm_shape_str(shape) +
                                ", got " + dlm_shape_str(s));
            return {};
        }
        return w_.get(name).to(torch::kFloat32).contiguous();
    }
    void finish(const std::vector<std::string>& ignore_regex = {}) {
        for (const auto& n : w_.names()) {
            if (used_.count(n)) continue;
            bool ignored = false;
            for (const auto& r : ignore_regex) ignored = ignored || std::regex_match(n, std::regex(r));
            if (!ignored) problems_.push_back("unexpected '" + n + "'");
        }
        if (problems_.empty()) return;
        std::string m = "model '" + path_ + "': " + std::to_string(problems_.size()) + " tensor problem(s):";
        for (size_t i = 0; i < problems_.size() && i < 12; ++i) m += " " + problems_[i] + ";";
        if (problems_.size() > 12) m += " ...";
        throw Error(m);
    }

private:
    const WeightMap& w_;
    std::string path_;
    std::set<std::string> used_;
    std::vector<std::string> problems_;
};

DlmConfig llama_like_config(const JsonConfig& c, DlmFamily fam) {
    DlmConfig d;
    d.family = fam;
    const std::vector<std::string> required =
        fam == DlmFamily::Llada
            ? std::vector<std::string>{"d_model", "n_heads", "n_layers", "vocab_size"}
            : std::vector<std::string>{"hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
                                       "vocab_size"};
    for (const auto& k : required)
        if (!c.has(k))
            c.fail(std::string(fam == DlmFamily::Llada ? "LLaDA" : "Dream") + " config: '" + k +
                   "' is missing (the decoder's sizes come from config.json)");
    if (fam == DlmFamily::Llada) {
        // LLaDAConfig (OLMo's ModelConfig keys).
        for (const char* k : {"input_emb_norm", "scale_logits", "alibi", "include_bias"})
            c.reject(k, "is not supported (LLaDA's published models have it false)");
        if (!c.get_bool("rope", true)) c.fail("'rope' must be true (LLaDA runs with rotary positions)");
        const std::string act = c.get_string("activation_type", "silu"), block = c.get_string("block_type", "llama"),
                          norm = c.get_string("layer_norm_type", "rms");
        if (act != "silu" || block != "llama" || norm != "rms")
            c.fail("only LLaDA's llama blocks (block_type llama, activation_type silu, layer_norm_type rms) are supported");
        d.hidden_size = c.get_int64("d_model", 0);
        d.n_heads = c.get_int64("n_heads", 0);
        d.n_kv_heads = c.get_int64("n_kv_heads", d.n_heads);
        d.n_layers = c.get_int64("n_layers", 0);
        d.intermediate_size = c.get_int64("mlp_hidden_size", c.get_int64("mlp_ratio", 4) * d.hidden_size);
        d.vocab_size = c.get_int64("embedding_size", c.get_int64("vocab_size", 0));
        d.rope_theta = c.get_double("rope_theta", 10000.0);
        d.norm_eps = c.get_double("rms_norm_eps", 1e-5);
        d.max_positions = c.get_int64("max_sequence_length", 4096);
        d.tie_embeddings = c.get_bool("weight_tying", false);
        d.qkv_bias = c.get_bool("include_qkv_bias", false);
        d.mask_token_id = c.get_int64("mask_token_id", 126336); // LLaDA's [MASK] (generate.py)
        d.shift = false;
    } else {
        d.hidden_size = c.get_int64("hidden_size", 0);
        d.n_heads = c.get_int64("num_attention_heads", 0);
        d.n_kv_heads = c.get_int64("num_key_value_heads", d.n_heads);
        d.n_layers = c.get_int64("num_hidden_layers", 0);
        d.intermediate_size = c.get_int64("intermediate_size", 0);
        d.vocab_size = c.get_int64("vocab_size", 0);
        d.rope_theta = c.get_double("rope_theta", 10000.0);
        d.norm_eps = c.get_double("rms_norm_eps", 1e-6);
        d.max_positions = c.get_int64("max_position_embeddings", 32768);
        d.tie_embeddings = c.get_bool("tie_word_embeddings", false);
        d.qkv_bias = true; // Qwen2
        d.mask_token_id = c.get_int64("mask_token_id", -1);
        d.shift = true;
        if (c.get_string("hidden_act", "silu") != "silu") c.fail("'hidden_act' must be silu");
    }
    d.eos_token_ids = dlm_id_list(c.json(), "eos_token_id");
    return d;
}

LoadedDlm load_llama_like(const std::string& path, const ModelSource& src, DlmFamily fam, int64_t mask_id,
                          std::optional<QWeightType> weights) {
    if (src.config_file.empty())
        throw Error(enum_name(dlm_family_table(), fam) + " model '" + path + "' has no config.json next to it");
    const JsonConfig c = JsonConfig::load(src.config_file, enum_name(dlm_family_table(), fam) + " config");
    DlmConfig d = llama_like_config(c, fam);
    if (mask_id >= 0) d.mask_token_id = mask_id;
    d.validate();
    const WeightMap w = src.load_weights();
    DlmTensorTaker t(w, path);
    const int64_t D = d.hidden_size, F = d.intermediate_size, KVD = d.n_kv_heads * d.head_dim(), V = d.vocab_size;
    const bool llada = fam == DlmFamily::Llada;
    const std::string pre = llada ? "model.transformer." : "model.";
    // Matrices one at a time: float32 for as long as it takes to convert each to the kept storage.
    const QWeightType wt = weights.value_or(QWeightType::F32);
    auto tq = [&](const std::string& name, const std::vector<int64_t>& shape) {
        auto f = t.take(name, shape);
        return f.defined() ? QWeight::from_float(f, wt) : QWeight();
    };
    auto embed = tq(pre + (llada ? "wte.weight" : "embed_tokens.weight"), {V, D});
    auto norm = t.take(pre + (llada ? "ln_f.weight" : "norm.weight"), {D});
    QWeight head;
    if (!d.tie_embeddings) head = tq(llada ? pre + "ff_out.weight" : "lm_head.weight", {V, D});
    std::vector<LlamaLayerWeights> layers(d.n_layers);
    for (int64_t i = 0; i < d.n_layers; ++i) {
        auto& l = layers[i];
        const std::string b = pre + (llada ? "blocks." : "layers.") + std::to_string(i) + ".";
        if (llada) {
            l.attn_norm = t.take(b + "attn_norm.weight", {D});
            l.ffn_norm = t.take(b + "ff_norm.weight", {D});
            l.q = tq(b + "q_proj.weight", {D, D});
            l.k = tq(b + "k_proj.weight", {KVD, D});
            l.v = tq(b + "v_proj.weight", {KVD, D});
            l.o = tq(b + "attn_out.weight", {D, D});
            l.gate = tq(b + "ff_proj.weight", {F, D});
            l.up = tq(b + "up_proj.weight", {F, D});
            l.down = tq(b + "ff_out.weight", {D, F});
            if (d.qkv_bias) {
                l.qb = t.take(b + "q_proj.bias", {D}), l.kb = t.take(b + "k_proj.bias", {KVD});
                l.vb = t.take(b + "v_proj.bias", {KVD});
            }
        } else {
            l.attn_norm = t.take(b + "input_layernorm.weight", {D});
            l.ffn_norm = t.take(b + "post_attention_layernorm.weight", {D});
            l.q = tq(b + "self_attn.q_proj.weight", {D, D});
            l.k = tq(b + "self_attn.k_proj.weight", {KVD, D});
            l.v = tq(b + "self_attn.v_proj.weight", {KVD, D});
            l.o = tq(b + "self_attn.o_proj.weight", {D, D});
            l.qb = t.take(b + "self_attn.q_proj.bias", {D});
            l.kb = t.take(b + "self_attn.k_proj.bias", {KVD});
            l.vb = t.take(b + "self_attn.v_proj.bias", {KVD});
            l.gate = tq(b + "mlp.gate_proj.weight", {F, D});
            l.up = tq(b + "mlp.up_proj.weight", {F, D});
            l.down = tq(b + "mlp.down_proj.weight", {D, F});
        }
    }
    // Tied checkpoints may still carry the head; rotary buffers carry no weights.
    t.finish({".*rotary_emb\\.inv_freq", "lm_head\\.weight", "model\\.transformer\\.ff_out\\.weight"});
    if (d.tie_embeddings) head = embed;
    LoadedDlm out;
    out.folder = dlm_folder_of(path).string();
    out.config_path = src.config_file;
    // End of a chat turn: the instruct models stop at <|eot_id|> (LLaDA) / <|im_end|> (Dream) before padding.
    const auto added = dlm_added_tokens(out.folder);
    for (const char* tok : {"<|eot_id|>", "<|im_end|>", "<|endoftext|>"}) {
        auto it = added.find(tok);
        if (it != added.end() && std::find(d.eos_token_ids.begin(), d.eos_token_ids.end(), it->second) ==
                                     d.eos_token_ids.end())
            d.eos_token_ids.push_back(it->second);
    }
    out.model = std::make_shared<LlamaLikeModel>(d, embed, std::move(layers), norm, head);
    return out;
}

bool dlm_is_diffugpt_name(const std::string& n) {
    return n == "embed_tokens.weight" || n.rfind("denoise_model.", 0) == 0 || n == "lm_head.weight" ||
           n.rfind("transformer.", 0) == 0 || n == "wte.weight" || n == "wpe.weight" || n.rfind("h.", 0) == 0 ||
           n.rfind("ln_f.", 0) == 0;
}

LoadedDlm load_diffugpt(const std::string& path, const ModelSource& src, int64_t mask_id) {
    WeightMap raw = src.load_weights();
    WeightMap w = raw.renamed([](const std::string& n) -> std::string {
        if (n == "embed_tokens.weight") return "wte.weight";
        for (const std::string p : {"denoise_model.", "transformer."})
            if (n.rfind(p, 0) == 0) return n.substr(p.size());
        return n;
    });
    torch::Tensor lm_head = w.has("lm_head.weight") ? w.get("lm_head.weight") : torch::Tensor();
    if (!w.has("wte.weight")) {
        // A deduplicated tied checkpoint may keep only the head.
        if (!lm_head.defined())
            throw Error("DiffuGPT model '" + path + "': neither 'embed_tokens.weight' nor 'lm_head.weight' found");
        w.insert("wte.weight", lm_head, raw.source("lm_head.weight"));
    }
    Gpt2Config g = src.config_file.empty() ? Gpt2Config::detect_from_weights(w)
                                           : Gpt2Config::from_json_file(src.config_file);
    // DiffuGPT resizes GPT-2's table for [MASK] (to a multiple of 2); the config may still name the base vocabulary.
    g.vocab_size = w.shape("wte.weight").at(0);
    g.validate();
    auto model = Gpt2Model(g);
    w.load_into(*model, {"lm_head\\.weight", "h\\.[0-9]+\\.attn\\.(bias|masked_bias)"});
    model->finalize(lm_head.defined() ? lm_head.to(torch::kFloat32) : torch::Tensor());

    DlmConfig d;
    d.family = DlmFamily::DiffuGpt;
    d.gpt2 = g;
    d.vocab_size = g.vocab_size, d.hidden_size = g.n_embd, d.n_layers = g.n_layer, d.n_heads = d.n_kv_heads = g.n_head;
    d.intermediate_size = g.inner(), d.max_positions = g.n_positions, d.norm_eps = g.layer_norm_epsilon;
    d.shift = true;
    d.tie_embeddings = !lm_head.defined() || model->lm_head_tied();
    const fs::path dir = dlm_folder_of(path);
    const auto cj = src.config_file.empty() ? nlohmann::json() : dlm_read_json(src.config_file);
    d.mask_token_id = mask_id;
    if (d.mask_token_id < 0 && cj.is_object() && cj.contains("mask_token_id") && cj["mask_token_id"].is_number())
        d.mask_token_id = cj["mask_token_id"].get<int64_t>();
    if (d.mask_token_id < 0) {
        const auto added = dlm_added_tokens(dir);
        auto it = added.find("[MASK]");
        if (it != added.end()) d.mask_token_id = it->second;
    }
    // DiffuGPT's tokenizer appends [MASK] right after GPT-2's 50257 tokens.
    if (d.mask_token_id < 0 && g.vocab_size > Gpt2Tokenizer::kEndOfText + 1) d.mask_token_id = Gpt2Tokenizer::kEndOfText + 1;
    if (d.mask_token_id < 0)
        throw Error("DiffuGPT model '" + path + "': no [MASK] id (config mask_token_id, added_tokens.json or " +
                    "tokenizer.json) and the vocabulary (" + std::to_string(g.vocab_size) + ") has no row after GPT-2's");
    d.eos_token_ids = dlm_id_list(cj, "eos_token_id");
    if (d.eos_token_ids.empty()) d.eos_token_ids = {Gpt2Tokenizer::kEndOfText};
    d.validate();
    LoadedDlm out;
    out.folder = dir.string();
    out.config_path = src.config_file;
    out.model = std::make_shared<DiffuGptModel>(d, model);
    return out;
}

// A LLaDA / Dream GGUF as llama.cpp's convert_hf_to_gguf.py writes it: tensor names token_embd, blk.N.{attn_norm,
// attn_q, attn_k, attn_v, attn_output, ffn_norm, ffn_gate, ffn_up, ffn_down}, output_norm, output; hyperparameters
// under "<arch>.": embedding_length, block_count, feed_forward_length, attention.head_count(_kv),
// rope.freq_base, attention.layer_norm_rms_epsilon, context_length; tokenizer.ggml.mask_token_id / eos_token_id;
// diffusion.shift_logits. Every weight is dequantised to float32 (gguf.h).
LoadedDlm load_dlm_gguf(const std::string& path, std::optional<DlmFamily> family, int64_t mask_id,
                        std::optional<QWeightType> weights) {
    const auto g = GgufFile::open(path);
    const auto& kv = g->metadata();
    const std::string arch = kv.value("general.architecture", std::string());
    DlmFamily fam;
    if (family)
        fam = *family;
    else if (arch == "llada")
        fam = DlmFamily::Llada;
    else if (arch == "dream")
        fam = DlmFamily::Dream;
    else
        throw Error("GGUF file '" + path + "': general.architecture '" + arch +
                    "' is not llada or dream (DiffuGPT GGUFs are not read yet)");
    if (fam == DlmFamily::DiffuGpt) throw Error("GGUF file '" + path + "': DiffuGPT GGUFs are not read yet");
    auto num = [&](const std::string& key, double def, bool required) -> double {
        const std::string k = arch + "." + key;
        if (kv.contains(k) && kv[k].is_number()) return kv[k].get<double>();
        if (required) throw Error("GGUF file '" + path + "': metadata '" + k + "' is missing");
        return def;
    };
    DlmConfig d;
    d.family = fam;
    d.hidden_size = int64_t(num("embedding_length", 0, true));
    d.n_layers = int64_t(num("block_count", 0, true));
    d.n_heads = int64_t(num("attention.head_count", 0, true));
    d.n_kv_heads = int64_t(num("attention.head_count_kv", double(d.n_heads), false));
    d.intermediate_size = int64_t(num("feed_forward_length", 0, true));
    d.rope_theta = num("rope.freq_base", 10000.0, false);
    d.norm_eps = num("attention.layer_norm_rms_epsilon", 1e-5, false);
    d.max_positions = int64_t(num("context_length", 0, false));
    d.vocab_size = g->info("token_embd.weight").shape.at(0);
    d.shift = kv.contains("diffusion.shift_logits") ? kv["diffusion.shift_logits"].get<bool>() : fam == DlmFamily::Dream;
    d.qkv_bias = g->has("blk.0.attn_q.bias");
    d.tie_embeddings = !g->has("output.weight");
    d.mask_token_id = mask_id >= 0 ? mask_id
                      : kv.contains("tokenizer.ggml.mask_token_id")
                          ? kv["tokenizer.ggml.mask_token_id"].get<int64_t>()
                          : (fam == DlmFamily::Llada ? 126336 : -1);
    for (const char* k : {"tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"})
        if (kv.contains(k)) d.eos_token_ids.push_back(kv[k].get<int64_t>());
    d.validate();
    const int64_t D = d.hidden_size, F = d.intermediate_size, hd = d.head_dim(), KVD = d.n_kv_heads * hd;
    std::vector<std::string> problems;
    auto present = [&](const std::string& name, const std::vector<int64_t>& shape) {
        if (!g->has(name)) {
            problems.push_back("missing '" + name + "'");
            return false;
        }
        if (g->info(name).shape != shape) {
            problems.push_back("'" + name + "': expected shape " + dlm_shape_str(shape) + ", got " +
                               dlm_shape_str(g->info(name).shape));
            return false;
        }
        return true;
    };
    auto take = [&](const std::string& name, const std::vector<int64_t>& shape) -> torch::Tensor {
        return present(name, shape) ? g->dequantize(name) : torch::Tensor();
    };
    // Matrices stay in the file's storage, read from the map, unless `weights` asks for another.
    auto takeq = [&](const std::string& name, const std::vector<int64_t>& shape) -> QWeight {
        if (!present(name, shape)) return {};
        const uint32_t type = g->info(name).type;
        std::optional<QWeightType> stored;
        switch (type) {
        case uint32_t(GgmlType::F32): stored = QWeightType::F32; break;
        case uint32_t(GgmlType::F16): stored = QWeightType::F16; break;
        case uint32_t(GgmlType::BF16): stored = QWeightType::BF16; break;
        case uint32_t(GgmlType::Q8_0): stored = QWeightType::Q8_0; break;
        case uint32_t(GgmlType::Q4_0): stored = QWeightType::Q4_0; break;
        default: break; // dequantize() names the unsupported type
        }
        if (stored && (!weights || *weights == *stored))
            return QWeight::from_stored(gguf_stored_view(g, name), *stored, shape[0], shape[1],
                                        "GGUF file '" + path + "', tensor '" + name + "'");
        return QWeight::from_float(g->dequantize(name), weights.value_or(QWeightType::F32));
    };
    // llama.cpp stores LLaDA's q/k rows for its adjacent-pair rotary (convert_hf_to_gguf.py permutes them): per head,
    // row (i, half) goes back to (half, i) for the rotate-half arithmetic here.
    auto rotate_perm = [&](int64_t heads) {
        return torch::arange(heads * hd, torch::kLong).reshape({heads, hd / 2, 2}).transpose(1, 2).reshape({-1});
    };
    auto rotate_half_rows = [&](torch::Tensor w, int64_t heads) {
        if (!w.defined() || fam != DlmFamily::Llada) return w;
        return w.index_select(0, rotate_perm(heads)).contiguous();
    };
    auto rotate_half_qrows = [&](QWeight w, int64_t heads) {
        if (!w.defined() || fam != DlmFamily::Llada) return w;
        return w.permute_rows(rotate_perm(heads));
    };
    auto embed = takeq("token_embd.weight", {d.vocab_size, D});
    auto norm = take("output_norm.weight", {D});
    auto head = d.tie_embeddings ? embed : takeq("output.weight", {d.vocab_size, D});
    std::vector<LlamaLayerWeights> layers(d.n_layers);
    for (int64_t i = 0; i < d.n_layers; ++i) {
        auto& l = layers[i];
        const std::string b = "blk." + std::to_string(i) + ".";
        l.attn_norm = take(b + "attn_norm.weight", {D});
        l.ffn_norm = take(b + "ffn_norm.weight", {D});
        l.q = rotate_half_qrows(takeq(b + "attn_q.weight", {D, D}), d.n_heads);
        l.k = rotate_half_qrows(takeq(b + "attn_k.weight", {KVD, D}), d.n_kv_heads);
        l.v = takeq(b + "attn_v.weight", {KVD, D});
        l.o = takeq(b + "attn_output.weight", {D, D});
        if (d.qkv_bias) {
            l.qb = rotate_half_rows(take(b + "attn_q.bias", {D}), d.n_heads);
            l.kb = rotate_half_rows(take(b + "attn_k.bias", {KVD}), d.n_kv_heads);
            l.vb = take(b + "attn_v.bias", {KVD});
        }
        l.gate = takeq(b + "ffn_gate.weight", {F, D});
        l.up = takeq(b + "ffn_up.weight", {F, D});
        l.down = takeq(b + "ffn_down.weight", {D, F});
    }
    if (!problems.empty()) {
        std::string m = "GGUF file '" + path + "': " + std::to_string(problems.size()) + " tensor problem(s):";
        for (size_t i = 0; i < problems.size() && i < 12; ++i) m += " " + problems[i] + ";";
        throw Error(m);
    }
    LoadedDlm out;
    out.folder = dlm_folder_of(path).string();
    out.model = std::make_shared<LlamaLikeModel>(d, embed, std::move(layers), norm, head);
    return out;
}

std::optional<DlmFamily> family_of_config(const nlohmann::json& j) {
    if (!j.is_object()) return std::nullopt;
    const std::string type = j.value("model_type", std::string());
    std::vector<std::string> arch;
    if (j.contains("architectures") && j["architectures"].is_array())
        for (const auto& a : j["architectures"])
            if (a.is_string()) arch.push_back(a.get<std::string>());
    auto has_arch = [&](const std::string& prefix) {
        for (const auto& a : arch)
            if (a.rfind(prefix, 0) == 0) return true;
        return false;
    };
    if (type == "llada" || has_arch("LLaDA")) return DlmFamily::Llada;
    if (type == "Dream" || type == "dream" || has_arch("Dream")) return DlmFamily::Dream;
    return std::nullopt;
}

} // namespace

std::optional<DlmFamily> detect_dlm_family(const std::string& path) {
    if (path.size() > 5 && path.compare(path.size() - 5, 5, ".gguf") == 0) {
        try {
            const std::string arch = GgufFile::open(path)->metadata().value("general.architecture", std::string());
            if (arch == "llada") return DlmFamily::Llada;
            if (arch == "dream") return DlmFamily::Dream;
        } catch (const Error&) {
        }
        return std::nullopt;
    }
    const fs::path dir = dlm_folder_of(path);
    const auto cj = dlm_read_json(dir / "config.json");
    if (auto f = family_of_config(cj)) return f;
    // DiffuGPT's hub checkpoints keep GPT-2's config; their tensor names (DiscreteDiffusionModel) tell them apart.
    try {
        const ModelSource src = resolve_model(path, {dlm_is_diffugpt_name, "model"});
        for (const auto& f : src.weight_files) {
            const WeightMap w = WeightMap::load_files({f});
            if (w.has("embed_tokens.weight") || w.has("denoise_model.wpe.weight")) return DlmFamily::DiffuGpt;
        }
    } catch (const Error&) {
    }
    return std::nullopt;
}

LoadedDlm load_dlm(const std::string& path, std::optional<DlmFamily> family, int64_t mask_token_id,
                   std::optional<QWeightType> weights) {
    if (path.size() > 5 && path.compare(path.size() - 5, 5, ".gguf") == 0)
        return load_dlm_gguf(path, family, mask_token_id, weights);
    if (!family) family = detect_dlm_family(path);
    if (!family)
        throw Error("'" + path + "' is not a DiffuGPT, LLaDA or Dream model (config.json model_type/architectures, " +
                    "DiffuGPT's embed_tokens/denoise_model tensor names); name the family with --family");
    switch (*family) {
    case DlmFamily::DiffuGpt:
        if (weights && *weights != QWeightType::F32)
            throw Error("DiffuGPT model '" + path + "': --weights-dtype " +
                        enum_name(kernels::qweight_type_table(), *weights) +
                        " is for LLaDA and Dream (DiffuGPT's 124M / 355M parameters run in float32)");
        return load_diffugpt(path, resolve_model(path, {dlm_is_diffugpt_name, "DiffuGPT model"}), mask_token_id);
    case DlmFamily::Llada:
        return load_llama_like(
            path, resolve_model(path, {[](const std::string& n) { return n.rfind("model.transformer.", 0) == 0; },
                                       "LLaDA model"}),
            DlmFamily::Llada, mask_token_id, weights);
    case DlmFamily::Dream:
        return load_llama_like(path,
                               resolve_model(path, {[](const std::string& n) {
                                                        return n.rfind("model.", 0) == 0 || n == "lm_head.weight";
                                                    },
                                                    "Dream model"}),
                               DlmFamily::Dream, mask_token_id, weights);
    }
    throw Error("unknown diffusion LM family");
}

} // namespace anchor::text
