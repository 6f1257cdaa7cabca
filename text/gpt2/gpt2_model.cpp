// GPT-2 model, loader and streaming; semantics in tests/golden/text/README.md sec. 2-3.
#include "text/gpt2/gpt2_model.h"

#include "text/gpt2/gpt2_tokenizer.h"

#include "cache/io/error.h"
#include "cache/io/json_config.h"
#include "cache/io/model_source.h"
#include "cache/io/safetensors.h"
#include "cache/io/weight_map.h"
#include "cache/util/strings.h"
#include "kernels/attention.h"
#include "kernels/decode_ops.h"
#include "kernels/dispatch.h"
#include "kernels/gemv.h"
#include "kernels/gemv_packed.h"
#include "kernels/op_timing.h"
#include "text/params.h"

#include <nlohmann/json.hpp>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <regex>
#include <set>
#include <sstream>

namespace fs = std::filesystem;

namespace anchor::text {

namespace {

std::string strip_transformer(const std::string& n) {
    static const std::string p = "transformer.";
    return n.rfind(p, 0) == 0 ? n.substr(p.size()) : n;
}

bool is_gpt2_tensor_name(const std::string& raw) {
    const std::string n = strip_transformer(raw);
    return n == "wte.weight" || n == "wpe.weight" || n == "lm_head.weight" || n.rfind("h.", 0) == 0 ||
           n.rfind("ln_f.", 0) == 0;
}

std::atomic<bool> g_fast_decode{true};

} // namespace

void set_fast_decode_kernel(bool on) {
    g_fast_decode = on;
}
bool fast_decode_kernel() {
    return g_fast_decode;
}
std::string decode_kernel() {
    if (!g_fast_decode) return "torch::addmv/mv (reference)";
    return kernels::gemv_isa();
}

// ---- config ------------------------------------------------------------------------------------------------------

bool Gpt2Config::tanh_gelu() const {
    return activation != "gelu";
}

void Gpt2Config::validate() const {
    auto bad = [&](const std::string& why) { throw Error("GPT-2 config: " + why + " (" + describe() + ")"); };
    if (n_layer < 1 || n_head < 1 || n_embd < 1 || n_positions < 1 || vocab_size < 1) bad("sizes must be >= 1");
    if (n_embd % n_head != 0) bad("n_embd must be divisible by n_head");
    if (!(layer_norm_epsilon > 0)) bad("layer_norm_epsilon must be > 0");
    static const std::set<std::string> acts = {"gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu"};
    if (!acts.count(activation)) bad("unsupported activation_function '" + activation + "'");
}

std::string Gpt2Config::describe() const {
    std::ostringstream os;
    os << "n_layer=" << n_layer << " n_head=" << n_head << " n_embd=" << n_embd << " n_positions=" << n_positions
       << " vocab_size=" << vocab_size << " n_inner=" << inner() << " eps=" << layer_norm_epsilon
       << " activation=" << activation;
    return os.str();
}

namespace {

// The fields from_json reads and to_json writes under HF's names.
std::vector<JsonField> json_fields(Gpt2Config& g) {
    return {ANCHOR_JSON_FIELD(g, n_layer),
            ANCHOR_JSON_FIELD(g, n_head),
            ANCHOR_JSON_FIELD(g, n_embd),
            ANCHOR_JSON_FIELD(g, n_positions),
            ANCHOR_JSON_FIELD(g, vocab_size),
            ANCHOR_JSON_FIELD(g, n_inner),
            ANCHOR_JSON_FIELD(g, layer_norm_epsilon),
            JsonField{"activation_function", &g.activation}};
}

} // namespace

Gpt2Config Gpt2Config::from_json(const nlohmann::json& j, const std::string& source) {
    const JsonConfig c(j, source);
    bool is_gpt2 = c.get_string("model_type", "") == "gpt2";
    for (const auto& a : c.get_string_list("architectures", {})) is_gpt2 = is_gpt2 || a.rfind("GPT2", 0) == 0;
    if (!is_gpt2) c.fail("not a GPT-2 config (model_type '" + c.get_string("model_type", "?") + "')");
    Gpt2Config g;
    g.n_positions = c.get_int64("n_ctx", g.n_positions); // older configs; n_positions wins when both are there
    c.read(json_fields(g));
    g.validate();
    return g;
}

nlohmann::json Gpt2Config::to_json() const {
    Gpt2Config g = *this;
    nlohmann::json j = json_of(json_fields(g));
    if (n_inner == 0) j["n_inner"] = nullptr; // HF: None means 4 * n_embd (0 would be a zero-width MLP)
    j["n_ctx"] = n_positions;                 // older readers
    j["architectures"] = {"GPT2LMHeadModel"};
    j["model_type"] = "gpt2";
    j["bos_token_id"] = j["eos_token_id"] = Gpt2Tokenizer::kEndOfText;
    j["embd_pdrop"] = j["attn_pdrop"] = j["resid_pdrop"] = 0.0;
    j["initializer_range"] = 0.02;
    j["tie_word_embeddings"] = true;
    return j;
}

Gpt2Config Gpt2Config::from_json_file(const std::string& path) {
    return from_json(JsonConfig::load(path, "GPT-2 config").json(), path);
}

Gpt2Config Gpt2Config::detect_from_weights(const WeightMap& w, int64_t n_head_hint) {
    std::vector<std::string> missing;
    for (const char* n : {"wte.weight", "wpe.weight", "h.0.mlp.c_fc.weight"})
        if (!w.has(n)) missing.push_back(n);
    if (!missing.empty()) {
        std::string m;
        for (const auto& n : missing) m += " " + n;
        throw Error("cannot detect the GPT-2 configuration from the weights: missing" + m);
    }
    Gpt2Config c;
    const auto wte = w.shape("wte.weight"), wpe = w.shape("wpe.weight"), fc = w.shape("h.0.mlp.c_fc.weight");
    if (wte.size() != 2 || wpe.size() != 2 || fc.size() != 2)
        throw Error("cannot detect the GPT-2 configuration: wte/wpe/c_fc weights must be 2-D");
    c.vocab_size = wte[0];
    c.n_embd = wte[1];
    c.n_positions = wpe[0];
    c.n_inner = fc[1];
    static const std::regex layer_re(R"(h\.([0-9]+)\..*)");
    int64_t n_layer = 0;
    for (const auto& n : w.names()) {
        std::smatch m;
        if (std::regex_match(n, m, layer_re)) n_layer = std::max<int64_t>(n_layer, std::stoll(m[1].str()) + 1);
    }
    c.n_layer = n_layer;
    // GPT-2 checkpoints all use 64-wide heads; shapes cannot tell the head count otherwise.
    c.n_head = n_head_hint > 0 ? n_head_hint : std::max<int64_t>(1, c.n_embd / 64);
    c.validate();
    return c;
}

// ---- modules -----------------------------------------------------------------------------------------------------

Conv1DImpl::Conv1DImpl(int64_t in, int64_t out) {
    weight = register_parameter("weight", torch::zeros({in, out}));
    bias = register_parameter("bias", torch::zeros({out}));
}

void DecodeRows::set_copies(DecodeWeights dw) {
    torch::NoGradGuard ng;
    const bool rows = f32.defined();
    f16 = dw == DecodeWeights::F16 && rows ? kernels::huge_page_copy(f32.to(torch::kFloat16)) : torch::Tensor();
    // q4_0 rows of a width the 512-bit kernel takes are re-laid out for it (kernels/gemv_packed.h: the same blocks and
    // scales, bytes and rounding; the order the kernel reads them in), which saves the per-block nibble unpacking.
    // q8_0 keeps llama.cpp's block order: streamed from memory, its packed kernel was slower than the block kernel at
    // one and two threads (tests/bench/gemv_decode_bench), as nothing is left to unpack and the block kernel's loads
    // are already contiguous.
    const bool packed = rows && kernels::packed_rows_apply(f32.size(1));
    torch::Tensor q;
    if (dw == DecodeWeights::Q8_0 && rows) {
        q = kernels::quantize_q8_0(f32);
        q8 = kernels::huge_page_copy(q);
    } else {
        q8 = torch::Tensor();
    }
    if (dw == DecodeWeights::Q4_0 && rows) {
        q = kernels::quantize_q4_0(f32);
        q4 = kernels::huge_page_copy(packed ? kernels::pack_q4_0_rows(q, f32.size(1)) : q);
    } else {
        q4 = torch::Tensor();
    }
}

bool DecodeRows::on_cpu_f32() const {
    return f32.defined() && f32.device().is_cpu() && f32.scalar_type() == torch::kFloat32;
}

int64_t DecodeRows::bytes() const {
    if (q4.defined()) return q4.nbytes();
    if (q8.defined()) return q8.nbytes();
    if (f16.defined()) return f16.nbytes();
    return f32.numel() * int64_t(f32.element_size());
}

void DecodeRows::gemv(const float* x, const float* b, float* y) const {
    const int64_t in = f32.size(1), out = f32.size(0);
    if (q4.defined() && kernels::packed_rows_apply(in)) {
        kernels::ScopedOpTime t("gemv q4_0", [&](std::string& shape, double& macs) {
            shape = std::to_string(out) + "x" + std::to_string(in);
            macs = double(out) * double(in);
        });
        return kernels::gemv_q4_0_packed(q4.data_ptr<uint8_t>(), x, b, y, out, in);
    }
    kernels::ScopedOpTime t(q4.defined()   ? "gemv q4_0"
                            : q8.defined() ? "gemv q8_0"
                            : f16.defined() ? "gemv f16"
                                            : "gemv f32",
                            [&](std::string& shape, double& macs) {
                                shape = std::to_string(out) + "x" + std::to_string(in);
                                macs = double(out) * double(in);
                            });
    if (q4.defined())
        kernels::gemv_q4_0(reinterpret_cast<const kernels::BlockQ4_0*>(q4.data_ptr<uint8_t>()), x, b, y, out, in);
    else if (q8.defined())
        kernels::gemv_q8_0(reinterpret_cast<const kernels::BlockQ8_0*>(q8.data_ptr<uint8_t>()), x, b, y, out, in);
    else if (f16.defined())
        kernels::gemv_f16(reinterpret_cast<const uint16_t*>(f16.data_ptr<at::Half>()), x, b, y, out, in);
    else
        kernels::gemv_f32(f32.data_ptr<float>(), x, b, y, out, in);
}

torch::Tensor DecodeRows::gemv(const torch::Tensor& x, const torch::Tensor& bias) const {
    if (q4.defined() && kernels::packed_rows_apply(f32.size(1))) {
        const int64_t in = f32.size(1), out = f32.size(0);
        auto xc = x.reshape({in}).to(torch::kFloat32).contiguous();
        auto b = bias.defined() ? bias.to(torch::kFloat32).contiguous() : torch::Tensor();
        auto y = torch::empty({out}, torch::kFloat32);
        gemv(xc.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>());
        return y;
    }
    if (q4.defined()) return kernels::gemv_q4_0(q4, x, bias);
    if (q8.defined()) return kernels::gemv_q8_0(q8, x, bias);
    return kernels::gemv(f16.defined() ? f16 : f32, x, bias);
}

void Conv1DImpl::finalize() {
    torch::NoGradGuard ng;
    rows_.f32 = kernels::huge_page_copy(weight.detach().t());
    // The parameter becomes an [in, out] view of the row-major copy: one copy of the weights in memory.
    weight.set_data(rows_.f32.t());
}

void Conv1DImpl::set_decode_weights(DecodeWeights dw) {
    rows_.set_copies(dw);
}

int64_t Conv1DImpl::decode_bytes() const {
    return rows_.f32.defined() ? rows_.bytes() : weight.numel() * int64_t(sizeof(float));
}

void Conv1DImpl::decode_row(const float* x, float* y) const {
    rows_.gemv(x, bias.data_ptr<float>(), y);
}

torch::Tensor Conv1DImpl::forward(const torch::Tensor& x) {
    const int64_t in = weight.size(0), out = weight.size(1);
    auto shape = x.sizes().vec();
    shape.back() = out;
    if (x.numel() == in && rows_.f32.defined()) { // one token: matrix-vector over contiguous rows
        if (g_fast_decode && rows_.on_cpu_f32()) return rows_.gemv(x.reshape({in}), bias).view(shape);
        return torch::addmv(bias, rows_.f32, x.reshape({in})).view(shape);
    }
    return torch::addmm(bias, x.reshape({-1, in}), weight).view(shape);
}

Gpt2AttentionImpl::Gpt2AttentionImpl(const Gpt2Config& c) : n_head_(c.n_head), n_embd_(c.n_embd) {
    c_attn = register_module("c_attn", Conv1D(c.n_embd, 3 * c.n_embd));
    c_proj = register_module("c_proj", Conv1D(c.n_embd, c.n_embd));
}

torch::Tensor Gpt2AttentionImpl::forward(const torch::Tensor& x, cache::SinkRollingKV* kv,
                                         const std::vector<int64_t>& pos_ids) {
    const int64_t B = x.size(0), T = x.size(1), C = n_embd_, H = n_head_, D = C / H;
    auto qkv = c_attn(x).split(C, 2);
    auto heads = [&](const torch::Tensor& t) { return t.reshape({B, T, H, D}).transpose(1, 2); };
    auto q = heads(qkv[0]), k = heads(qkv[1]), v = heads(qkv[2]);
    // nanoGPT: (q k^T) / sqrt(D), causal mask by masked_fill(-inf), softmax, @ v.
    kernels::AttentionOptions ao;
    ao.layout = kernels::AttentionLayout::Heads;
    ao.formula = kernels::ScoreFormula::ScaleAfter;
    ao.causal = true;
    torch::Tensor y;
    if (!kv) {
        y = kernels::attention(q, k, v, ao);
    } else {
        // StreamingLLM order: the new token enters the buffer (evicting stream index i - W) before it attends, so
        // the filled slots are exactly A(i) u {i} (README sec. 3).
        auto slots = kv->append(k, v, pos_ids);
        const int64_t L = kv->filled();
        if (T > 1 && (slots.front() != L - T || slots.back() != L - 1))
            throw Error("GPT-2 attention: several tokens per step are only supported while the cache fills");
        // Query t (stream index count-T+t) sees slots <= L - T + t, earlier slots holding older tokens: the causal
        // mask aligned to the last key.
        y = kernels::attention(q, kv->keys(), kv->values(), ao); // [B, H, T, D]
    }
    y = y.transpose(1, 2).reshape({B, T, C});
    return c_proj(y);
}

Gpt2MlpImpl::Gpt2MlpImpl(const Gpt2Config& c) : tanh_(c.tanh_gelu()) {
    c_fc = register_module("c_fc", Conv1D(c.n_embd, c.inner()));
    c_proj = register_module("c_proj", Conv1D(c.inner(), c.n_embd));
}

torch::Tensor Gpt2MlpImpl::forward(const torch::Tensor& x) {
    // GPT-2 uses the tanh approximation of GELU (Hendrycks & Gimpel 2016, eq. in sec. 2).
    return c_proj(torch::gelu(c_fc(x), tanh_ ? "tanh" : "none"));
}

Gpt2BlockImpl::Gpt2BlockImpl(const Gpt2Config& c) {
    auto ln = [&]() { return torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd}).eps(c.layer_norm_epsilon)); };
    ln_1 = register_module("ln_1", ln());
    attn = register_module("attn", Gpt2Attention(c));
    ln_2 = register_module("ln_2", ln());
    mlp = register_module("mlp", Gpt2Mlp(c));
}

