#include "text/diffusion/mdlm_model.h"

#include "cache/io/atomic_file.h"
#include "cache/io/error.h"
#include "cache/io/json_config.h"
#include "cache/io/model_source.h"
#include "cache/io/safetensors.h"
#include "cache/io/weight_map.h"
#include "kernels/attention.h"
#include "kernels/decode_ops.h"
#include "kernels/gemv.h"
#include "kernels/row_ops.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <regex>

namespace anchor::text {

namespace fs = std::filesystem;

const char* gate_kind_name(GateKind g) {
    return g == GateKind::TimeAnchor ? "time_anchor" : "adaln";
}

const EnumTable<GateKind>& gate_kind_table() {
    static const EnumTable<GateKind> t = {{"time_anchor", GateKind::TimeAnchor}, {"adaln", GateKind::AdaLN}};
    return t;
}

// ---- config ---------------------------------------------------------------------------------------------------------

void MdlmConfig::validate() const {
    auto bad = [](const std::string& m) { throw Error("MDLM config: " + m); };
    if (hidden_size <= 0 || n_heads <= 0 || hidden_size % n_heads != 0)
        bad("hidden_size " + std::to_string(hidden_size) + " is not a positive multiple of n_heads " +
            std::to_string(n_heads));
    if (head_dim() % 2 != 0) bad("head_dim must be even for rotary embeddings");
    if (n_blocks <= 0 || cond_dim <= 0 || mlp_ratio <= 0 || freq_embed_size <= 0 || freq_embed_size % 2 != 0)
        bad("n_blocks, cond_dim, mlp_ratio must be positive and freq_embed_size positive and even");
    if (vocab_size < 2) bad("vocab_size must be >= 2");
    if (!compact_vocab && mask_token_id != vocab_size - 1)
        bad("mask_token_id must be the last id (vocab_size - 1) for a full vocabulary");
}

namespace {

// The fields that are written and read as they are (the gate is an enum with aliases: below).
std::vector<JsonField> plain_fields(MdlmConfig& c) {
    std::vector<JsonField> f{ANCHOR_JSON_FIELD(c, vocab_size),  ANCHOR_JSON_FIELD(c, mask_token_id),
                             ANCHOR_JSON_FIELD(c, hidden_size), ANCHOR_JSON_FIELD(c, n_heads),
                             ANCHOR_JSON_FIELD(c, n_blocks),    ANCHOR_JSON_FIELD(c, cond_dim),
                             ANCHOR_JSON_FIELD(c, mlp_ratio)};
    f.insert(f.end(), {ANCHOR_JSON_FIELD(c, freq_embed_size), ANCHOR_JSON_FIELD(c, max_seq_len),
                       ANCHOR_JSON_FIELD(c, rope_base), ANCHOR_JSON_FIELD(c, norm_eps), ANCHOR_JSON_FIELD(c, noise_eps),
                       ANCHOR_JSON_FIELD(c, tie_word_embeddings), ANCHOR_JSON_FIELD(c, compact_vocab),
                       ANCHOR_JSON_FIELD(c, time_conditioning)});
    return f;
}

// Hugging Face's MDLMConfig (kuleshov-group/mdlm-owt, configuration_mdlm.py): its own key names, no gate (the DiT's
// 6-way adaLN), full GPT-2 vocabulary with [MASK] last, untied head. `dropout` is training-only.
MdlmConfig from_hf_mdlm_json(const nlohmann::json& j, const std::string& source) {
    const JsonConfig f(j, source);
    MdlmConfig c;
    c.gate = GateKind::AdaLN;
    c.time_conditioning = false; // MDLMConfig's default
    std::vector<JsonField> fields{JsonField{"vocab_size", &c.vocab_size},
                                  JsonField{"hidden_dim", &c.hidden_size},
                                  JsonField{"n_heads", &c.n_heads},
                                  JsonField{"n_blocks", &c.n_blocks},
                                  JsonField{"cond_dim", &c.cond_dim},
                                  JsonField{"model_length", &c.max_seq_len},
                                  JsonField{"time_conditioning", &c.time_conditioning}};
    f.read(fields);
    c.mask_token_id = c.vocab_size - 1;
    c.validate();
    return c;
}

} // namespace

nlohmann::json MdlmConfig::to_json() const {
    MdlmConfig c = *this;
    auto j = json_of(plain_fields(c));
    j["model_type"] = "mdlm";
    j["gate"] = gate_kind_name(gate);
    return j;
}

MdlmConfig MdlmConfig::from_json(const nlohmann::json& j, const std::string& source) {
    if (j.is_object() && j.contains("hidden_dim") && !j.contains("hidden_size")) return from_hf_mdlm_json(j, source);
    const JsonConfig f(j, source);
    MdlmConfig c;
    f.read(plain_fields(c));
    // The table's names, and the aliases older configs were written with.
    const std::string gate = f.get_string("gate", gate_kind_name(c.gate));
    if (gate == "time_anchor" || gate == "anchor")
        c.gate = GateKind::TimeAnchor;
    else if (gate == "adaln" || gate == "plain")
        c.gate = GateKind::AdaLN;
    else
        f.fail("gate", "one of " + enum_choices(gate_kind_table()), j.at("gate"));
    c.validate();
    return c;
}

MdlmConfig MdlmConfig::load(const std::string& path) {
    return from_json(JsonConfig::load(path, "MDLM config").json(), path);
}

MdlmConfig MdlmConfig::detect_from_weights(const WeightMap& w, int64_t n_heads_hint) {
    MdlmConfig c;
    auto need = [&](const std::string& n) {
        if (!w.has(n)) throw Error("cannot detect MDLM config: tensor '" + n + "' missing (" + w.describe() + ")");
        return w.shape(n);
    };
    auto emb = need("vocab_embed.embedding");
    if (emb.size() != 2) throw Error("vocab_embed.embedding must be 2-D, got " + shape_str(emb));
    c.vocab_size = emb[0];
    c.hidden_size = emb[1];
    auto s0 = need("sigma_map.mlp.0.weight");
    c.cond_dim = s0[0];
    c.freq_embed_size = s0[1];
    int64_t n = 0;
    while (w.has("blocks." + std::to_string(n) + ".norm1.weight")) ++n;
    if (n == 0) throw Error("cannot detect MDLM config: no blocks.0.norm1.weight (" + w.describe() + ")");
    c.n_blocks = n;
    auto m0 = need("blocks.0.mlp.0.weight");
    c.mlp_ratio = m0[0] / c.hidden_size;
    c.gate = w.has("blocks.0.gate_attn.weight") ? GateKind::TimeAnchor : GateKind::AdaLN;
    c.tie_word_embeddings = !w.has("output_layer.linear.weight");
    c.compact_vocab = w.has("vocab_ids");
    c.mask_token_id = c.compact_vocab ? kMdlmMaskId : c.vocab_size - 1;
    c.n_heads = n_heads_hint > 0 ? n_heads_hint : std::max<int64_t>(1, c.hidden_size / 64);
    c.validate();
    return c;
}

// ---- modules --------------------------------------------------------------------------------------------------------

NormNoBiasImpl::NormNoBiasImpl(int64_t dim, double eps_) : eps(eps_) {
    weight = register_parameter("weight", torch::ones({dim}));
}

torch::Tensor NormNoBiasImpl::forward(const torch::Tensor& x) {
    return torch::layer_norm(x, {x.size(-1)}, weight, {}, eps);
}

Rope Rope::select(const torch::Tensor& positions) const {
    const auto p = positions.to(cos.device()); // a sampler's positions come from the CPU
    return {cos.index_select(0, p), sin.index_select(0, p)};
}

// One head row of the rotate-half rotary embedding, (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) with cos/sin
// repeated over the halves: x's d values `stride` apart, c and sn the position's cos/sin rows, o d contiguous values.
// The same two products and one sum per element as the tensor expression in apply_rope, so the same bits.
static void rope_row(const float* x, int64_t stride, const float* c, const float* sn, float* o, int64_t d) {
    const int64_t h = d / 2;
    for (int64_t j = 0; j < h; ++j) {
        const float x1 = x[j * stride], x2 = x[(j + h) * stride];
        const float a = x1 * c[j], b = -x2 * sn[j];
        o[j] = a + b;
        const float a2 = x2 * c[j + h], b2 = x1 * sn[j + h];
        o[j + h] = a2 + b2;
    }
}

static torch::Tensor apply_rope(const torch::Tensor& x, const Rope& r) {
    // x [B, H, n, d]; rotate-half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), cos/sin repeated over halves.
    // float32 on the CPU: one pass over x (it is a strided view of the fused qkv projection) with the same two
    // products and one sum per element as the tensor expression below, so the same bits, without its six
    // intermediate tensors (a block step of the dual cache computes a few rows, where those dominate).
    const bool plain = x.device().is_cpu() && x.dim() == 4 && x.scalar_type() == torch::kFloat &&
                       r.cos.scalar_type() == torch::kFloat && r.sin.scalar_type() == torch::kFloat &&
                       r.cos.dim() == 2 && r.cos.sizes() == r.sin.sizes() && r.cos.size(0) == x.size(2) &&
                       r.cos.size(1) == x.size(3) && x.size(3) % 2 == 0 && r.cos.is_contiguous() &&
                       r.sin.is_contiguous();
    if (plain) {
        auto out = torch::empty(x.sizes(), x.options());
        const int64_t B = x.size(0), H = x.size(1), n = x.size(2), d = x.size(3);
        const int64_t s0 = x.stride(0), s1 = x.stride(1), s2 = x.stride(2), s3 = x.stride(3);
        const float *xp = x.data_ptr<float>(), *cp = r.cos.data_ptr<float>(), *sp = r.sin.data_ptr<float>();
        float* op = out.data_ptr<float>();
        for (int64_t b = 0; b < B; ++b)
            for (int64_t hh = 0; hh < H; ++hh)
                for (int64_t i = 0; i < n; ++i) {
                    rope_row(xp + b * s0 + hh * s1 + i * s2, s3, cp + i * d, sp + i * d,
                             op + ((b * H + hh) * n + i) * d, d);
                }
        return out;
    }
    auto half = x.size(-1) / 2;
    auto x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
    auto rot = torch::cat({-x2, x1}, -1);
    return x * r.cos + rot * r.sin;
}

// The most rows for which kernels::few_rows_linear is used on backend g, where it beats that library on one thread
// with a 384-wide model's weights streamed from memory (tests/bench/results/mdlm_few_rows_linear_*.txt): OpenBLAS packs
// the weight on every call and loses to the AVX-512 kernel at every count measured (to 64) and to the AVX2 one to
// about 32; oneDNN's matmul reads the weight in place and catches up near 48 rows (the AVX2 kernel: 12). bfloat16
// operands stay on oneDNN.
int64_t few_rows_limit(kernels::GemmBackend g) {
    if (!kernels::gemv_uses_avx2()) return 0;
    const bool avx512 = kernels::gemv_uses_avx512();
    switch (g) {
    case kernels::GemmBackend::Torch:
        return avx512 ? 64 : 32;
    case kernels::GemmBackend::OneDnn:
    case kernels::GemmBackend::Winograd:
        return avx512 ? 32 : 8;
    case kernels::GemmBackend::Bf16:
        return 0;
    }
    return 0;
}

namespace {
// x W^T (+ b) on backend g: a few rows streamed (few_rows_limit), else oneDNN's matmul where it applies, else
// LibTorch's functional linear (SEDD's bits).
torch::Tensor linear_on(kernels::GemmBackend g, bool stream, const torch::Tensor& x, const torch::Tensor& w,
                        const torch::Tensor& b) {
    if (stream && kernels::few_rows_linear_applies(x, w, few_rows_limit(g))) return kernels::few_rows_linear(x, w, b);
    const bool bf16 = g == kernels::GemmBackend::Bf16;
    if (kernels::runs_on_onednn(g) && kernels::onednn_linear_applies(x, w, bf16))
        return kernels::onednn_linear(x, w, b, bf16);
    return torch::nn::functional::linear(x, w, b);
}
torch::Tensor linear_on(kernels::GemmBackend g, bool stream, torch::nn::Linear l, const torch::Tensor& x) {
    return linear_on(g, stream, x, l->weight, l->bias);
}
} // namespace

MdlmBlockImpl::MdlmBlockImpl(const MdlmConfig& c) : cfg(c) {
    const auto D = c.hidden_size;
    norm1 = register_module("norm1", NormNoBias(D, c.norm_eps));
    norm2 = register_module("norm2", NormNoBias(D, c.norm_eps));
    attn_qkv = register_module("attn_qkv", torch::nn::Linear(torch::nn::LinearOptions(D, 3 * D).bias(false)));
    attn_out = register_module("attn_out", torch::nn::Linear(torch::nn::LinearOptions(D, D).bias(false)));
    mlp = register_module("mlp", torch::nn::Sequential(torch::nn::Linear(D, c.mlp_ratio * D),
                                                       torch::nn::Functional([](const torch::Tensor& x) {
                                                           return torch::gelu(x, "tanh");
                                                       }),
                                                       torch::nn::Linear(c.mlp_ratio * D, D)));
    const int64_t chunks = c.gate == GateKind::AdaLN ? 6 : 4;
    adaLN_modulation = register_module("adaLN_modulation", torch::nn::Linear(c.cond_dim, chunks * D));
    if (c.gate == GateKind::TimeAnchor) {
        gate_attn = register_module("gate_attn", torch::nn::Linear(c.cond_dim, D));
        gate_ffn = register_module("gate_ffn", torch::nn::Linear(c.cond_dim, D));
    }
}

BlockModulation MdlmBlockImpl::modulation(const torch::Tensor& c) const {
    auto mod = const_cast<MdlmBlockImpl*>(this)->adaLN_modulation->forward(c).unsqueeze(1); // [B, 1, kD]
    BlockModulation m;
    if (cfg.gate == GateKind::AdaLN) {
        auto ch = mod.chunk(6, -1); // SEDD order: shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp
        m.shift1 = ch[0], m.scale1 = ch[1], m.gate_attn = ch[2];
        m.shift2 = ch[3], m.scale2 = ch[4], m.gate_ffn = ch[5];
    } else {
        auto ch = mod.chunk(4, -1);
        m.shift1 = ch[0], m.scale1 = ch[1], m.shift2 = ch[2], m.scale2 = ch[3];
        auto self = const_cast<MdlmBlockImpl*>(this);
        m.gate_attn = torch::sigmoid(self->gate_attn->forward(c)).unsqueeze(1);
        m.gate_ffn = torch::sigmoid(self->gate_ffn->forward(c)).unsqueeze(1);
    }
    return m;
}

torch::Tensor MdlmBlockImpl::attn_input(const torch::Tensor& x, const BlockModulation& m) {
    return norm1->forward(x) * (1 + m.scale1) + m.shift1;
}

void MdlmBlockImpl::qkv(const torch::Tensor& h, const Rope& rope, torch::Tensor& q, torch::Tensor& k,
                        torch::Tensor& v) {
    const auto B = h.size(0), n = h.size(1), H = cfg.n_heads, d = cfg.head_dim();
    auto t =
        linear_on(gemm, stream_few_rows, attn_qkv, h).view({B, n, 3, H, d}).permute({2, 0, 3, 1, 4}); // [3, B, H, n, d]
    q = apply_rope(t[0], rope);
    k = apply_rope(t[1], rope);
    v = t[2].contiguous();
}

torch::Tensor MdlmBlockImpl::value(const torch::Tensor& h) {
    const auto B = h.size(0), n = h.size(1), H = cfg.n_heads, d = cfg.head_dim(), D = cfg.hidden_size;
    auto wv = attn_qkv->weight.narrow(0, 2 * D, D);
    return torch::matmul(h, wv.t()).view({B, n, H, d}).permute({0, 2, 1, 3}).contiguous();
}

void MdlmModelImpl::set_attention_kernel(kernels::AttentionKernel k) {
    for (auto& b : block_list) b->kernel = k;
}

void MdlmModelImpl::set_gemm_backend(kernels::GemmBackend g) {
    if (g != kernels::GemmBackend::Torch && !placement_.reference())
        throw ParamError("gemm", "'" + enum_name(kernels::gemm_backend_table(), g) +
                                     "' runs on the CPU in float32; the weights are on " + placement_.str() +
                                     " (use torch)");
    if (const auto why = kernels::gemm_backend_unavailable(g); !why.empty()) throw ParamError("gemm", why);
    if (g != kernels::GemmBackend::Torch && !kernels::onednn_available())
        throw ParamError("gemm", "'" + enum_name(kernels::gemm_backend_table(), g) +
                                     "' runs on oneDNN, and this build has none (use torch)");
    for (auto& b : block_list) b->gemm = g;
    output_layer->gemm = g;
}

void MdlmModelImpl::place(const Placement& p) {
    p.validate();
    if (p.device == placement_.device && p.dtype == placement_.dtype) return;
    if (gemm_backend() != kernels::GemmBackend::Torch && !p.reference())
        throw ParamError("gemm", "'" + enum_name(kernels::gemm_backend_table(), gemm_backend()) +
                                     "' runs on the CPU in float32, not on " + p.str() + " (use torch)");
    torch::NoGradGuard ng;
    // Parameters only: Module::to would move the int64 vocab_ids buffer too, which the CPU-side id maps read.
    for (auto& t : parameters()) t.set_data(t.detach().to(p.device, p.dtype));
    placement_ = p;
}

void configure_mdlm(MdlmModel& model, kernels::AttentionKernel attention, const Placement& placement,
                    kernels::GemmBackend gemm) {
    model->set_attention_kernel(attention);
    model->place(placement);
    model->set_gemm_backend(gemm);
}

void MdlmModelImpl::set_stream_few_rows(bool on) {
    for (auto& b : block_list) b->stream_few_rows = on;
    output_layer->stream_few_rows = on;
}

void MdlmModelImpl::set_fuse_rows(bool on) {
    for (auto& b : block_list) b->fuse_rows = on;
}

torch::Tensor MdlmBlockImpl::attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
    // SEDD's attention: softmax((q k^T) / sqrt(d)) v, bidirectional.
    kernels::AttentionOptions ao;
    ao.layout = kernels::AttentionLayout::Heads;
    ao.formula = kernels::ScoreFormula::ScaleAfter;
    ao.kernel = kernel;
    auto o = kernels::attention(q, k, v, ao); // [B, H, nq, d]
    o = o.permute({0, 2, 1, 3}).reshape({q.size(0), q.size(2), cfg.hidden_size});
    return linear_on(gemm, stream_few_rows, attn_out, o);
}

