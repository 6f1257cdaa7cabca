// SD3Transformer2DModel (MMDiT), following diffusers 0.31's SD3Transformer2DModel / JointTransformerBlock /
// JointAttnProcessor2_0 / PatchEmbed / CombinedTimestepTextProjEmbeddings in float32 (see unet/model/mmdit.h).
#include "unet/model/mmdit.h"

#include "cache/io/deferred_weights.h"
#include "cache/io/error.h"
#include "cache/io/json_config.h"
#include "cache/io/model_source.h"
#include "cache/io/weight_map.h"
#include "unet/model/unet_model.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <set>

namespace anchor::unet {

using torch::Tensor;

namespace {

// make_linear: under a loader's DeferredWeights scope the weight is allocated, not initialised, in the load dtype.
torch::nn::Linear mmdit_linear(int64_t in, int64_t out, bool bias = true) {
    return make_linear(torch::nn::LinearOptions(in, out).bias(bias));
}

// LayerNorm without affine parameters, eps 1e-6: every norm of the joint blocks and norm_out.
Tensor mmdit_layer_norm(const Tensor& x) {
    return torch::layer_norm(x, {x.size(-1)}, {}, {}, 1e-6);
}

// [B, N, H*D] -> [B, H, N, D]
Tensor mmdit_split_heads(const Tensor& t, int64_t heads, int64_t head_dim) {
    return t.view({t.size(0), t.size(1), heads, head_dim}).transpose(1, 2);
}

std::vector<JsonField> mmdit_json_fields(SD3TransformerConfig& c) {
    return {ANCHOR_JSON_FIELD(c, sample_size),
            ANCHOR_JSON_FIELD(c, patch_size),
            ANCHOR_JSON_FIELD(c, in_channels),
            ANCHOR_JSON_FIELD(c, out_channels),
            ANCHOR_JSON_FIELD(c, num_layers),
            ANCHOR_JSON_FIELD(c, attention_head_dim),
            ANCHOR_JSON_FIELD(c, num_attention_heads),
            ANCHOR_JSON_FIELD(c, joint_attention_dim),
            ANCHOR_JSON_FIELD(c, caption_projection_dim),
            ANCHOR_JSON_FIELD(c, pooled_projection_dim),
            ANCHOR_JSON_FIELD(c, pos_embed_max_size),
            ANCHOR_JSON_FIELD(c, dual_attention_layers)};
}

} // namespace

// ---- config -----------------------------------------------------------------------------------------------------

bool SD3TransformerConfig::dual_attention(int block) const {
    return std::find(dual_attention_layers.begin(), dual_attention_layers.end(), block) != dual_attention_layers.end();
}

SD3TransformerConfig SD3TransformerConfig::from_json(const nlohmann::json& j, const std::string& source) {
    const JsonConfig f(j, source);
    SD3TransformerConfig c;
    f.read(mmdit_json_fields(c));
    if (!f.has("out_channels")) c.out_channels = c.in_channels; // diffusers: out_channels None = in_channels
    if (f.has("qk_norm")) {
        const std::string q = f.get_string("qk_norm", "");
        if (q != "rms_norm")
            f.fail("qk_norm", "must be null or \"rms_norm\" (the SD 3.5 models' choice)", j.at("qk_norm"));
        c.qk_norm = QkNorm::RmsNorm;
    }
    static const std::set<std::string> known = {"sample_size",
                                                "patch_size",
                                                "in_channels",
                                                "out_channels",
                                                "num_layers",
                                                "attention_head_dim",
                                                "num_attention_heads",
                                                "joint_attention_dim",
                                                "caption_projection_dim",
                                                "pooled_projection_dim",
                                                "pos_embed_max_size",
                                                "dual_attention_layers",
                                                "qk_norm"};
    for (const auto& [k, v] : j.items()) {
        if (k.rfind('_', 0) == 0 || known.count(k)) continue;
        const bool inert = v.is_null() || (v.is_boolean() && !v.get<bool>()) || (v.is_array() && v.empty());
        if (!inert) f.fail(k, "is a key this engine does not implement (SD3Transformer2DModel of diffusers 0.31)", v);
    }
    for (const auto& [k, v] :
         std::vector<std::pair<const char*, int>>{{"patch_size", c.patch_size},
                                                  {"in_channels", c.in_channels},
                                                  {"out_channels", c.out_channels},
                                                  {"num_layers", c.num_layers},
                                                  {"attention_head_dim", c.attention_head_dim},
                                                  {"num_attention_heads", c.num_attention_heads},
                                                  {"joint_attention_dim", c.joint_attention_dim},
                                                  {"pooled_projection_dim", c.pooled_projection_dim},
                                                  {"pos_embed_max_size", c.pos_embed_max_size}})
        if (v <= 0) f.fail(k, "must be a positive integer", nlohmann::json(v));
    // The joint blocks run the text stream at the model width: diffusers builds them with dim = heads * head_dim and
    // feeds them context_embedder's output, so any other width fails there.
    if (c.caption_projection_dim != c.inner_dim())
        f.fail("caption_projection_dim",
               "must equal num_attention_heads * attention_head_dim = " + std::to_string(c.inner_dim()),
               nlohmann::json(c.caption_projection_dim));
    for (int b : c.dual_attention_layers)
        if (b < 0 || b >= c.num_layers)
            f.fail("dual_attention_layers", "must list blocks in [0, " + std::to_string(c.num_layers) + ")",
                   j.at("dual_attention_layers"));
    return c;
}

SD3TransformerConfig SD3TransformerConfig::from_json_file(const std::string& path) {
    return from_json(JsonConfig::load(path, "SD3 transformer config").json(), path);
}

nlohmann::json SD3TransformerConfig::to_json() const {
    SD3TransformerConfig c = *this;
    nlohmann::json j = json_of(mmdit_json_fields(c));
    j["_class_name"] = "SD3Transformer2DModel";
    j["qk_norm"] = qk_norm == QkNorm::RmsNorm ? nlohmann::json("rms_norm") : nlohmann::json(nullptr);
    return j;
}

SD3TransformerConfig SD3TransformerConfig::detect_from_weights(const WeightMap& w) {
    for (const char* n : {"pos_embed.proj.weight", "context_embedder.weight", "proj_out.weight",
                          "time_text_embed.text_embedder.linear_1.weight", "pos_embed.pos_embed"})
        if (!w.has(n)) throw Error(std::string("SD3 transformer weights lack ") + n);
    SD3TransformerConfig c;
    const auto pe = w.shape("pos_embed.proj.weight"); // [D, C, p, p]
    const int dim = int(pe[0]);
    c.in_channels = int(pe[1]);
    c.patch_size = int(pe[2]);
    c.joint_attention_dim = int(w.shape("context_embedder.weight")[1]);
    c.caption_projection_dim = dim;
    c.pooled_projection_dim = int(w.shape("time_text_embed.text_embedder.linear_1.weight")[1]);
    c.out_channels = int(w.shape("proj_out.weight")[0]) / (c.patch_size * c.patch_size);
    c.pos_embed_max_size = int(std::lround(std::sqrt(double(w.shape("pos_embed.pos_embed")[1]))));
    c.num_layers = 0;
    while (w.has("transformer_blocks." + std::to_string(c.num_layers) + ".attn.to_q.weight")) ++c.num_layers;
    if (c.num_layers == 0) throw Error("SD3 transformer weights have no transformer_blocks.0.attn.to_q.weight");
    // Head width: the per-head RMSNorm shows it; without one, SD 3's 64.
    const std::string nq = "transformer_blocks.0.attn.norm_q.weight";
    c.attention_head_dim = w.has(nq) ? int(w.shape(nq)[0]) : 64;
    if (dim % c.attention_head_dim != 0)
        throw Error("SD3 transformer weights: the head width is not visible in the shapes (no qk norm) and the width " +
                    std::to_string(dim) + " is not a multiple of SD 3's 64; give a config.json");
    c.qk_norm = w.has(nq) ? QkNorm::RmsNorm : QkNorm::None;
    c.num_attention_heads = dim / c.attention_head_dim;
    for (int b = 0; b < c.num_layers; ++b)
        if (w.has("transformer_blocks." + std::to_string(b) + ".attn2.to_q.weight"))
            c.dual_attention_layers.push_back(b);
    return c;
}

// ---- position embedding -----------------------------------------------------------------------------------------

Tensor sincos_pos_embed_2d(int64_t dim, int64_t grid, int64_t base_size) {
    if (dim % 4 != 0) throw Error("sincos_pos_embed_2d: dim must be a multiple of 4, got " + std::to_string(dim));
    // Positions in float32 as numpy computes them (arange / (grid / base_size)), the rest in float64.
    const float step = float(double(grid) / double(base_size));
    const int64_t quarter = dim / 4;
    auto out = torch::empty({grid * grid, dim}, torch::kDouble);
    auto a = out.accessor<double, 2>();
    for (int64_t r = 0; r < grid; ++r)
        for (int64_t col = 0; col < grid; ++col) {
            const int64_t tok = r * grid + col;
            const double pos[2] = {double(float(col) / step), double(float(r) / step)}; // column half first
            for (int half = 0; half < 2; ++half)
                for (int64_t k = 0; k < quarter; ++k) {
                    const double omega = 1.0 / std::pow(10000.0, double(k) / double(quarter));
                    const double v = pos[half] * omega;
                    a[tok][half * 2 * quarter + k] = std::sin(v);
                    a[tok][half * 2 * quarter + quarter + k] = std::cos(v);
                }
        }
    return out.to(torch::kFloat);
}

// ---- modules ----------------------------------------------------------------------------------------------------

RmsNormImpl::RmsNormImpl(int64_t dim, double eps_) : eps(eps_) {
    weight = register_parameter("weight", torch::ones({dim}));
}

Tensor RmsNormImpl::forward(const Tensor& x) {
    const auto var = x.to(torch::kFloat).pow(2).mean(-1, true);
    return (x * torch::rsqrt(var + eps)).to(weight.scalar_type()) * weight;
}

JointAttentionImpl::JointAttentionImpl(int64_t dim, int64_t heads_, int64_t head_dim_, bool joint,
                                       bool context_pre_only, QkNorm qk_norm)
    : heads(heads_), head_dim(head_dim_) {
    const int64_t inner = heads * head_dim;
    to_q = register_module("to_q", mmdit_linear(dim, inner));
    to_k = register_module("to_k", mmdit_linear(dim, inner));
    to_v = register_module("to_v", mmdit_linear(dim, inner));
    out_linear = mmdit_linear(inner, dim);
    to_out->push_back(out_linear);
    register_module("to_out", to_out);
    if (joint) {
        add_q_proj = register_module("add_q_proj", mmdit_linear(dim, inner));
        add_k_proj = register_module("add_k_proj", mmdit_linear(dim, inner));
        add_v_proj = register_module("add_v_proj", mmdit_linear(dim, inner));
        if (!context_pre_only) to_add_out = register_module("to_add_out", mmdit_linear(inner, dim));
    }
    if (qk_norm == QkNorm::RmsNorm) {
        norm_q = register_module("norm_q", RmsNorm(head_dim, 1e-6));
        norm_k = register_module("norm_k", RmsNorm(head_dim, 1e-6));
        if (joint) {
            norm_added_q = register_module("norm_added_q", RmsNorm(head_dim, 1e-6));
            norm_added_k = register_module("norm_added_k", RmsNorm(head_dim, 1e-6));
        }
    }
}

std::pair<Tensor, Tensor> JointAttentionImpl::forward(const Tensor& x, const Tensor& context) {
    // Heads split as [B, H, N, D] (the per-head RMSNorm acts on D); the image tokens come first in the joint sequence.
    auto q = mmdit_split_heads(to_q(x), heads, head_dim), k = mmdit_split_heads(to_k(x), heads, head_dim),
         v = mmdit_split_heads(to_v(x), heads, head_dim);
    if (norm_q) q = norm_q(q), k = norm_k(k);
    const bool joint = context.defined() && add_q_proj;
    if (joint) {
        auto cq = mmdit_split_heads(add_q_proj(context), heads, head_dim),
             ck = mmdit_split_heads(add_k_proj(context), heads, head_dim),
             cv = mmdit_split_heads(add_v_proj(context), heads, head_dim);
        if (norm_added_q) cq = norm_added_q(cq), ck = norm_added_k(ck);
        q = torch::cat({q, cq}, 2), k = torch::cat({k, ck}, 2), v = torch::cat({v, cv}, 2);
    }
    kernels::AttentionOptions o;
    o.layout = kernels::AttentionLayout::Heads;
    o.formula = kernels::ScoreFormula::ScaleAfter; // softmax(q k^T / sqrt(d)) v, as the reference computed it
    o.kernel = kernel;
    auto h = kernels::attention(q.contiguous(), k.contiguous(), v.contiguous(), o);
    h = h.transpose(1, 2).reshape({x.size(0), -1, heads * head_dim});
    const int64_t n = x.size(1);
    Tensor ctx_out;
    if (joint && to_add_out) ctx_out = to_add_out(h.narrow(1, n, h.size(1) - n));
    return {out_linear(joint ? h.narrow(1, 0, n) : h), ctx_out};
}

GeluFeedForwardImpl::GeluFeedForwardImpl(int64_t dim) {
    auto gelu = std::make_shared<torch::nn::Module>("GELU");
    proj = gelu->register_module("proj", mmdit_linear(dim, 4 * dim));
    net->push_back(gelu);
    net->push_back(torch::nn::Dropout(0.0)); // net.1: diffusers' dropout, no weights
    out = mmdit_linear(4 * dim, dim);
    net->push_back(out);
    register_module("net", net);
}

Tensor GeluFeedForwardImpl::forward(const Tensor& x) {
    return out(torch::gelu(proj(x), "tanh"));
}

AdaLinearImpl::AdaLinearImpl(int64_t dim, int64_t chunks_) : chunks(chunks_) {
    linear = register_module("linear", mmdit_linear(dim, chunks * dim));
}

std::vector<Tensor> AdaLinearImpl::forward(const Tensor& c) {
    return linear(torch::silu(c)).chunk(chunks, 1);
}

JointTransformerBlockImpl::JointTransformerBlockImpl(int64_t dim_, int64_t heads, int64_t head_dim,
                                                     bool context_pre_only_, QkNorm qk_norm, bool dual_attention_)
    : context_pre_only(context_pre_only_), dual_attention(dual_attention_), dim(dim_) {
    norm1 = register_module("norm1", AdaLinear(dim, dual_attention ? 9 : 6));
    // The last block's text stream only feeds its attention: adaLN with scale and shift (AdaLayerNormContinuous).
    norm1_context = register_module("norm1_context", AdaLinear(dim, context_pre_only ? 2 : 6));
    attn = register_module("attn", JointAttention(dim, heads, head_dim, true, context_pre_only, qk_norm));
    if (dual_attention) attn2 = register_module("attn2", JointAttention(dim, heads, head_dim, false, false, qk_norm));
    ff = register_module("ff", GeluFeedForward(dim));
    if (!context_pre_only) ff_context = register_module("ff_context", GeluFeedForward(dim));
}

std::pair<Tensor, Tensor> JointTransformerBlockImpl::forward(const Tensor& x, const Tensor& context,
                                                             const Tensor& temb) {
    // adaLN-Zero (Peebles & Xie 2023, sec. 3.2): shift, scale, gate of the attention, then of the MLP; MMDiT-X adds
    // shift, scale, gate of the second attention, which normalises the same LayerNorm output.
    const auto m = norm1(temb);
    auto u = [](const Tensor& t) { return t.unsqueeze(1); };
    const auto nx = mmdit_layer_norm(x);
    const auto hx = nx * (1 + u(m[1])) + u(m[0]);
    const auto mc = norm1_context(temb);
    Tensor hc;
    if (context_pre_only)
        hc = mmdit_layer_norm(context) * (1 + u(mc[0])) + u(mc[1]); // AdaLayerNormContinuous: scale first, then shift
    else
        hc = mmdit_layer_norm(context) * (1 + u(mc[1])) + u(mc[0]);
    auto [a, ca] = attn(hx, hc);
    auto h = x + u(m[2]) * a;
    if (dual_attention) {
        const auto hx2 = nx * (1 + u(m[7])) + u(m[6]);
        h = h + u(m[8]) * attn2(hx2).first;
    }
    h = h + u(m[5]) * ff(mmdit_layer_norm(h) * (1 + u(m[4])) + u(m[3]));
    if (context_pre_only) return {h, Tensor()};
    auto c = context + u(mc[2]) * ca;
    c = c + u(mc[5]) * ff_context(mmdit_layer_norm(c) * (1 + u(mc[4])) + u(mc[3]));
    return {h, c};
}

SD3Transformer2DModelImpl::SD3Transformer2DModelImpl(const SD3TransformerConfig& c) : cfg_(c) {
    const int64_t dim = c.inner_dim();
    pos_embed_module = register_module("pos_embed", std::make_shared<torch::nn::Module>("PatchEmbed"));
    patch_proj = pos_embed_module->register_module(
        "proj", torch::nn::Conv2d(torch::nn::Conv2dOptions(c.in_channels, dim, c.patch_size).stride(c.patch_size)));
    pos_embed = pos_embed_module->register_buffer(
        "pos_embed", sincos_pos_embed_2d(dim, c.pos_embed_max_size, c.sample_size / c.patch_size).unsqueeze(0));
    time_text_embed = register_module("time_text_embed", std::make_shared<torch::nn::Module>("TimeTextEmbed"));
    timestep_embedder = time_text_embed->register_module("timestep_embedder", std::make_shared<torch::nn::Module>());
    text_embedder = time_text_embed->register_module("text_embedder", std::make_shared<torch::nn::Module>());
    t_linear_1 = timestep_embedder->register_module("linear_1", mmdit_linear(256, dim));
    t_linear_2 = timestep_embedder->register_module("linear_2", mmdit_linear(dim, dim));
    p_linear_1 = text_embedder->register_module("linear_1", mmdit_linear(c.pooled_projection_dim, dim));
    p_linear_2 = text_embedder->register_module("linear_2", mmdit_linear(dim, dim));
    context_embedder =
        register_module("context_embedder", mmdit_linear(c.joint_attention_dim, c.caption_projection_dim));
    for (int i = 0; i < c.num_layers; ++i) {
        blocks.push_back(JointTransformerBlock(dim, c.num_attention_heads, c.attention_head_dim, i == c.num_layers - 1,
                                               c.qk_norm, c.dual_attention(i)));
        transformer_blocks->push_back(blocks.back());
    }
    register_module("transformer_blocks", transformer_blocks);
    norm_out = register_module("norm_out", AdaLinear(dim, 2));
    proj_out = register_module("proj_out", mmdit_linear(dim, c.patch_size * c.patch_size * c.out_channels));
}

Tensor SD3Transformer2DModelImpl::forward(const Tensor& x, const Tensor& context, const Tensor& pooled,
                                          const Tensor& timestep, FeatureMap* f, const std::vector<int>& skip_layers) {
    for (int s : skip_layers)
        if (s < 0 || s >= int(blocks.size()))
            throw ParamError("skip_layers", "block " + std::to_string(s) + " is outside [0, " +
                                                std::to_string(blocks.size()) + ") of this transformer");
    c10::InferenceMode guard(!is_training());
    SD3Tokens tok = embed(x, context, pooled, timestep);
    run_blocks(tok, int(blocks.size()), f, skip_layers);
    return head(tok);
}

SD3Tokens SD3Transformer2DModelImpl::embed(const Tensor& x, const Tensor& context, const Tensor& pooled,
                                           const Tensor& timestep) {
    c10::InferenceMode guard(!is_training());
    const int64_t p = cfg_.patch_size, B = x.size(0);
    if (x.dim() != 4 || x.size(1) != cfg_.in_channels)
        throw Error("SD3 transformer: latents must be [B, " + std::to_string(cfg_.in_channels) + ", H, W], got " +
                    shape_str(x.sizes().vec()));
    if (x.size(2) % p || x.size(3) % p)
        throw Error("SD3 transformer: latent size " + std::to_string(x.size(2)) + "x" + std::to_string(x.size(3)) +
                    " is not a multiple of the patch size " + std::to_string(p));
    const int64_t h = x.size(2) / p, w = x.size(3) / p, M = cfg_.pos_embed_max_size;
    if (h > M || w > M)
        throw Error("SD3 transformer: a " + std::to_string(h) + "x" + std::to_string(w) +
                    " patch grid exceeds pos_embed_max_size " + std::to_string(M));
    if (context.dim() != 3 || context.size(0) != B || context.size(2) != cfg_.joint_attention_dim)
        throw Error("SD3 transformer: context must be [" + std::to_string(B) + ", T, " +
                    std::to_string(cfg_.joint_attention_dim) + "], got " + shape_str(context.sizes().vec()));
    if (pooled.dim() != 2 || pooled.size(0) != B || pooled.size(1) != cfg_.pooled_projection_dim)
        throw Error("SD3 transformer: pooled projections must be [" + std::to_string(B) + ", " +
                    std::to_string(cfg_.pooled_projection_dim) + "], got " + shape_str(pooled.sizes().vec()));
    SD3Tokens tok;
    tok.batch = B, tok.grid_h = h, tok.grid_w = w;
    // Patch embedding plus the position grid cropped around its centre (diffusers' PatchEmbed.cropped_pos_embed).
    auto hs = patch_proj(x).flatten(2).transpose(1, 2);
    const int64_t top = (M - h) / 2, left = (M - w) / 2;
    const auto pe = pos_embed.view({1, M, M, -1}).narrow(1, top, h).narrow(2, left, w).reshape({1, h * w, -1});
    tok.hs = hs + pe.to(hs.scalar_type());
    // Conditioning: sinusoidal timestep embedding (256 channels, cos first) and the pooled text, each through an MLP.
    auto t = timestep.to(torch::kFloat).reshape({-1});
    if (t.numel() == 1) t = t.expand({B});
    if (t.numel() != B)
        throw Error("SD3 transformer: " + std::to_string(t.numel()) + " timesteps for a batch of " + std::to_string(B));
    const auto tproj = timestep_embedding(t.to(x.device()), 256, true, 0.0).to(pooled.scalar_type());
    tok.temb = t_linear_2(torch::silu(t_linear_1(tproj))) + p_linear_2(torch::silu(p_linear_1(pooled)));
    tok.ctx = context_embedder(context);
    return tok;
}

void SD3Transformer2DModelImpl::run_blocks(SD3Tokens& tok, int end, FeatureMap* f,
                                           const std::vector<int>& skip_layers) {
    c10::InferenceMode guard(!is_training());
    end = std::min(end, int(blocks.size()));
    for (int i = tok.done; i < end; ++i) {
        if (std::find(skip_layers.begin(), skip_layers.end(), i) != skip_layers.end()) continue;
        auto [nh, nc] = blocks[size_t(i)]->forward(tok.hs, tok.ctx, tok.temb);
        tok.hs = nh, tok.ctx = nc;
        if (f) {
            const std::string name = "transformer_blocks." + std::to_string(i);
            (*f)[name + ".hidden_states"] = tok.hs;
            if (tok.ctx.defined()) (*f)[name + ".encoder_hidden_states"] = tok.ctx;
        }
    }
    tok.done = std::max(tok.done, end);
}

Tensor SD3Transformer2DModelImpl::head(const SD3Tokens& tok) {
    c10::InferenceMode guard(!is_training());
    const auto so = norm_out(tok.temb); // scale, shift
    auto hs = mmdit_layer_norm(tok.hs) * (1 + so[0].unsqueeze(1)) + so[1].unsqueeze(1);
    hs = proj_out(hs);
    // Unpatchify: [B, h*w, p*p*C] -> [B, h, w, p, p, C] -> [B, C, h, p, w, p] -> [B, C, h*p, w*p].
    const int64_t C = cfg_.out_channels, p = cfg_.patch_size, B = tok.batch, h = tok.grid_h, w = tok.grid_w;
    return hs.reshape({B, h, w, p, p, C}).permute({0, 5, 1, 3, 2, 4}).reshape({B, C, h * p, w * p});
}

Tensor SD3Transformer2DModelImpl::first_block_modulated_input(const SD3Tokens& tok) {
    c10::InferenceMode guard(!is_training());
    if (blocks.empty()) throw Error("SD3 transformer: no blocks");
    const auto m = blocks[0]->norm1(tok.temb); // shift, scale, gate, ...
    return mmdit_layer_norm(tok.hs) * (1 + m[1].unsqueeze(1)) + m[0].unsqueeze(1);
}

void SD3Transformer2DModelImpl::load(const WeightMap& w) {
    w.load_into(*this);
}

void SD3Transformer2DModelImpl::set_attention_kernel(kernels::AttentionKernel k) {
    for (const auto& m : modules(false))
        if (auto* a = dynamic_cast<JointAttentionImpl*>(m.get())) a->kernel = k;
}

WeightMap sd3_transformer_weights_from_single_file(const WeightMap& file, const std::string& prefix) {
    WeightMap out;
    out.keep_files_of(file);
    std::set<std::string> used;
    auto has = [&](const std::string& n) { return file.has(prefix + n); };
    auto take = [&](const std::string& n) {
        used.insert(prefix + n);
        return file.get(prefix + n);
    };
    auto put = [&](const std::string& name, const torch::Tensor& t, const std::string& from) {
        out.insert(name, t, file.source(prefix + from));
    };
    // weight and bias (or only the tensor when `suffixes` is false) of one layer
    auto same = [&](const std::string& from, const std::string& to) {
        for (const char* sfx : {".weight", ".bias"})
            if (has(from + sfx)) put(to + sfx, take(from + sfx), from + sfx);
    };
    // (shift, scale) rows -> (scale, shift): AdaLayerNormContinuous reads the scale first.
    auto swapped = [&](const std::string& from, const std::string& to) {
        for (const char* sfx : {".weight", ".bias"}) {
            const auto halves = take(from + sfx).chunk(2, 0);
            put(to + sfx, torch::cat({halves[1], halves[0]}, 0), from + sfx);
        }
    };
    auto qkv = [&](const std::string& from, const std::string& to, const char* q, const char* k, const char* v) {
        for (const char* sfx : {".weight", ".bias"}) {
            const auto parts = take(from + ".qkv" + sfx).chunk(3, 0);
            put(to + q + sfx, parts[0], from + ".qkv" + sfx);
            put(to + k + sfx, parts[1], from + ".qkv" + sfx);
            put(to + v + sfx, parts[2], from + ".qkv" + sfx);
        }
    };
    if (!has("pos_embed") || !has("x_embedder.proj.weight"))
        throw Error("not an SD 3 checkpoint: no " + prefix + "pos_embed / " + prefix + "x_embedder.proj.weight");
    put("pos_embed.pos_embed", take("pos_embed"), "pos_embed");
    same("x_embedder.proj", "pos_embed.proj");
    same("t_embedder.mlp.0", "time_text_embed.timestep_embedder.linear_1");
    same("t_embedder.mlp.2", "time_text_embed.timestep_embedder.linear_2");
    same("y_embedder.mlp.0", "time_text_embed.text_embedder.linear_1");
    same("y_embedder.mlp.2", "time_text_embed.text_embedder.linear_2");
    same("context_embedder", "context_embedder");
    same("final_layer.linear", "proj_out");
    swapped("final_layer.adaLN_modulation.1", "norm_out.linear");
    int layers = 0;
    while (has("joint_blocks." + std::to_string(layers) + ".x_block.attn.qkv.weight")) ++layers;
    for (int i = 0; i < layers; ++i) {
        const std::string o = "joint_blocks." + std::to_string(i) + ".",
                          d = "transformer_blocks." + std::to_string(i) + ".";
        const std::string x = o + "x_block.", c = o + "context_block.";
        qkv(x + "attn", d + "attn.", "to_q", "to_k", "to_v");
        qkv(c + "attn", d + "attn.", "add_q_proj", "add_k_proj", "add_v_proj");
        same(x + "attn.ln_q", d + "attn.norm_q");
        same(x + "attn.ln_k", d + "attn.norm_k");
        same(c + "attn.ln_q", d + "attn.norm_added_q");
        same(c + "attn.ln_k", d + "attn.norm_added_k");
        same(x + "attn.proj", d + "attn.to_out.0");
        same(c + "attn.proj", d + "attn.to_add_out");
        if (has(x + "attn2.qkv.weight")) {
            qkv(x + "attn2", d + "attn2.", "to_q", "to_k", "to_v");
            same(x + "attn2.ln_q", d + "attn2.norm_q");
            same(x + "attn2.ln_k", d + "attn2.norm_k");
            same(x + "attn2.proj", d + "attn2.to_out.0");
        }
        same(x + "adaLN_modulation.1", d + "norm1.linear");
        if (i == layers - 1)
            swapped(c + "adaLN_modulation.1", d + "norm1_context.linear");
        else
            same(c + "adaLN_modulation.1", d + "norm1_context.linear");
        same(x + "mlp.fc1", d + "ff.net.0.proj");
        same(x + "mlp.fc2", d + "ff.net.2");
        same(c + "mlp.fc1", d + "ff_context.net.0.proj");
        same(c + "mlp.fc2", d + "ff_context.net.2");
    }
    std::string unknown;
    for (const auto& [n, t] : file.all())
        if (n.rfind(prefix, 0) == 0 && !used.count(n)) unknown += (unknown.empty() ? "" : ", ") + n;
    if (!unknown.empty()) throw Error("SD 3 checkpoint: tensors no conversion rule takes: " + unknown);
    return out;
}

SD3Transformer2DModel load_sd3_transformer_folder(const std::string& dir, torch::ScalarType dtype) {
    const ModelSource src = resolve_model(dir, {nullptr, "SD3 transformer"});
    if (src.config_file.empty()) throw Error("SD3 transformer folder '" + dir + "' has no config.json");
    const std::string cls = src.config.value("_class_name", std::string());
    if (cls != "SD3Transformer2DModel")
        throw Error("'" + src.config_file + "': _class_name is '" + cls + "', expected SD3Transformer2DModel");
    SD3Transformer2DModel m(SD3TransformerConfig::from_json_file(src.config_file));
    m->load(src.load_weights());
    m->eval();
    if (dtype != torch::kFloat) m->to(dtype);
    return m;
}

} // namespace anchor::unet