std::array<Conv1DImpl*, 4> Gpt2BlockImpl::conv1ds() const {
    // ptr(): the holders hand out the modules themselves, also from a const block (byte counts are const).
    return {attn.ptr()->c_attn.ptr().get(), attn.ptr()->c_proj.ptr().get(), mlp.ptr()->c_fc.ptr().get(),
            mlp.ptr()->c_proj.ptr().get()};
}

torch::Tensor Gpt2BlockImpl::forward(const torch::Tensor& x, cache::SinkRollingKV* kv,
                                     const std::vector<int64_t>& pos_ids) {
    auto h = x + attn(ln_1(x), kv, pos_ids);
    return h + mlp(ln_2(h));
}

Gpt2ModelImpl::Gpt2ModelImpl(const Gpt2Config& c) : cfg_(c) {
    c.validate();
    wte = register_module("wte", torch::nn::Embedding(c.vocab_size, c.n_embd));
    wpe = register_module("wpe", torch::nn::Embedding(c.n_positions, c.n_embd));
    h = register_module("h", torch::nn::ModuleList());
    for (int64_t i = 0; i < c.n_layer; ++i) {
        blocks_.push_back(Gpt2Block(c));
        h->push_back(blocks_.back());
    }
    ln_f = register_module("ln_f",
                           torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd}).eps(c.layer_norm_epsilon)));
    lm_.f32 = wte->weight;
    eval();
}