torch::Tensor MdlmBlockImpl::ffn(const torch::Tensor& x, const BlockModulation& m) {
    auto h = norm2->forward(x) * (1 + m.scale2) + m.shift2;
    const auto& up = *mlp[0]->as<torch::nn::Linear>();
    const auto& down = *mlp[2]->as<torch::nn::Linear>();
    const auto act =
        mlp[1]->as<torch::nn::Functional>()->forward(linear_on(gemm, stream_few_rows, h, up.weight, up.bias));
    return linear_on(gemm, stream_few_rows, act, down.weight, down.bias);
}

torch::Tensor MdlmBlockImpl::forward(const torch::Tensor& x, const BlockModulation& m, const Rope& rope) {
    torch::Tensor q, k, v;
    qkv(attn_input(x, m), rope, q, k, v);
    auto y = x + m.gate_attn * attend(q, k, v);
    return y + m.gate_ffn * ffn(y, m);
}

namespace {
// q, k, v [H, n, d] from the fused projection t [n, 3D] of the positions `pos` (int64 [n]), rotary applied to q and k
// with the rows `pos` of the whole sequence's cos/sin [L, d] (apply_rope's products and sums, per element).
void split_rope_rows(const torch::Tensor& t, const Rope& rope, const torch::Tensor& pos, int64_t H, torch::Tensor& q,
                     torch::Tensor& k, torch::Tensor& v) {
    const int64_t n = t.size(0), D = t.size(1) / 3, d = D / H;
    q = torch::empty({H, n, d}, t.options());
    k = torch::empty({H, n, d}, t.options());
    v = torch::empty({H, n, d}, t.options());
    const float *tp = t.data_ptr<float>(), *cp = rope.cos.data_ptr<float>(), *sp = rope.sin.data_ptr<float>();
    const int64_t* pp = pos.data_ptr<int64_t>();
    float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) {
        const float *c = cp + pp[i] * d, *sn = sp + pp[i] * d;
        for (int64_t h = 0; h < H; ++h) {
            const int64_t o = (h * n + i) * d;
            rope_row(tp + i * 3 * D + h * d, 1, c, sn, qp + o, d);
            rope_row(tp + i * 3 * D + D + h * d, 1, c, sn, kp + o, d);
            std::copy(tp + i * 3 * D + 2 * D + h * d, tp + i * 3 * D + 2 * D + (h + 1) * d, vp + o);
        }
    }
}
} // namespace

bool MdlmBlockImpl::rows_path_applies(int64_t n, int64_t length, const torch::Tensor& x, const Rope& rope) const {
    if (!stream_few_rows || !fuse_rows || n < 0 || n >= length || n > few_rows_limit(gemm) || x.dim() != 3 ||
        x.size(0) != 1 || !x.is_contiguous() || !x.device().is_cpu() || x.scalar_type() != torch::kFloat)
        return false;
    if (torch::GradMode::is_enabled() && x.requires_grad()) return false;
    if (rope.cos.dim() != 2 || rope.cos.size(0) != length || !rope.cos.is_contiguous() || !rope.sin.is_contiguous() ||
        rope.cos.scalar_type() != torch::kFloat || rope.sin.scalar_type() != torch::kFloat)
        return false;
    auto& seq = const_cast<torch::nn::Sequential&>(mlp);
    const auto& up = *seq[0]->as<torch::nn::Linear>();
    const auto& down = *seq[2]->as<torch::nn::Linear>();
    for (const auto* w : {&attn_qkv->weight, &attn_out->weight, &up.weight, &down.weight})
        if (w->scalar_type() != torch::kFloat || !w->is_contiguous() || !w->device().is_cpu()) return false;
    return true;
}

torch::Tensor MdlmBlockImpl::forward_rows(const torch::Tensor& x, const torch::Tensor& x_rows, const BlockModulation& m,
                                          const Rope& rope, const torch::Tensor& active,
                                          const torch::Tensor& active_in_x, BlockLatents& latents) {
    if (active.size(0) > 0) {
        auto h = kernels::modulated_norm_rows(x[0], active_in_x, norm1->weight, m.scale1, m.shift1, cfg.norm_eps);
        torch::Tensor q, k, v;
        split_rope_rows(kernels::few_rows_linear(h, attn_qkv->weight), rope, active, cfg.n_heads, q, k, v);
        latents.write(BlockLatent::K, active, k);
        latents.write(BlockLatent::V, active, v);
        const auto keys = latents.read(BlockLatent::K), values = latents.read(BlockLatent::V);
        const double scale = 1.0 / std::sqrt(double(cfg.head_dim()));
        latents.write(BlockLatent::Attn, active,
                      kernels::few_rows_linear(kernels::few_query_attention(q, keys, values, scale), attn_out->weight));
    }
    // The gated residuals, the cached branch rows of x's positions (all of them when x is the whole sequence).
    auto y = torch::empty_like(x);
    kernels::gated_add_rows(x[0], m.gate_attn, latents.read(BlockLatent::Attn), x_rows, y[0]);
    if (active.size(0) > 0) {
        auto h2 = kernels::modulated_norm_rows(y[0], active_in_x, norm2->weight, m.scale2, m.shift2, cfg.norm_eps);
        const auto& up = *mlp[0]->as<torch::nn::Linear>();
        const auto& down = *mlp[2]->as<torch::nn::Linear>();
        auto act = kernels::few_rows_linear(h2, up.weight, up.bias); // the MLP's GELU (tanh form), in place
        kernels::gelu_tanh_row(act.data_ptr<float>(), act.numel());
        latents.write(BlockLatent::Ffn, active, kernels::few_rows_linear(act, down.weight, down.bias));
    }
    kernels::gated_add_rows(y[0], m.gate_ffn, latents.read(BlockLatent::Ffn), x_rows, y[0]);
    return y;
}