void Gpt2ModelImpl::finalize(const torch::Tensor& explicit_lm_head) {
    torch::NoGradGuard ng;
    for (auto& b : blocks_) {
        for (auto* c : b->conv1ds()) c->finalize();
    }
    if (explicit_lm_head.defined() && !explicit_lm_head.equal(wte->weight.detach())) {
        lm_.f32 = kernels::huge_page_copy(explicit_lm_head.detach().to(torch::kFloat32));
        tied_ = false;
    } else {
        // Tied: the embedding table is the LM head every step streams; it moves to huge pages once.
        wte->weight.set_data(kernels::huge_page_copy(wte->weight.detach()));
        lm_.f32 = wte->weight.detach();
        tied_ = true;
    }
    for (auto& p : parameters()) p.set_requires_grad(false);
}

void Gpt2ModelImpl::place(const Placement& p) {
    p.validate();
    torch::NoGradGuard ng;
    if (p.device == placement_.device && p.dtype == placement_.dtype) return;
    if (decode_dtype_ != DecodeWeights::F32 && !p.reference())
        throw ParamError("decode_weights", "the " + std::string(decode_dtype_ == DecodeWeights::F16 ? "f16" : decode_dtype_ == DecodeWeights::Q8_0 ? "q8_0" : "q4_0") +
                                               " decode copies are for CPU float32 decoding, not " + p.str());
    // Module::to would convert every tensor; each parameter is moved instead, then the [out, in] rows every Conv1D
    // and the LM head read are laid out again from the moved weights (one copy of each on the device).
    for (auto& t : parameters()) t.set_data(t.detach().to(p.device, p.dtype));
    for (auto& b : blocks_)
        for (auto* c : b->conv1ds()) c->relayout();
    lm_.f32 = tied_ ? wte->weight.detach() : lm_.f32.to(p.device, p.dtype).contiguous();
    placement_ = p;
}

void Conv1DImpl::relayout() {
    torch::NoGradGuard ng;
    rows_.f32 = weight.detach().t().contiguous();
    weight.set_data(rows_.f32.t());
}

void Gpt2ModelImpl::set_decode_weights(DecodeWeights dw) {
    if (dw != DecodeWeights::F32 && !placement_.reference())
        throw ParamError("decode_weights", "the f16, q8_0 and q4_0 decode copies are for CPU float32 decoding, not " +
                                               placement_.str());
    for (auto& b : blocks_)
        for (auto* c : b->conv1ds()) c->set_decode_weights(dw);
    lm_.set_copies(dw);
    decode_dtype_ = dw;
}

int64_t Gpt2ModelImpl::decode_weight_bytes() const {
    int64_t n = lm_.bytes();
    for (const auto& b : blocks_)
        for (const auto* c : b->conv1ds()) n += c->decode_bytes();
    return n;
}

torch::Tensor Gpt2ModelImpl::logits_of(const torch::Tensor& x) {
    const int64_t C = cfg_.n_embd;
    if (x.numel() == C) { // one token: matrix-vector over the vocabulary rows
        auto shape = x.sizes().vec();
        shape.back() = lm_.f32.size(0);
        if (g_fast_decode && lm_.on_cpu_f32()) return lm_.gemv(x.reshape({C})).view(shape);
        return torch::mv(lm_.f32, x.reshape({C})).view(shape).to(torch::kFloat32);
    }
    // Logits leave the model in float32 whatever the compute dtype (the samplers and perplexities read float32).
    return torch::matmul(x, lm_.f32.t()).to(torch::kFloat32);
}

Gpt2Output Gpt2ModelImpl::forward(const torch::Tensor& ids_in, bool want_hidden, bool last_only,
                                  const torch::Tensor& positions) {
    torch::NoGradGuard ng;
    auto ids = ids_in.dim() == 1 ? ids_in.unsqueeze(0) : ids_in;
    const int64_t T = ids.size(1);
    if (T < 1) throw Error("GPT-2 forward: empty input");
    if (!positions.defined() && T > cfg_.n_positions)
        throw Error("GPT-2 forward: " + std::to_string(T) + " tokens exceed n_positions " +
                    std::to_string(cfg_.n_positions));
    const auto dev = wte->weight.device();
    auto pos = positions.defined() ? positions.to(dev, torch::kLong) : torch::arange(T, torch::dtype(torch::kLong).device(dev));
    Gpt2Output out;
    auto x = wte(ids.to(dev, torch::kLong)) + wpe(pos);
    if (want_hidden) out.hidden.push_back(x);
    for (auto& b : blocks_) {
        x = b(x);
        if (want_hidden) out.hidden.push_back(x);
    }
    if (last_only) x = x.narrow(1, T - 1, 1);
    x = ln_f(x);
    if (want_hidden) out.hidden.push_back(x);
    out.logits = logits_of(x);
    return out;
}

torch::Tensor Gpt2ModelImpl::step(const torch::Tensor& ids_in, const std::vector<int64_t>& pos_ids,
                                  std::vector<cache::SinkRollingKV>& caches, bool last_only) {
    torch::NoGradGuard ng;
    auto ids = ids_in.dim() == 1 ? ids_in.unsqueeze(0) : ids_in;
    const int64_t T = ids.size(1);
    if (static_cast<int64_t>(pos_ids.size()) != T) throw Error("GPT-2 step: one position id per token needed");
    if (static_cast<int64_t>(caches.size()) != cfg_.n_layer) throw Error("GPT-2 step: one cache per layer needed");
    for (auto p : pos_ids)
        if (p < 0 || p >= cfg_.n_positions)
            throw Error("GPT-2 step: position id " + std::to_string(p) + " outside [0, " +
                        std::to_string(cfg_.n_positions) + ")");
    if (step_one_applies(ids, caches)) return step_one(ids.to(torch::kLong).item<int64_t>(), pos_ids[0], caches);
    const auto dev = wte->weight.device();
    auto pos = torch::tensor(pos_ids, torch::kLong).to(dev);
    auto x = wte(ids.to(dev, torch::kLong)) + wpe(pos);
    for (size_t l = 0; l < blocks_.size(); ++l) x = blocks_[l](x, &caches[l], pos_ids);
    if (last_only) x = x.narrow(1, T - 1, 1);
    return logits_of(ln_f(x));
}

bool Gpt2ModelImpl::step_one_applies(const torch::Tensor& ids, const std::vector<cache::SinkRollingKV>& caches) const {
    if (!g_fast_decode || ids.numel() != 1 || ids.size(0) != 1) return false;
    auto cpu_f32 = [](const torch::Tensor& t) {
        return t.defined() && t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous();
    };
    if (!cpu_f32(wte->weight) || !cpu_f32(wpe->weight) || !cpu_f32(lm_.f32) || !cpu_f32(ln_f->weight)) return false;
    for (const auto& c : caches)
        if (!cpu_f32(c.k_storage()) || !cpu_f32(c.v_storage()) || c.k_storage().size(0) != 1) return false;
    for (const auto& b : blocks_)
        for (const auto* c : b->conv1ds())
            if (!cpu_f32(c->w_rows()) || !cpu_f32(c->bias)) return false;
    return true;
}