torch::Tensor MdlmBlockImpl::forward_cached(const torch::Tensor& x, const BlockModulation& m, const Rope& rope,
                                            const torch::Tensor& active, BlockLatents& latents) {
    if (active.size(0) > 0 && rows_path_applies(active.size(0), x.size(1), x, rope))
        return forward_rows(x, {}, m, rope, active, active, latents);
    const bool any = active.size(0) > 0;
    // The rows are gathered on x's device; the latents take the positions as given (LatentCache moves them).
    const auto act = active.to(x.device());
    if (any) {
        torch::Tensor q, k, v;
        qkv(attn_input(x.index_select(1, act), m), rope.select(act), q, k, v);
        latents.write(BlockLatent::K, active, k[0]);
        latents.write(BlockLatent::V, active, v[0]);
        auto o = attend(q, latents.read(BlockLatent::K).unsqueeze(0), latents.read(BlockLatent::V).unsqueeze(0));
        latents.write(BlockLatent::Attn, active, o[0]);
    }
    auto y = x + m.gate_attn * latents.read(BlockLatent::Attn).unsqueeze(0);
    if (any) latents.write(BlockLatent::Ffn, active, ffn(y.index_select(1, act), m)[0]);
    return y + m.gate_ffn * latents.read(BlockLatent::Ffn).unsqueeze(0);
}