torch::Tensor Gpt2ModelImpl::step_one(int64_t id, int64_t pos, std::vector<cache::SinkRollingKV>& caches) {
    const int64_t C = cfg_.n_embd, H = cfg_.n_head, D = cfg_.head_dim(), F = cfg_.inner(), V = lm_.f32.size(0);
    if (id < 0 || id >= cfg_.vocab_size)
        throw Error("GPT-2 step: token id " + std::to_string(id) + " outside [0, " + std::to_string(cfg_.vocab_size) +
                    ")");
    // The step's buffers live as long as the thread (no allocation per token).
    thread_local std::vector<float> buf;
    buf.resize(static_cast<size_t>(C * 3 + 3 * C + F));
    float *x = buf.data(), *h = x + C, *att = h + C, *qkv = att + C, *ff = qkv + 3 * C;
    // Per-op wall times for `gpt2 bench --op-table` (kernels/op_timing.h; one relaxed load per op when off).
    auto timed = [](const char* kind, int64_t n, auto&& body) {
        kernels::ScopedOpTime t(kind, [&](std::string& shape, double& macs) {
            shape = std::to_string(n);
            macs = double(n);
        });
        body();
    };
    timed("embed", C, [&] {
        const float* te = wte->weight.data_ptr<float>() + id * C;
        const float* pe = wpe->weight.data_ptr<float>() + pos * C;
        for (int64_t i = 0; i < C; ++i) x[i] = te[i] + pe[i];
    });
    const float scale = static_cast<float>(1.0 / std::sqrt(double(D)));
    auto norm = [&](const torch::nn::LayerNorm& ln, const float* in, float* out) {
        timed("layer_norm", C, [&] {
            kernels::layer_norm_row(in, ln->weight.data_ptr<float>(), ln->bias.data_ptr<float>(), out, C,
                                    static_cast<float>(ln->options.eps()));
        });
    };
    auto residual = [&]() {
        timed("residual", C, [&] {
            for (int64_t i = 0; i < C; ++i) x[i] += h[i];
        });
    };
    for (size_t l = 0; l < blocks_.size(); ++l) {
        auto& blk = *blocks_[l];
        auto& kv = caches[l];
        norm(blk.ln_1, x, h);
        blk.attn->c_attn->decode_row(h, qkv);
        timed("kv append", 2 * C, [&] {
            // q, k, v side by side as c_attn gives them; k and v go into the token's slot of each head's rows of the
            // [1, H, capacity, D] buffers (the bookkeeping of SinkRollingKV::append, the copy without LibTorch ops).
            const int64_t slot = kv.advance(pos), cap = kv.capacity();
            float *ks = kv.k_storage().data_ptr<float>(), *vs = kv.v_storage().data_ptr<float>();
            for (int64_t hh = 0; hh < H; ++hh) {
                std::memcpy(ks + (hh * cap + slot) * D, qkv + C + hh * D, size_t(D) * sizeof(float));
                std::memcpy(vs + (hh * cap + slot) * D, qkv + 2 * C + hh * D, size_t(D) * sizeof(float));
            }
        });
        timed("attention", C, [&] {
            kernels::attend_one_query(qkv, kv.k_storage().data_ptr<float>(), kv.v_storage().data_ptr<float>(), att, H,
                                      D, kv.filled(), kv.capacity() * D, scale);
        });
        blk.attn->c_proj->decode_row(att, h);
        residual();
        norm(blk.ln_2, x, h);
        blk.mlp->c_fc->decode_row(h, ff);
        timed("gelu", F, [&] {
            if (cfg_.tanh_gelu())
                kernels::gelu_tanh_row(ff, F);
            else
                kernels::gelu_erf_row(ff, F);
        });
        blk.mlp->c_proj->decode_row(ff, h);
        residual();
    }
    norm(ln_f, x, h);
    torch::Tensor logits;
    timed("logits buf", V, [&] { logits = torch::empty({1, 1, V}, torch::kFloat32); });
    lm_.gemv(h, nullptr, logits.data_ptr<float>());
    return logits;
}

std::vector<cache::SinkRollingKV> Gpt2ModelImpl::make_caches(int64_t sinks, int64_t window, bool evict,
                                                             int64_t batch) const {
    std::vector<cache::SinkRollingKV> out;
    out.reserve(cfg_.n_layer);
    for (int64_t l = 0; l < cfg_.n_layer; ++l) {
        cache::SinkRollingKVOptions o;
        o.batch = batch;
        o.heads = cfg_.n_head;
        o.head_dim = cfg_.head_dim();
        o.sinks = sinks;
        o.window = window;
        o.evict = evict;
        // The ring lives where the model runs, in its compute dtype (preallocated once: no allocation per token).
        o.dtype = wte->weight.scalar_type();
        o.device = wte->weight.device();
        o.device_writer = &kernels::ring_write; // the fused CUDA write for buffers on a GPU
        out.emplace_back(o);
    }
    return out;
}

// ---- loading -----------------------------------------------------------------------------------------------------

LoadedGpt2 load_gpt2(const std::string& path, int64_t n_head_hint) {
    LoadedGpt2 out;
    // The one resolver: a file, an index and its shards, or a folder whose loose files hold GPT-2 tensors.
    const ModelSource src = resolve_model(path, {is_gpt2_tensor_name, "GPT-2 model"});
    out.weight_files = src.index_file.empty() ? src.weight_files : std::vector<std::string>{src.index_file};
    WeightMap raw = src.load_weights();
    // `transformer.`-prefixed (GPT2LMHeadModel state dict) and plain (hub `gpt2`) layouts map to the same names.
    torch::Tensor lm_head;
    if (raw.has("lm_head.weight")) lm_head = raw.get("lm_head.weight");
    std::set<std::string> seen;
    for (const auto& n : raw.names()) {
        const std::string s = strip_transformer(n);
        if (!seen.insert(s).second)
            throw Error("model '" + path + "' holds tensor '" + s +
                        "' both with and without the 'transformer.' prefix");
    }
    WeightMap w = raw.renamed([](const std::string& n) { return strip_transformer(n); });

    std::error_code ec;
    out.folder = (fs::is_directory(path, ec) ? fs::path(path) : fs::path(path).parent_path()).string();
    if (!src.config_file.empty()) {
        out.config_path = src.config_file;
        out.config = Gpt2Config::from_json_file(out.config_path);
        if (n_head_hint > 0) out.config.n_head = n_head_hint;
        out.config.validate();
    } else {
        out.config = Gpt2Config::detect_from_weights(w, n_head_hint);
    }
    if (lm_head.defined() && lm_head.sizes().vec() != std::vector<int64_t>{out.config.vocab_size, out.config.n_embd})
        throw Error("file '" + raw.source("lm_head.weight") + "', tensor 'lm_head.weight': expected shape " +
                    shape_str({out.config.vocab_size, out.config.n_embd}) + ", got " +
                    shape_str(lm_head.sizes().vec()));
    out.model = Gpt2Model(out.config);
    // HF keeps the causal mask as non-parameter buffers in old checkpoints; they carry no weights.
    w.load_into(*out.model, {"lm_head\\.weight", "h\\.[0-9]+\\.attn\\.(bias|masked_bias)"});
    out.model->finalize(lm_head);
    return out;
}

// ---- streaming ---------------------------------------------------------------------------------------------------

const std::vector<std::pair<KvMode, std::string>>& kv_mode_names() {
    static const std::vector<std::pair<KvMode, std::string>> t = {
        {KvMode::Full, "full"}, {KvMode::Window, "window"}, {KvMode::Sink, "sink"}, {KvMode::Recompute, "recompute"}};
    return t;
}