TimestepEmbedderImpl::TimestepEmbedderImpl(int64_t cond_dim, int64_t freq) : freq_size(freq) {
    mlp = register_module("mlp", torch::nn::Sequential(torch::nn::Linear(freq, cond_dim), torch::nn::SiLU(),
                                                       torch::nn::Linear(cond_dim, cond_dim)));
}

torch::Tensor TimestepEmbedderImpl::forward(const torch::Tensor& sigma) {
    // DiT / SEDD sinusoidal embedding: [cos(s f_i), sin(s f_i)], f_i = 10000^(-i / half).
    const int64_t half = freq_size / 2;
    auto opts = sigma.options();
    auto freqs = torch::exp(-std::log(10000.0) * torch::arange(half, opts) / static_cast<double>(half));
    auto args = sigma.unsqueeze(-1) * freqs.unsqueeze(0);
    // The sinusoids in float32 (sigma near 0 and 1e3 frequencies), the MLP in the weights' dtype.
    const auto dtype = mlp[0]->as<torch::nn::Linear>()->weight.scalar_type();
    return mlp->forward(torch::cat({torch::cos(args), torch::sin(args)}, -1).to(dtype));
}

EmbeddingImpl::EmbeddingImpl(int64_t vocab, int64_t dim) {
    embedding = register_parameter("embedding", torch::empty({vocab, dim}));
}