std::string KvSpec::syntax_help() {
    std::string s;
    for (const auto& [m, name] : kv_mode_names()) {
        if (!s.empty()) s += " | ";
        switch (m) {
        case KvMode::Full:
            s += name;
            break;
        case KvMode::Window:
            s += name + ":W";
            break;
        case KvMode::Sink:
            s += name + ":S,W";
            break;
        case KvMode::Recompute:
            s += name + ":W";
            break;
        }
    }
    return s;
}

KvSpec KvSpec::parse(const std::string& s) {
    const auto colon = s.find(':');
    const std::string head = s.substr(0, colon), args = colon == std::string::npos ? "" : s.substr(colon + 1);
    auto bad = [&](const std::string& why) -> ParamError {
        return ParamError("kv", "mode '" + s + "' is not valid: " + why + " (expected " + syntax_help() + ")");
    };
    auto number = [&](const std::string& t, const char* what) -> int64_t {
        if (t.empty() || t.size() > 12 || t.find_first_not_of("0123456789") != std::string::npos)
            throw bad(std::string(what) + " must be a non-negative integer, got '" + t + "'");
        return std::stoll(t);
    };
    KvSpec k;
    bool found = false;
    for (const auto& [m, name] : kv_mode_names())
        if (name == head) k.mode = m, found = true;
    if (!found) throw bad("unknown mode '" + head + "'");
    switch (k.mode) {
    case KvMode::Full:
        if (colon != std::string::npos) throw bad("'full' takes no argument");
        break;
    case KvMode::Window:
    case KvMode::Recompute:
        if (args.find(',') != std::string::npos) throw bad("expected a single window size W");
        k.window = number(args, "W");
        break;
    case KvMode::Sink: {
        const auto comma = args.find(',');
        if (comma == std::string::npos) throw bad("expected S,W");
        k.sinks = number(args.substr(0, comma), "S");
        k.window = number(args.substr(comma + 1), "W");
        break;
    }
    }
    if (k.mode != KvMode::Full && k.window < 1) throw bad("W must be >= 1");
    return k;
}

std::string KvSpec::str() const {
    switch (mode) {
    case KvMode::Full:
        return "full";
    case KvMode::Window:
        return "window:" + std::to_string(window);
    case KvMode::Sink:
        return "sink:" + std::to_string(sinks) + "," + std::to_string(window);
    case KvMode::Recompute:
        return "recompute:" + std::to_string(window);
    }
    return "?";
}

const EnumTable<PositionMode>& position_mode_table() {
    static const EnumTable<PositionMode> t = {{"wrap", PositionMode::Wrap},
                                              {"cache", PositionMode::Cache},
                                              {"absolute", PositionMode::Absolute},
                                              {"reencode", PositionMode::Reencode}};
    return t;
}

std::optional<cache::PositionPolicy> buffer_policy(PositionMode mode) {
    switch (mode) {
    case PositionMode::Wrap:
        return cache::PositionPolicy::Wrap;
    case PositionMode::Cache:
        return cache::PositionPolicy::Cache;
    case PositionMode::Absolute:
        return cache::PositionPolicy::Absolute;
    case PositionMode::Reencode:
        break;
    }
    return std::nullopt;
}

Gpt2Stream::Gpt2Stream(Gpt2Model model, KvSpec spec, PositionMode policy)
    : model_(std::move(model)), spec_(spec), policy_(policy) {
    const int64_t P = model_->config().n_positions;
    switch (spec_.mode) {
    case KvMode::Full:
        capacity_ = P;
        caches_ = model_->make_caches(0, P, false);
        break;
    case KvMode::Window:
    case KvMode::Sink:
        capacity_ = spec_.sinks + spec_.window;
        if (policy_ == PositionMode::Reencode) {
            if (capacity_ > P || spec_.window < 2)
                throw ParamError("kv", spec_.str() +
                                           " with positions reencode needs 2 <= W and S+W <= the model's "
                                           "n_positions " +
                                           std::to_string(P));
            caches_ = model_->make_caches(0, capacity_, false);
            break;
        }
        if (policy_ != PositionMode::Wrap && capacity_ > P)
            throw ParamError("kv", spec_.str() + ": S+W = " + std::to_string(capacity_) +
                                       " exceeds the model's n_positions " + std::to_string(P) + " with positions " +
                                       enum_name(position_mode_table(), policy_) +
                                       " (use positions wrap or a smaller cache)");
        caches_ = model_->make_caches(spec_.sinks, spec_.window, true);
        break;
    case KvMode::Recompute:
        capacity_ = spec_.window;
        if (capacity_ > P)
            throw ParamError("kv", spec_.str() + ": W exceeds the model's n_positions " + std::to_string(P));
        break;
    }
}

int64_t Gpt2Stream::position_of(int64_t i) const {
    if (spec_.mode == KvMode::Recompute) return std::min(i, capacity_ - 1);
    if (policy_ == PositionMode::Reencode && spec_.mode != KvMode::Full) {
        // Fill 0 .. C-1, then cycles of ceil(W/2) new tokens after the S + floor(W/2) re-encoded ones.
        const int64_t keep = spec_.sinks + spec_.window / 2, room = capacity_ - keep;
        return i < capacity_ ? i : keep + (i - capacity_) % room;
    }
    return cache::position_id(*buffer_policy(policy_), i, capacity_, model_->config().n_positions);
}

int64_t Gpt2Stream::remaining() const {
    if (spec_.mode == KvMode::Full) return capacity_ - count_;
    if (policy_ == PositionMode::Absolute) return model_->config().n_positions - count_;
    return -1;
}

int64_t Gpt2Stream::kv_bytes() const {
    int64_t b = 0;
    for (const auto& c : caches_) b += c.bytes();
    return b;
}

torch::Tensor Gpt2Stream::feed(int64_t token) {
    return feed(std::vector<int64_t>{token});
}

namespace {
// Logits with a NaN/Inf (broken weights, overflow) are reported at the token where they appear instead of being
// sampled from or averaged into a perplexity. One reduction over V floats per token.
torch::Tensor checked_logits(torch::Tensor logits, int64_t stream_index) {
    logits = logits.to(torch::kCPU, torch::kFloat32).contiguous(); // the one copy to the host per step on a device
    // A NaN or Inf has every exponent bit set: one pass of integer ops over the bits (vectorised by the compiler),
    // instead of isfinite's temporary tensor and reduction on every token.
    const auto* bits = reinterpret_cast<const uint32_t*>(logits.data_ptr<float>());
    uint32_t bad = 0;
    for (int64_t i = 0, n = logits.numel(); i < n; ++i) bad |= uint32_t((bits[i] & 0x7f800000u) == 0x7f800000u);
    if (bad)
        throw Error("NaN/Inf in the logits at stream token " + std::to_string(stream_index) +
                    "; check the model weights");
    return logits;
}
} // namespace

torch::Tensor Gpt2Stream::feed(const std::vector<int64_t>& tokens) {
    if (tokens.empty()) throw Error("GPT-2 stream: nothing to feed");
    const int64_t V = model_->config().vocab_size;
    for (auto t : tokens)
        if (t < 0 || t >= V)
            throw Error("token id " + std::to_string(t) + " outside the model's vocabulary (" + std::to_string(V) +
                        ")");
    if (spec_.mode == KvMode::Recompute) {
        // StreamingLLM's "sliding window with re-computation": no cache, a fresh forward over the last W tokens.
        for (auto t : tokens) {
            recent_.push_back(t);
            if (static_cast<int64_t>(recent_.size()) > capacity_) recent_.pop_front();
        }
        count_ += static_cast<int64_t>(tokens.size());
        auto ids = torch::tensor(std::vector<int64_t>(recent_.begin(), recent_.end()), torch::kLong);
        return checked_logits(model_->forward(ids, false, true).logits.reshape({V}), count_ - 1);
    }
    if (policy_ == PositionMode::Reencode && spec_.mode != KvMode::Full) return feed_reencode(tokens);
    if (spec_.mode == KvMode::Full && count_ + static_cast<int64_t>(tokens.size()) > capacity_)
        throw Error("KV mode full: " + std::to_string(count_ + tokens.size()) + " tokens exceed the model's " +
                    "n_positions " + std::to_string(capacity_) + " (use sink:S,W or window:W to stream further)");
    torch::Tensor logits;
    size_t i = 0;
    while (i < tokens.size()) {
        // Batch the tokens that still fit without eviction; after that, one token per step.
        int64_t n = std::max<int64_t>(1, std::min<int64_t>(capacity_ - count_, tokens.size() - i));
        std::vector<int64_t> pos(n), chunk(tokens.begin() + i, tokens.begin() + i + n);
        for (int64_t j = 0; j < n; ++j) pos[j] = position_of(count_ + j);
        logits = n == 1 ? one_token_step(chunk[0], pos[0])
                        : model_->step(torch::tensor(chunk, torch::kLong).unsqueeze(0), pos, caches_, true);
        count_ += n;
        i += n;
    }
    return checked_logits(logits.reshape({V}), count_ - 1);
}

torch::Tensor Gpt2Stream::one_token_step(int64_t id, int64_t pos) {
    if (decode_cuda_graphs() && (graph_ || Gpt2DecodeGraph::applies(*model_, caches_))) {
        if (!graph_) graph_ = std::make_shared<Gpt2DecodeGraph>(model_, caches_);
        return graph_->step(id, pos, caches_);
    }
    return model_->step(torch::tensor(std::vector<int64_t>{id}, torch::kLong).unsqueeze(0), {pos}, caches_, true);
}

// ---- the decode step as a CUDA graph ------------------------------------------------------------------------------

namespace {
std::atomic<bool> g_decode_graphs{false};
} // namespace

void set_decode_cuda_graphs(bool on) {
    g_decode_graphs = on;
}

bool decode_cuda_graphs() {
    return g_decode_graphs;
}

bool Gpt2DecodeGraph::applies(const Gpt2ModelImpl& model, const std::vector<cache::SinkRollingKV>& caches) {
    if (!kernels::CudaGraph::available() || !model.wte->weight.is_cuda() || caches.empty()) return false;
    for (const auto& c : caches)
        if (!c.k_storage().is_cuda() || c.k_storage().size(0) != 1) return false;
    return true;
}

Gpt2DecodeGraph::Gpt2DecodeGraph(Gpt2Model model, const std::vector<cache::SinkRollingKV>& caches)
    : model_(std::move(model)) {
    if (!applies(*model_, caches))
        throw Error("GPT-2 decode graph: needs the model and batch-1 KV caches on a CUDA device in a build with CUDA "
                    "graphs (LibTorch >= 2)");
    graph_ = std::make_unique<kernels::CudaGraph>();
    for (const auto& c : caches) k_.push_back(c.k_storage()), v_.push_back(c.v_storage());
    const auto dev = model_->wte->weight.device();
    const auto ids = torch::dtype(torch::kLong).device(dev);
    id_ = torch::zeros({1}, ids), pos_ = torch::zeros({1}, ids), slot_ = torch::zeros({1}, ids);
    mask_ = torch::full({1, 1, 1, caches.front().capacity()}, -std::numeric_limits<float>::infinity(),
                        torch::dtype(model_->wte->weight.scalar_type()).device(dev));
}

Gpt2DecodeGraph::~Gpt2DecodeGraph() = default;

std::vector<torch::Tensor> Gpt2DecodeGraph::body() {
    auto& m = *model_;
    const auto& c = m.config();
    const int64_t C = c.n_embd, H = c.n_head, D = c.head_dim();
    const double scale = 1.0 / std::sqrt(double(D));
    auto x = m.wte->weight.index_select(0, id_) + m.wpe->weight.index_select(0, pos_); // [1, C]
    for (size_t l = 0; l < m.blocks_.size(); ++l) {
        auto& blk = *m.blocks_[l];
        const auto qkv = blk.attn->c_attn(blk.ln_1(x)); // [1, 3C]
        auto heads = [&](int64_t part) { return qkv.narrow(1, part * C, C).reshape({1, H, 1, D}); };
        // The new token's K and V into its slot, then attention over the whole ring with the empty slots masked:
        // the eager step's append-then-attend (README sec. 3), at a fixed shape.
        k_[l].index_copy_(2, slot_, heads(1));
        v_[l].index_copy_(2, slot_, heads(2));
        auto scores = torch::matmul(heads(0), k_[l].transpose(-2, -1)).to(torch::kFloat32) * scale + mask_;
        auto y = torch::matmul(torch::softmax(scores, -1).to(v_[l].scalar_type()), v_[l]).reshape({1, C});
        x = x + blk.attn->c_proj(y);
        x = x + blk.mlp(blk.ln_2(x));
    }
    return {m.logits_of(m.ln_f(x)).reshape({1, 1, -1})};
}