torch::Tensor EmbeddingImpl::forward(const torch::Tensor& ids) {
    auto s = ids.sizes().vec();
    s.push_back(embedding.size(1));
    return embedding.index_select(0, ids.reshape(-1)).view(s);
}

HeadLinearImpl::HeadLinearImpl(int64_t in, int64_t out, bool tied) {
    if (!tied) weight = register_parameter("weight", torch::empty({out, in}));
    bias = register_parameter("bias", torch::zeros({out}));
}

OutputLayerImpl::OutputLayerImpl(const MdlmConfig& c) {
    norm_final = register_module("norm_final", NormNoBias(c.hidden_size, c.norm_eps));
    adaLN_modulation = register_module("adaLN_modulation", torch::nn::Linear(c.cond_dim, 2 * c.hidden_size));
    linear = register_module("linear", HeadLinear(c.hidden_size, c.vocab_size, c.tie_word_embeddings));
}

torch::Tensor OutputLayerImpl::forward(const torch::Tensor& h, const torch::Tensor& c, const torch::Tensor& tied) {
    auto ch = adaLN_modulation->forward(c).unsqueeze(1).chunk(2, -1); // shift, scale
    return forward(h, ch[0], ch[1], tied, linear->bias);
}

torch::Tensor OutputLayerImpl::forward(const torch::Tensor& h, const torch::Tensor& shift, const torch::Tensor& scale,
                                       const torch::Tensor& tied, const torch::Tensor& bias) {
    auto x = norm_final->forward(h) * (1 + scale) + shift;
    const auto& w = linear->weight.defined() ? linear->weight : tied;
    return linear_on(gemm, stream_few_rows, x, w, bias);
}

// ---- model ----------------------------------------------------------------------------------------------------------

MdlmModelImpl::MdlmModelImpl(const MdlmConfig& c) : cfg_(c) {
    cfg_.validate();
    vocab_embed = register_module("vocab_embed", Embedding(c.vocab_size, c.hidden_size));
    sigma_map = register_module("sigma_map", TimestepEmbedder(c.cond_dim, c.freq_embed_size));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < c.n_blocks; ++i) {
        block_list.push_back(MdlmBlock(c));
        blocks->push_back(block_list.back());
    }
    output_layer = register_module("output_layer", OutputLayer(c));
    if (c.compact_vocab) {
        vocab_ids = register_buffer("vocab_ids", torch::zeros({c.vocab_size}, torch::kInt64));
        ext_to_int_ = torch::full({c.mask_token_id + 1}, -1, torch::kInt64);
    }
    mask_bias_ = torch::zeros({c.vocab_size});
    mask_bias_[internal_mask_id()] = -std::numeric_limits<float>::infinity();
}

void MdlmModelImpl::set_vocab_ids(const torch::Tensor& ids) {
    if (!cfg_.compact_vocab) throw Error("set_vocab_ids: model does not use a compact vocabulary");
    if (ids.numel() != cfg_.vocab_size)
        throw Error("vocab_ids: expected " + std::to_string(cfg_.vocab_size) + " ids, got " +
                    std::to_string(ids.numel()));
    auto v = ids.to(torch::kInt64).contiguous();
    if (v[-1].item<int64_t>() != cfg_.mask_token_id) throw Error("vocab_ids: the last id must be [MASK]");
    if (v.min().item<int64_t>() < 0 || v.max().item<int64_t>() > cfg_.mask_token_id)
        throw Error("vocab_ids: ids out of range");
    {
        torch::NoGradGuard ng;
        vocab_ids.copy_(v);
    }
    ext_to_int_.fill_(-1);
    ext_to_int_.index_copy_(0, v, torch::arange(cfg_.vocab_size, torch::kInt64));
}

torch::Tensor MdlmModelImpl::internal_or_minus_one(const torch::Tensor& ids) const {
    if (!cfg_.compact_vocab) return ids;
    if (ext_to_int_[cfg_.mask_token_id].item<int64_t>() < 0) // buffer loaded after construction: rebuild map
        const_cast<MdlmModelImpl*>(this)->set_vocab_ids(vocab_ids.clone());
    return ext_to_int_.index_select(0, ids.reshape(-1)).view(ids.sizes());
}

bool MdlmModelImpl::in_vocabulary(const std::vector<int64_t>& gpt2_ids) const {
    for (auto id : gpt2_ids)
        if (id < 0 || id >= cfg_.mask_token_id) return false; // [MASK] is not a prompt token either
    auto ids = torch::tensor(gpt2_ids, torch::kInt64);
    return ids.numel() == 0 || internal_or_minus_one(ids).min().item<int64_t>() >= 0;
}