torch::Tensor Gpt2DecodeGraph::step(int64_t id, int64_t pos, std::vector<cache::SinkRollingKV>& caches) {
    torch::NoGradGuard ng;
    const auto& c = model_->config();
    if (id < 0 || id >= c.vocab_size)
        throw Error("GPT-2 step: token id " + std::to_string(id) + " outside [0, " + std::to_string(c.vocab_size) +
                    ")");
    if (pos < 0 || pos >= c.n_positions)
        throw Error("GPT-2 step: position id " + std::to_string(pos) + " outside [0, " +
                    std::to_string(c.n_positions) + ")");
    if (caches.size() != k_.size() || !caches.front().k_storage().is_same(k_.front()))
        throw Error("GPT-2 decode graph: called with other caches than it was captured on");
    int64_t slot = 0;
    for (auto& kv : caches) slot = kv.advance(pos);
    const int64_t filled = caches.front().filled();
    if (filled < live_) { // the caches were cleared since
        mask_.fill_(-std::numeric_limits<float>::infinity());
        live_ = 0;
    }
    if (filled > live_) mask_.narrow(3, live_, filled - live_).fill_(0.0);
    live_ = filled;
    id_.fill_(id), pos_.fill_(pos), slot_.fill_(slot);
    if (!graph_->captured()) out_ = graph_->capture([this] { return body(); }, id_.device()).at(0);
    graph_->replay();
    return out_;
}

torch::Tensor Gpt2Stream::feed_reencode(const std::vector<int64_t>& tokens) {
    const int64_t V = model_->config().vocab_size, S = spec_.sinks, W = spec_.window;
    torch::Tensor logits;
    size_t i = 0;
    while (i < tokens.size()) {
        if (cached_ == capacity_) {
            // Full: encode the sinks and the newest floor(W/2) tokens again at positions 0.. (in order), drop the rest.
            while (static_cast<int64_t>(recent_.size()) > W / 2) recent_.pop_front();
            std::vector<int64_t> keep(sink_ids_);
            keep.insert(keep.end(), recent_.begin(), recent_.end());
            for (auto& c : caches_) c.clear();
            std::vector<int64_t> pos(keep.size());
            for (size_t j = 0; j < keep.size(); ++j) pos[j] = static_cast<int64_t>(j);
            model_->step(torch::tensor(keep, torch::kLong).unsqueeze(0), pos, caches_, true);
            cached_ = static_cast<int64_t>(keep.size());
        }
        const int64_t n = std::min<int64_t>(capacity_ - cached_, static_cast<int64_t>(tokens.size() - i));
        std::vector<int64_t> pos(n), chunk(tokens.begin() + i, tokens.begin() + i + n);
        for (int64_t j = 0; j < n; ++j) pos[j] = cached_ + j;
        logits = model_->step(torch::tensor(chunk, torch::kLong).unsqueeze(0), pos, caches_, true);
        for (auto t : chunk) {
            if (static_cast<int64_t>(sink_ids_.size()) < S)
                sink_ids_.push_back(t);
            else
                recent_.push_back(t);
        }
        cached_ += n;
        count_ += n;
        i += static_cast<size_t>(n);
    }
    return checked_logits(logits.reshape({V}), count_ - 1);
}

StreamEval evaluate_stream(Gpt2Model model, const std::vector<int64_t>& ids, const KvSpec& spec, PositionMode policy,
                           const std::vector<int64_t>& probe_steps, const std::function<void(int64_t)>& on_step) {
    torch::NoGradGuard ng;
    const int64_t N = static_cast<int64_t>(ids.size());
    if (N < 1) throw Error("stream evaluation: no tokens");
    Gpt2Stream stream(model, spec, policy);
    StreamEval ev;
    ev.logprob_next = torch::zeros({std::max<int64_t>(N - 1, 0)}, torch::kFloat32);
    ev.argmax = torch::zeros({N}, torch::kLong);
    ev.top2_gap = torch::zeros({N}, torch::kFloat32);
    auto lp = ev.logprob_next.accessor<float, 1>();
    auto am = ev.argmax.accessor<int64_t, 1>();
    auto gap = ev.top2_gap.accessor<float, 1>();
    double nll = 0.0;
    for (int64_t i = 0; i < N; ++i) {
        auto logits = stream.feed(ids[i]);
        auto top = logits.topk(2);
        auto vals = std::get<0>(top);
        am[i] = std::get<1>(top)[0].item<int64_t>();
        gap[i] = vals[0].item<float>() - vals[1].item<float>();
        if (i + 1 < N) {
            const float v = torch::log_softmax(logits, 0)[ids[i + 1]].item<float>();
            lp[i] = v;
            nll -= v;
        }
        if (std::find(probe_steps.begin(), probe_steps.end(), i) != probe_steps.end())
            ev.probe_logits.push_back(logits.clone());
        ev.tokens = i + 1;
        if (on_step) on_step(i);
    }
    ev.mean_nll = N > 1 ? nll / static_cast<double>(N - 1) : 0.0;
    return ev;
}

double generative_ppl(Gpt2Model model, const std::vector<int64_t>& ids, int64_t from) {
    const int64_t n = static_cast<int64_t>(ids.size()), ctx = model->config().n_positions;
    from = std::max<int64_t>(from, 1);
    if (from >= n)
        throw Error("generative perplexity: no tokens to score (" + std::to_string(n) + " ids, first " +
                    std::to_string(from) + ")");
    for (auto id : ids)
        if (id < 0 || id >= model->config().vocab_size)
            throw Error("generative perplexity: id " + std::to_string(id) +
                        " is outside the scoring model's vocabulary");
    torch::NoGradGuard ng;
    double nll = 0;
    int64_t scored = 0;
    for (int64_t next = from; next < n;) {
        // Window [s, e) scores tokens [next, e); each has at least min(i, ctx / 2) tokens of context, all when n <=
        // ctx.
        const int64_t s = std::max<int64_t>(0, std::min(next - ctx / 2, n - ctx));
        const int64_t e = std::min(n, s + ctx);
        auto win = torch::tensor(std::vector<int64_t>(ids.begin() + s, ids.begin() + e), torch::kInt64).unsqueeze(0);
        auto logp =
            torch::log_softmax(model->forward(win).logits[0].to(torch::kCPU, torch::kFloat64), -1); // [e-s, V]
        for (int64_t i = next; i < e; ++i) nll -= logp[i - 1 - s][ids[static_cast<size_t>(i)]].item<double>();
        scored += e - next;
        next = e;
    }
    return std::exp(nll / double(scored));
}

} // namespace anchor::text