torch::Tensor MdlmModelImpl::to_internal(const torch::Tensor& gpt2_ids) const {
    auto ids = gpt2_ids.to(torch::kInt64);
    if (ids.numel() && (ids.min().item<int64_t>() < 0 || ids.max().item<int64_t>() > cfg_.mask_token_id))
        throw Error("token id out of range [0, " + std::to_string(cfg_.mask_token_id) + "]");
    if (!cfg_.compact_vocab) return ids;
    auto r = internal_or_minus_one(ids);
    if (r.numel() && r.min().item<int64_t>() < 0) {
        auto bad = ids.reshape(-1).index_select(0, torch::nonzero(r.reshape(-1) < 0).reshape(-1));
        throw Error("token id " + std::to_string(bad[0].item<int64_t>()) +
                    " is not in this model's compact vocabulary (" + std::to_string(cfg_.vocab_size) + " tokens)");
    }
    return r;
}

torch::Tensor MdlmModelImpl::to_external(const torch::Tensor& internal_ids) const {
    if (!cfg_.compact_vocab) return internal_ids.to(torch::kInt64);
    return vocab_ids.index_select(0, internal_ids.reshape(-1).to(torch::kInt64)).view(internal_ids.sizes());
}

torch::Tensor MdlmModelImpl::sigma_of_t(const torch::Tensor& t) const {
    // MDLM log-linear schedule: alpha_t = 1 - (1 - eps) t, sigma(t) = -log(alpha_t).
    return -torch::log1p(-(1.0 - cfg_.noise_eps) * t);
}

torch::Tensor MdlmModelImpl::conditioning(const torch::Tensor& t) {
    auto tf = t.to(placement_.device, torch::kFloat32);
    auto sigma = cfg_.time_conditioning ? sigma_of_t(tf) : torch::zeros_like(tf);
    return torch::silu(sigma_map->forward(sigma));
}

Rope MdlmModelImpl::rope(int64_t length, const torch::TensorOptions& opts) const {
    const int64_t d = cfg_.head_dim(), half = d / 2;
    auto inv =
        torch::pow(cfg_.rope_base, -torch::arange(half, opts.dtype(torch::kFloat64)) / static_cast<double>(half));
    auto ang = torch::arange(length, opts.dtype(torch::kFloat64)).unsqueeze(1) * inv.unsqueeze(0); // [L, half]
    ang = torch::cat({ang, ang}, 1);
    return {torch::cos(ang).to(opts.dtype()), torch::sin(ang).to(opts.dtype())};
}

torch::Tensor MdlmModelImpl::hidden(const torch::Tensor& ids, const torch::Tensor& c,
                                    std::vector<torch::Tensor>* per_layer) {
    auto x = embed(ids);
    auto r = rope(ids.size(1), x.options());
    for (auto& b : block_list) {
        x = b->forward(x, b->modulation(c), r);
        if (per_layer) per_layer->push_back(x);
    }
    return x;
}

torch::Tensor MdlmModelImpl::head(const torch::Tensor& h, const torch::Tensor& c) {
    auto logits = output_layer->forward(h, c, vocab_embed->embedding);
    return logits + mask_bias_.to(logits.options());
}

StepConditioning MdlmModelImpl::step_conditioning(const torch::Tensor& t) {
    StepConditioning s;
    s.c = conditioning(t);
    for (auto& b : block_list) s.blocks.push_back(b->modulation(s.c));
    auto ch = output_layer->adaLN_modulation->forward(s.c).unsqueeze(1).chunk(2, -1);
    s.head_shift = ch[0], s.head_scale = ch[1];
    // Adding the [MASK] column's -inf to the bias gives the same bits as adding it to the logits: x + 0 = x, and the
    // mask column is -inf either way.
    s.head_bias = output_layer->linear->bias + mask_bias_.to(output_layer->linear->bias.options());
    return s;
}

torch::Tensor MdlmModelImpl::head(const torch::Tensor& h, const StepConditioning& s) {
    return output_layer->forward(h, s.head_shift, s.head_scale, vocab_embed->embedding, s.head_bias);
}

torch::Tensor MdlmModelImpl::forward(const torch::Tensor& ids, const torch::Tensor& t) {
    auto c = conditioning(t);
    return head(hidden(ids, c), c);
}

// ---- init / IO ------------------------------------------------------------------------------------------------------

void init_mdlm_weights(MdlmModel& model, uint64_t seed, double std) {
    torch::NoGradGuard ng;
    auto gen = at::detail::createCPUGenerator(seed);
    for (auto& p : model->named_parameters(true)) {
        auto& t = p.value();
        const auto& n = p.key();
        if (n.find("norm") != std::string::npos)
            t.fill_(1.0);
        else if (n.find("adaLN_modulation") != std::string::npos)
            t.zero_(); // SEDD: zero-initialised modulation
        else if (n.size() > 5 && n.compare(n.size() - 5, 5, ".bias") == 0)
            t.zero_();
        else
            t.normal_(0.0, std, gen);
    }
}

void randomize_mdlm_weights(MdlmModel& model, uint64_t seed) {
    torch::NoGradGuard ng;
    auto gen = at::detail::createCPUGenerator(seed);
    const double D = static_cast<double>(model->config().hidden_size);
    for (auto& p : model->named_parameters(true)) {
        auto& t = p.value();
        const auto& n = p.key();
        if (n.find("norm") != std::string::npos) {
            t.normal_(1.0, 0.1, gen);
        } else if (t.dim() == 1) {
            t.normal_(0.0, 0.05, gen);
        } else if (n.find("embedding") != std::string::npos) {
            t.normal_(0.0, 1.0, gen);
        } else {
            t.normal_(0.0, 1.0 / std::sqrt(static_cast<double>(t.size(1))), gen); // unit-variance outputs
            if (n.find("adaLN") != std::string::npos) t.mul_(0.3);
        }
    }
    (void)D;
}

std::vector<std::pair<std::string, torch::Tensor>> mdlm_named_tensors(const MdlmModel& model) {
    std::vector<std::pair<std::string, torch::Tensor>> out;
    for (const auto& p : model->named_parameters(true)) out.emplace_back(p.key(), p.value().detach());
    for (const auto& b : model->named_buffers(true)) out.emplace_back(b.key(), b.value().detach());
    return out;
}

std::string unsupported_diffusion_lm(const nlohmann::json& config, const std::vector<std::string>& names) {
    auto has_prefix = [&](const std::string& p) {
        return std::any_of(names.begin(), names.end(), [&](const std::string& n) { return n.rfind(p, 0) == 0; });
    };
    std::string type, archs;
    if (config.is_object()) {
        type = config.value("model_type", std::string());
        if (config.contains("architectures") && config["architectures"].is_array())
            for (const auto& a : config["architectures"])
                if (a.is_string()) archs += a.get<std::string>() + " ";
    }
    auto lower = [](std::string s) {
        for (auto& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
        return s;
    };
    const std::string t = lower(type + " " + archs);
    // The published families load through text/diffusion/families (generate, bench, chat, serve --dlm-model); this
    // loader is the MDLM/SEDD DiT's, reached by the commands that only run that model (calibrate, train, ...).
    const char* runs = " checkpoint: this command runs the MDLM/SEDD DiT only (time-conditioned adaLN blocks); the ";
    const char* route = " family runs through `anchor-text diffusion generate|bench|chat` and `serve --dlm-model`";
    if (t.find("llada") != std::string::npos || has_prefix("model.transformer.blocks."))
        return std::string("a LLaDA") + runs + "LLaDA" + route;
    if (t.find("dream") != std::string::npos ||
        (has_prefix("model.layers.") && !has_prefix("vocab_embed") && !has_prefix("backbone.")))
        return std::string("a Dream") + runs + "Dream" + route;
    return "";
}

MdlmModel load_mdlm(const std::string& path, int64_t n_heads_hint) {
    // The one resolver: a training run folder also holds train_state.safetensors, and its model.safetensors is kept.
    const ModelSource src = resolve_model(path, {nullptr, "MDLM model"});
    // Another diffusion LM is named by its config before its (large) weights are read, else by its tensor names.
    if (auto why = unsupported_diffusion_lm(src.config, {}); !why.empty()) throw Error("'" + path + "': " + why);
    auto w = src.load_weights();
    if (!w.has("vocab_embed.embedding") && !w.has("backbone.vocab_embed.embedding")) {
        const auto why = unsupported_diffusion_lm(src.config, w.names());
        if (!why.empty()) throw Error("'" + path + "': " + why);
    }
    bool prefixed = w.has("backbone.vocab_embed.embedding");
    if (prefixed) w = w.with_prefix_stripped("backbone.");
    MdlmConfig cfg;
    const bool have_cfg = src.arch == ModelArch::MaskedDiffusionLM && !src.config_file.empty();
    if (have_cfg) cfg = MdlmConfig::from_json(src.config, src.config_file);
    const std::string cfg_path = src.config_file;
    if (!have_cfg)
        cfg = MdlmConfig::detect_from_weights(w, n_heads_hint);
    else {
        // The config must agree with the shapes; detection finds the disagreement with a clear message.
        auto det = MdlmConfig::detect_from_weights(w, cfg.n_heads);
        if (det.hidden_size != cfg.hidden_size || det.n_blocks != cfg.n_blocks || det.vocab_size != cfg.vocab_size ||
            det.gate != cfg.gate || det.compact_vocab != cfg.compact_vocab)
            throw Error("'" + cfg_path + "' disagrees with the weights in '" + path + "' (weights: D=" +
                        std::to_string(det.hidden_size) + ", blocks=" + std::to_string(det.n_blocks) +
                        ", V=" + std::to_string(det.vocab_size) + ", gate=" + gate_kind_name(det.gate) + ")");
    }
    MdlmModel model(cfg);
    w.load_into(*model, {R"(.*rotary_emb\..*)", R"(.*\.attn\.rotary_emb.*)"});
    if (cfg.compact_vocab) model->set_vocab_ids(model->vocab_ids.clone());
    model->eval();
    return model;
}

void save_mdlm(const MdlmModel& model, const std::string& dir, torch::ScalarType dtype, bool overwrite) {
    fs::create_directories(dir);
    NamedTensors ts;
    for (auto& [n, t] : mdlm_named_tensors(model))
        ts.emplace_back(n, t.is_floating_point() ? t.to(torch::kCPU, dtype).contiguous() : t.cpu().contiguous());
    std::map<std::string, std::string> meta;
    meta["format"] = "pt";
    save_safetensors((fs::path(dir) / "model.safetensors").string(), ts, meta, overwrite);
    write_file_atomic((fs::path(dir) / "config.json").string(), model->config().to_json().dump(2) + "\n", overwrite);
}

} // namespace anchor::text
