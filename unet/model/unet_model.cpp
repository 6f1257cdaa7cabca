// UNet2DConditionModel forward with diffusers 0.27 semantics (see tests/golden/sd/unet_sd15_tiny/README.md).
#include "unet/model/unet_model.h"

#include "cache/io/deferred_weights.h"

#include "cache/io/error.h"
#include "cache/io/json_config.h"
#include "cache/io/weight_map.h"
#include "cache/util/heap.h"
#include "kernels/attention.h"
#include "kernels/geglu.h"
#include "kernels/linear.h"
#include "unet/model/sd_family.h"
#include "unet/model/unet_perf.h"

#include <nlohmann/json.hpp>

#include <climits>
#include <cmath>
#include <fstream>
#include <sstream>

namespace anchor::unet {

namespace F = torch::nn::functional;
using torch::Tensor;

namespace {

torch::nn::Conv2d conv(int64_t in, int64_t out, int64_t k, int64_t stride = 1, int64_t pad = -1) {
    if (pad < 0) pad = k / 2;
    return make_conv2d(torch::nn::Conv2dOptions(in, out, k).stride(stride).padding(pad));
}

torch::nn::GroupNorm group_norm(int64_t groups, int64_t ch, double eps) {
    if (groups <= 0 || ch % groups != 0)
        throw Error("GroupNorm: " + std::to_string(ch) + " channels are not divisible into " + std::to_string(groups) +
                    " groups");
    return torch::nn::GroupNorm(torch::nn::GroupNormOptions(groups, ch).eps(eps));
}

torch::nn::LayerNorm layer_norm(int64_t dim, double eps = 1e-5) {
    return torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim}).eps(eps));
}

} // namespace

kernels::AttentionKernel default_attention_kernel(const UNetConfig& c) {
    int narrowest =
        c.block_out_channels.empty() ? 0 : *std::min_element(c.block_out_channels.begin(), c.block_out_channels.end());
    return c.norm_num_groups > 0 && narrowest / c.norm_num_groups >= 8 ? kernels::AttentionKernel::Fused
                                                                       : kernels::AttentionKernel::Exact;
}

kernels::GemmBackend default_gemm_backend(kernels::AttentionKernel a) {
    return a == kernels::AttentionKernel::Exact || a == kernels::AttentionKernel::Reference ||
                   !kernels::onednn_available()
               ? kernels::GemmBackend::Torch
               : kernels::GemmBackend::Winograd;
}

// ---- attention core ------------------------------------------------------------------------------------------------

Tensor multi_head_attention(const Tensor& q, const Tensor& k, const Tensor& v, int64_t heads,
                            kernels::AttentionKernel kernel, bool fast, bool bf16_products) {
    kernels::AttentionOptions o;
    o.heads = heads;
    o.bf16_products = fast && bf16_products;
    // The plain module forwards (fast paths off) are the reference; the fast paths chunk the queries so the score
    // buffer stays small (unet_perf.h).
    o.kernel = fast ? kernel : kernels::AttentionKernel::Reference;
    o.chunk_bytes = fast ? perf::kAttentionChunkBytes : int64_t(256) << 20;
    return kernels::attention(q, k, v, o);
}

// ---- building blocks
// -------------------------------------------------------------------------------------------------

ResnetBlock2DImpl::ResnetBlock2DImpl(int64_t in, int64_t out, int64_t temb_channels, int64_t groups, double eps) {
    norm1 = register_module("norm1", group_norm(groups, in, eps));
    conv1 = register_module("conv1", conv(in, out, 3));
    if (temb_channels > 0)
        time_emb_proj = register_module("time_emb_proj", make_linear(torch::nn::LinearOptions(temb_channels, out)));
    norm2 = register_module("norm2", group_norm(groups, out, eps));
    conv2 = register_module("conv2", conv(out, out, 3));
    if (in != out) conv_shortcut = register_module("conv_shortcut", conv(in, out, 1, 1, 0));
}

Tensor ResnetBlock2DImpl::forward(Tensor x, const Tensor& temb_act) {
    // A block that owns its input (moved in) and maps it through a shortcut convolution takes the shortcut first and
    // may then normalise x in x's own storage (perf::group_norm_silu): one map of the input's size less at the peak.
    Tensor shortcut;
    if (conv_shortcut && perf::use_onednn(*this) && perf::sole_owner(x))
        shortcut = perf::conv2d(conv_shortcut, x, *this);
    const bool consumed = shortcut.defined();
    auto h = perf::group_norm_silu(norm1, consumed ? std::move(x) : x, *this);
    h = perf::conv2d(conv1, h, *this);
    if (time_emb_proj && temb_act.defined())
        h.add_(perf::linear(time_emb_proj, temb_act, *this).unsqueeze(-1).unsqueeze(-1));
    h = perf::group_norm_silu(norm2, std::move(h), *this);
    h = perf::conv2d(conv2, h, *this);
    // diffusers: (shortcut(x) + h) / output_scale_factor, the factor is 1 for SD.
    if (!consumed) shortcut = conv_shortcut ? perf::conv2d(conv_shortcut, x, *this) : x;
    return perf::reference_add(shortcut, h, h, fast);
}

Downsample2DImpl::Downsample2DImpl(int64_t channels, int64_t padding_) : padding(padding_) {
    conv = register_module("conv", unet::conv(channels, channels, 3, 2, padding));
}

Tensor Downsample2DImpl::forward(const Tensor& x) {
    if (padding == 0) return perf::conv2d(conv, F::pad(x, F::PadFuncOptions({0, 1, 0, 1})), *this);
    return perf::conv2d(conv, x, *this);
}

Upsample2DImpl::Upsample2DImpl(int64_t channels) {
    conv = register_module("conv", unet::conv(channels, channels, 3));
}

Tensor Upsample2DImpl::forward(const Tensor& x, c10::optional<std::vector<int64_t>> size) {
    // On oneDNN the doubling and the 3x3 convolution are one convolution of x (kernels/onednn.h, resize-convolution).
    const bool doubled = !size || (x.dim() == 4 && (*size) == std::vector<int64_t>{2 * x.size(2), 2 * x.size(3)});
    if (doubled && perf::use_onednn(*this))
        if (auto y = perf::upsample2x_conv3x3(conv, x, *this); y.defined()) return y;
    auto opts = F::InterpolateFuncOptions().mode(torch::kNearest);
    if (size)
        opts.size(*size);
    else
        opts.scale_factor(std::vector<double>{2.0, 2.0});
    return perf::conv2d(conv, F::interpolate(x, opts), *this);
}

// ---- transformer
// -----------------------------------------------------------------------------------------------------

CrossAttentionImpl::CrossAttentionImpl(int64_t query_dim, int64_t context_dim, int64_t heads_, int64_t head_dim)
    : heads(heads_) {
    const int64_t inner = heads * head_dim;
    to_q = register_module("to_q", make_linear(torch::nn::LinearOptions(query_dim, inner).bias(false)));
    to_k = register_module("to_k", make_linear(torch::nn::LinearOptions(context_dim, inner).bias(false)));
    to_v = register_module("to_v", make_linear(torch::nn::LinearOptions(context_dim, inner).bias(false)));
    to_out = register_module("to_out", torch::nn::ModuleList());
    out_linear = make_linear(torch::nn::LinearOptions(inner, query_dim));
    to_out->push_back(out_linear);
}

Tensor CrossAttentionImpl::forward(const Tensor& x, const Tensor& context) {
    const Tensor& c = context.defined() ? context : x;
    Tensor k, v;
    if (kv_reuse_ && context.defined()) {
        if (kv_ctx_.defined() && kv_ctx_.is_same(context))
            ++kv_hits_;
        else
            kv_ctx_ = context, k_ctx_ = perf::linear(to_k, context, *this), v_ctx_ = perf::linear(to_v, context, *this);
        k = k_ctx_, v = v_ctx_;
    } else if (fused_ && !context.defined()) {
        auto qkv = fused_projection(x);
        return perf::linear(
            out_linear,
            multi_head_attention(qkv[0], qkv[1], qkv[2], heads, kernel, fast, perf::bf16_operands(*this)), *this);
    } else {
        k = perf::linear(to_k, c, *this), v = perf::linear(to_v, c, *this);
    }
    return perf::linear(out_linear,
                        multi_head_attention(perf::linear(to_q, x, *this), k, v, heads, kernel, fast,
                                             perf::bf16_operands(*this)),
                        *this);
}

void CrossAttentionImpl::set_fused_qkv(bool on) {
    fused_ = on && to_q->weight.size(1) == to_k->weight.size(1); // a self-attention layer's shapes
    if (!fused_) qkv_ = nullptr, qkv_src_ = {};
}

namespace {
// In-place changes of a weight (LoRA merges) bump its version; inference tensors have none and are never changed.
uint32_t version(const Tensor& t) {
    return t.is_inference() ? 0 : t._version();
}
} // namespace

std::array<Tensor, 3> CrossAttentionImpl::fused_projection(const Tensor& x) {
    const std::array<const Tensor*, 3> w{&to_q->weight, &to_k->weight, &to_v->weight};
    bool stale = qkv_.is_empty();
    for (size_t i = 0; i < 3; ++i)
        stale = stale || w[i]->data_ptr() != qkv_src_[i] || version(*w[i]) != qkv_version_[i];
    if (stale) {
        c10::InferenceMode off(false); // set_data on a parameter is refused inside inference mode
        torch::NoGradGuard no_grad;
        const int64_t in = w[0]->size(1), out = w[0]->size(0) + w[1]->size(0) + w[2]->size(0);
        qkv_ = make_linear(torch::nn::LinearOptions(in, out).bias(false));
        qkv_->weight.set_data(torch::cat({*w[0], *w[1], *w[2]}, 0)); // the weights' dtype and device
        for (size_t i = 0; i < 3; ++i) qkv_src_[i] = w[i]->data_ptr(), qkv_version_[i] = version(*w[i]);
    }
    auto y = perf::linear(qkv_, x, *this);
    const int64_t nq = w[0]->size(0), nk = w[1]->size(0);
    std::array<Tensor, 3> out{y.narrow(-1, 0, nq), y.narrow(-1, nq, nk), y.narrow(-1, nq + nk, w[2]->size(0))};
    // The CPU kernels read row-major [B, N, C] operands; CUDA's attention reshapes the strided views itself.
    if (!y.is_cuda())
        for (auto& t : out) t = t.contiguous();
    return out;
}

void CrossAttentionImpl::set_context_kv_reuse(bool on) {
    kv_reuse_ = on;
    kv_hits_ = 0;
    kv_ctx_ = k_ctx_ = v_ctx_ = Tensor(); // released at the end of the loop
}

GegluImpl::GegluImpl(int64_t dim_in, int64_t dim_out) {
    proj = register_module("proj", make_linear(torch::nn::LinearOptions(dim_in, dim_out * 2)));
}

Tensor GegluImpl::forward(const Tensor& x) {
    const auto h = perf::linear(proj, x, *this);
    // On the oneDNN backends' fast paths, whose products already differ from LibTorch's in the last bits, the gate
    // in one pass (kernels/geglu.h); elsewhere LibTorch's ops, the reference's bits.
    if (perf::use_onednn(*this) && kernels::geglu_applies(h)) return kernels::geglu(h);
    const auto hg = h.chunk(2, -1);
    return hg[0] * torch::gelu(hg[1]);
}

FeedForwardImpl::FeedForwardImpl(int64_t dim, int64_t mult) {
    net = register_module("net", torch::nn::ModuleList());
    geglu = Geglu(dim, dim * mult);
    out = make_linear(torch::nn::LinearOptions(dim * mult, dim));
    net->push_back(geglu);
    net->push_back(torch::nn::Dropout(0.0));
    net->push_back(out);
}

Tensor FeedForwardImpl::forward(const Tensor& x) {
    return perf::linear(out, geglu->forward(x), *this);
}

BasicTransformerBlockImpl::BasicTransformerBlockImpl(int64_t dim, int64_t heads, int64_t head_dim,
                                                     int64_t context_dim) {
    norm1 = register_module("norm1", layer_norm(dim));
    attn1 = register_module("attn1", CrossAttention(dim, dim, heads, head_dim));
    norm2 = register_module("norm2", layer_norm(dim));
    attn2 = register_module("attn2", CrossAttention(dim, context_dim, heads, head_dim));
    norm3 = register_module("norm3", layer_norm(dim));
    ff = register_module("ff", FeedForward(dim));
}

Tensor BasicTransformerBlockImpl::forward(Tensor x, const Tensor& context) {
    auto a1 = attn1->forward(norm1->forward(x), Tensor());
    x = perf::reference_add(a1, x, a1, fast);
    auto a2 = attn2->forward(norm2->forward(x), context);
    x = perf::reference_add(a2, x, a2, fast);
    auto f = ff->forward(norm3->forward(x));
    return perf::reference_add(f, x, f, fast);
}

Transformer2DModelImpl::Transformer2DModelImpl(int64_t channels, int64_t heads, int64_t depth, int64_t context_dim,
                                               int64_t groups, bool linear)
    : linear_projection(linear) {
    if (heads <= 0 || channels % heads != 0)
        throw Error("transformer: " + std::to_string(channels) + " channels not divisible by " + std::to_string(heads) +
                    " heads");
    const int64_t head_dim = channels / heads, inner = channels;
    norm = register_module("norm", group_norm(groups, channels, 1e-6));
    if (linear)
        proj_in_linear = register_module("proj_in", make_linear(torch::nn::LinearOptions(channels, inner)));
    else
        proj_in_conv = register_module("proj_in", conv(channels, inner, 1, 1, 0));
    transformer_blocks = register_module("transformer_blocks", torch::nn::ModuleList());
    for (int64_t d = 0; d < depth; ++d) {
        blocks.emplace_back(inner, heads, head_dim, context_dim);
        transformer_blocks->push_back(blocks.back());
    }
    if (linear)
        proj_out_linear = register_module("proj_out", make_linear(torch::nn::LinearOptions(inner, channels)));
    else
        proj_out_conv = register_module("proj_out", conv(inner, channels, 1, 1, 0));
}

Tensor Transformer2DModelImpl::forward(const Tensor& x, const Tensor& context, const Tap& tap) {
    static const char* const kBlockNames[] = {"transformer_blocks.0", "transformer_blocks.1", "transformer_blocks.2",
                                              "transformer_blocks.3", "transformer_blocks.4", "transformer_blocks.5",
                                              "transformer_blocks.6", "transformer_blocks.7", "transformer_blocks.8",
                                              "transformer_blocks.9"};
    const int64_t B = x.size(0), H = x.size(2), W = x.size(3);
    auto h = norm->forward(x);
    if (tap) tap("norm", h);
    int64_t inner;
    if (!linear_projection) {
        h = perf::conv2d(proj_in_conv, h, *this);
        if (tap) tap("proj_in", h);
        inner = h.size(1);
        h = h.permute({0, 2, 3, 1}).reshape({B, H * W, inner});
    } else {
        inner = h.size(1);
        h = perf::linear(proj_in_linear, h.permute({0, 2, 3, 1}).reshape({B, H * W, inner}), *this);
        if (tap) tap("proj_in", h);
    }
    for (size_t d = 0; d < blocks.size(); ++d) {
        h = blocks[d]->forward(h, context);
        if (tap && d < std::size(kBlockNames)) tap(kBlockNames[d], h);
    }
    if (!linear_projection) {
        h = h.reshape({B, H, W, inner}).permute({0, 3, 1, 2});
        // On oneDNN in float32 the 1x1 convolution reads the channels-last view as it is (one matrix product);
        // the reference (diffusers) makes it contiguous first.
        if (!perf::use_onednn(*this) || perf::bf16_operands(*this)) h = h.contiguous();
        h = perf::conv2d(proj_out_conv, h, *this);
        if (tap) tap("proj_out", h);
    } else {
        h = perf::linear(proj_out_linear, h, *this);
        if (tap) tap("proj_out", h);
        h = h.reshape({B, H, W, inner}).permute({0, 3, 1, 2}).contiguous();
    }
    return perf::reference_add(h, x, h, fast);
}

// ---- config ------------------------------------------------------------------------------------------------------

namespace {

// The fields from_json reads and to_json writes as they are (the per-block lists and the SDXL fields have rules).
std::vector<JsonField> json_fields(UNetConfig& c) {
    return {ANCHOR_JSON_FIELD(c, sample_size),
            ANCHOR_JSON_FIELD(c, in_channels),
            ANCHOR_JSON_FIELD(c, out_channels),
            ANCHOR_JSON_FIELD(c, norm_num_groups),
            ANCHOR_JSON_FIELD(c, cross_attention_dim),
            ANCHOR_JSON_FIELD(c, down_block_types),
            ANCHOR_JSON_FIELD(c, up_block_types),
            ANCHOR_JSON_FIELD(c, block_out_channels),
            ANCHOR_JSON_FIELD(c, use_linear_projection),
            ANCHOR_JSON_FIELD(c, upcast_attention),
            ANCHOR_JSON_FIELD(c, norm_eps),
            ANCHOR_JSON_FIELD(c, flip_sin_to_cos),
            ANCHOR_JSON_FIELD(c, freq_shift)};
}

// A per-block list as diffusers writes it: one integer when every block has the same value.
nlohmann::json int_or_list(const std::vector<int>& v) {
    if (!v.empty() && std::all_of(v.begin(), v.end(), [&](int x) { return x == v[0]; })) return v[0];
    return v;
}

} // namespace

UNetConfig UNetConfig::from_json(const nlohmann::json& j, const std::string& source) {
    const JsonConfig f(j, source);
    UNetConfig c;
    f.read(json_fields(c));
    const size_t n = c.block_out_channels.size();
    if (c.down_block_types.size() != n || c.up_block_types.size() != n)
        f.fail(std::to_string(n) + " block_out_channels but " + std::to_string(c.down_block_types.size()) + " down / " +
               std::to_string(c.up_block_types.size()) + " up block types");
    c.layers_per_block = f.get_int_or_list("layers_per_block", n, std::vector<int>(n, 2));
    // diffusers: num_attention_heads = num_attention_heads or attention_head_dim (a historical naming mistake).
    c.heads = f.get_int_or_list(f.has("num_attention_heads") ? "num_attention_heads" : "attention_head_dim", n,
                                std::vector<int>(n, 8));
    c.transformer_layers_per_block = f.get_int_or_list("transformer_layers_per_block", n, std::vector<int>(n, 1));
    // A null mid_block_type means no mid block (diffusers).
    if (f.json().contains("mid_block_type") && f.json()["mid_block_type"].is_null()) c.mid_block = false;
    auto require = [&](const std::string& key, const std::string& supported) {
        if (f.has(key) && f.get_string(key, supported) != supported)
            f.fail(key, "other than '" + supported + "' is not supported", f.json().at(key));
    };
    require("mid_block_type", "UNetMidBlock2DCrossAttn");
    require("resnet_time_scale_shift", "default");
    require("time_embedding_type", "positional");
    require("act_fn", "silu");
    for (const auto& t : c.down_block_types)
        if (t != "CrossAttnDownBlock2D" && t != "DownBlock2D") f.fail("down block '" + t + "' is not supported");
    for (const auto& t : c.up_block_types)
        if (t != "CrossAttnUpBlock2D" && t != "UpBlock2D") f.fail("up block '" + t + "' is not supported");
    f.reject("class_embed_type", "class-conditioned UNets");
    if (f.has("addition_embed_type")) {
        if (f.get_string("addition_embed_type", "text_time") != "text_time")
            f.fail("addition_embed_type", "other than 'text_time' (SDXL) is not supported",
                   f.json().at("addition_embed_type"));
        c.addition_time_embed_dim = f.get_int("addition_time_embed_dim", 256);
        c.projection_class_embeddings_input_dim = f.get_int("projection_class_embeddings_input_dim", 0);
        if (c.addition_time_embed_dim <= 0 || c.projection_class_embeddings_input_dim <= 0)
            f.fail("addition_embed_type 'text_time' needs positive addition_time_embed_dim and "
                   "projection_class_embeddings_input_dim");
    }
    if (f.has("time_cond_proj_dim")) {
        c.time_cond_proj_dim = f.get_int("time_cond_proj_dim", 0);
        if (c.time_cond_proj_dim < 1) f.fail("time_cond_proj_dim", "must be >= 1", f.json().at("time_cond_proj_dim"));
    }
    f.reject("encoder_hid_dim", "projected encoder states");
    f.reject("dual_cross_attention", "dual cross attention");
    f.reject("only_cross_attention", "cross-attention-only blocks");
    for (const char* k : {"conv_in_kernel", "conv_out_kernel"})
        if (f.get_int(k, 3) != 3) f.fail(k, "must be 3", f.json().at(k));
    return c;
}

nlohmann::json UNetConfig::to_json() const {
    UNetConfig c = *this;
    nlohmann::json j = json_of(json_fields(c));
    if (!upcast_attention) j.erase("upcast_attention"); // diffusers' default
    j["_class_name"] = "UNet2DConditionModel";
    j["act_fn"] = "silu";
    j["layers_per_block"] = int_or_list(layers_per_block);
    j["attention_head_dim"] = heads; // diffusers' SD 1.x naming: the head count
    if (std::any_of(transformer_layers_per_block.begin(), transformer_layers_per_block.end(),
                    [](int n) { return n != 1; }))
        j["transformer_layers_per_block"] = int_or_list(transformer_layers_per_block);
    j["mid_block_type"] = mid_block ? nlohmann::json("UNetMidBlock2DCrossAttn") : nlohmann::json(nullptr);
    if (text_time()) {
        j["addition_embed_type"] = "text_time";
        j["addition_time_embed_dim"] = addition_time_embed_dim;
        j["projection_class_embeddings_input_dim"] = projection_class_embeddings_input_dim;
    }
    return j;
}

UNetConfig UNetConfig::from_json_file(const std::string& path) {
    return from_json(JsonConfig::load(path, "UNet config").json(), path);
}

UNetConfig UNetConfig::blank(int in_channels, int out_channels) {
    UNetConfig c;
    c.in_channels = in_channels;
    c.out_channels = out_channels;
    c.block_out_channels.clear();
    c.down_block_types.clear();
    c.up_block_types.clear();
    c.layers_per_block.clear();
    c.transformer_layers_per_block.clear();
    return c;
}

UNetConfig UNetConfig::detect_from_weights(const WeightMap& w) {
    UNetConfig c;
    if (!w.has("conv_in.weight") || !w.has("conv_out.weight"))
        throw Error("UNet weights lack conv_in.weight / conv_out.weight");
    c = UNetConfig::blank(int(w.shape("conv_in.weight")[1]), int(w.shape("conv_out.weight")[0]));
    int cross = -1;
    bool linear = false;
    for (int i = 0;; ++i) {
        const std::string p = "down_blocks." + std::to_string(i) + ".";
        if (!w.has(p + "resnets.0.conv1.weight")) break;
        c.block_out_channels.push_back(int(w.shape(p + "resnets.0.conv1.weight")[0]));
        int layers = 0;
        while (w.has(p + "resnets." + std::to_string(layers) + ".conv1.weight")) ++layers;
        c.layers_per_block.push_back(layers);
        const bool attn = w.has(p + "attentions.0.norm.weight");
        c.down_block_types.push_back(attn ? "CrossAttnDownBlock2D" : "DownBlock2D");
        int depth = 1;
        if (attn) {
            depth = 0;
            while (w.has(p + "attentions.0.transformer_blocks." + std::to_string(depth) + ".norm1.weight")) ++depth;
            cross = int(w.shape(p + "attentions.0.transformer_blocks.0.attn2.to_k.weight")[1]);
            linear = w.shape(p + "attentions.0.proj_in.weight").size() == 2;
        }
        c.transformer_layers_per_block.push_back(depth);
    }
    const size_t n = c.block_out_channels.size();
    if (n == 0) throw Error("UNet weights have no down_blocks.0.resnets.0 tensors");
    for (size_t i = 0; i < n; ++i)
        c.up_block_types.push_back(
            w.has("up_blocks." + std::to_string(i) + ".attentions.0.norm.weight") ? "CrossAttnUpBlock2D" : "UpBlock2D");
    c.finish_detection(w, "mid_block.attentions.0.transformer_blocks.0.attn2.to_k.weight",
                       "mid_block.resnets.0.conv1.weight", cross, linear);
    return c;
}

void UNetConfig::finish_detection(const WeightMap& w, const std::string& mid_attn2_to_k, const std::string& mid_resnet,
                                  int cross, bool linear) {
    if (cross < 0 && w.has(mid_attn2_to_k)) cross = int(w.shape(mid_attn2_to_k)[1]);
    if (cross > 0) cross_attention_dim = cross;
    use_linear_projection = linear;
    mid_block = w.has(mid_resnet);
    heads = default_unet_heads(block_out_channels, linear || cross == 1024);
}

std::string UNetConfig::describe() const {
    std::ostringstream os;
    os << "UNet blocks [";
    for (size_t i = 0; i < block_out_channels.size(); ++i)
        os << (i ? ", " : "") << block_out_channels[i] << (down_block_types[i][0] == 'C' ? "+attn" : "");
    os << "], heads [";
    for (size_t i = 0; i < heads.size(); ++i) os << (i ? ", " : "") << heads[i];
    os << "], context " << cross_attention_dim << (use_linear_projection ? ", linear proj" : "");
    return os.str();
}

// ---- UNet --------------------------------------------------------------------------------------------------------

UNetCond UNetCond::to(const torch::Device& d) const {
    auto mv = [&](const Tensor& t) { return t.defined() ? t.to(d) : t; };
    UNetCond out{mv(context), mv(text_embeds), mv(time_ids)};
    out.timestep_cond = mv(timestep_cond);
    out.residuals = residuals.to(d);
    out.control = control; // computes where the rows it is given are
    return out;
}

UNetCond UNetCond::index_select(const Tensor& idx) const {
    auto sel = [&](const Tensor& t) { return t.defined() ? t.index_select(0, idx.to(t.device())) : t; };
    UNetCond out{sel(context), sel(text_embeds), sel(time_ids)};
    out.timestep_cond = sel(timestep_cond);
    out.residuals = residuals.index_select(idx);
    if (control) out.control = control->index_select(idx);
    return out;
}

SkipResiduals SkipResiduals::plus(const SkipResiduals& o) const {
    auto add = [](const Tensor& a, const Tensor& b) { return !a.defined() ? b : !b.defined() ? a : a + b; };
    SkipResiduals out;
    for (size_t k = 0; k < std::max(down.size(), o.down.size()); ++k)
        out.down.push_back(add(k < down.size() ? down[k] : Tensor(), k < o.down.size() ? o.down[k] : Tensor()));
    out.mid = add(mid, o.mid);
    return out;
}

SkipResiduals SkipResiduals::index_select(const Tensor& idx) const {
    auto sel = [&](const Tensor& t) { return t.defined() ? t.index_select(0, idx.to(t.device())) : t; };
    SkipResiduals out;
    for (const auto& d : down) out.down.push_back(sel(d));
    out.mid = sel(mid);
    return out;
}

SkipResiduals SkipResiduals::to(const torch::Device& dev) const {
    auto mv = [&](const Tensor& t) { return t.defined() ? t.to(dev) : t; };
    SkipResiduals out;
    for (const auto& d : down) out.down.push_back(mv(d));
    out.mid = mv(mid);
    return out;
}

Tensor timestep_embedding(const Tensor& t, int64_t dim, bool flip_sin_to_cos, double freq_shift) {
    const int64_t half = dim / 2;
    // Same float32 operation order as diffusers' get_timestep_embedding.
    auto exponent =
        torch::arange(0, half, torch::TensorOptions().dtype(torch::kFloat).device(t.device())) * (-std::log(10000.0));
    exponent = exponent / (double(half) - freq_shift);
    auto emb = exponent.exp();
    emb = t.to(torch::kFloat).unsqueeze(1) * emb.unsqueeze(0);
    auto sc = torch::cat({emb.sin(), emb.cos()}, -1);
    if (flip_sin_to_cos) sc = torch::cat({sc.narrow(1, half, half), sc.narrow(1, 0, half)}, -1);
    if (dim % 2 == 1) sc = F::pad(sc, F::PadFuncOptions({0, 1}));
    return sc;
}

Tensor guidance_scale_embedding(const Tensor& w, int64_t dim) {
    if (w.dim() != 1) throw Error("guidance_scale_embedding: w must be 1-D, got " + shape_str(w.sizes().vec()));
    const int64_t half = dim / 2;
    // Same float32 operation order as diffusers' get_guidance_scale_embedding.
    const auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
    auto step = torch::log(torch::tensor(10000.0, f32)) / double(half - 1);
    auto freqs = torch::exp(torch::arange(half, f32) * -step);
    auto emb = (w.to(torch::kFloat32) * 1000.0).unsqueeze(1) * freqs.unsqueeze(0);
    emb = torch::cat({torch::sin(emb), torch::cos(emb)}, 1);
    if (dim % 2 == 1) emb = F::pad(emb, F::PadFuncOptions({0, 1}));
    return emb;
}

TimestepEmbeddingImpl::TimestepEmbeddingImpl(int64_t in, int64_t dim, int64_t cond_dim) {
    linear_1 = register_module("linear_1", make_linear(torch::nn::LinearOptions(in, dim)));
    linear_2 = register_module("linear_2", make_linear(torch::nn::LinearOptions(dim, dim)));
    if (cond_dim > 0)
        cond_proj = register_module("cond_proj", make_linear(torch::nn::LinearOptions(cond_dim, in).bias(false)));
}

Tensor TimestepEmbeddingImpl::forward(const Tensor& x, const Tensor& condition) {
    auto sample = x;
    if (cond_proj && condition.defined()) {
        if (condition.dim() != 2 || condition.size(0) != x.size(0) || condition.size(1) != cond_proj->weight.size(1))
            throw Error("UNet: timestep_cond has shape " + shape_str(condition.sizes().vec()) + ", expected [" +
                        std::to_string(x.size(0)) + ", " + std::to_string(cond_proj->weight.size(1)) + "]");
        sample = sample + kernels::linear(cond_proj, condition.to(x.device(), x.scalar_type()));
    }
    return kernels::linear(linear_2, torch::silu(kernels::linear(linear_1, sample)));
}

UNet2DConditionModelImpl::UNet2DConditionModelImpl(const UNetConfig& c, bool decoder) : cfg_(c) {
    const size_t n = c.block_out_channels.size();
    if (n == 0 || c.down_block_types.size() != n || c.up_block_types.size() != n || c.layers_per_block.size() != n ||
        c.heads.size() != n || c.transformer_layers_per_block.size() != n)
        throw Error("UNet config: per-block lists must all have " + std::to_string(n) + " entries");
    const int64_t ch0 = c.block_out_channels[0], temb = ch0 * 4, groups = c.norm_num_groups;
    const double eps = c.norm_eps;
    conv_in = register_module("conv_in", conv(c.in_channels, ch0, 3));
    time_embedding = register_module("time_embedding", TimestepEmbedding(ch0, temb, c.time_cond_proj_dim));
    if (c.text_time())
        add_embedding =
            register_module("add_embedding", TimestepEmbedding(c.projection_class_embeddings_input_dim, temb));
    // Layer j of a level: a resnet (in -> out) and, on a cross-attention level, its transformer.
    auto add_layer = [&](UNetBlockImpl& b, int64_t in, int64_t out, bool attn, int heads, int depth) {
        if (b.res.empty()) b.resnets = b.register_module("resnets", torch::nn::ModuleList());
        if (attn && b.attn.empty()) b.attentions = b.register_module("attentions", torch::nn::ModuleList());
        b.res.emplace_back(in, out, temb, groups, eps);
        b.resnets->push_back(b.res.back());
        if (!attn) return;
        b.attn.emplace_back(out, heads, depth, c.cross_attention_dim, groups, c.use_linear_projection);
        b.attentions->push_back(b.attn.back());
    };
    down_blocks = register_module("down_blocks", torch::nn::ModuleList());
    int64_t out_ch = ch0;
    for (size_t i = 0; i < n; ++i) {
        const int64_t in_ch = out_ch;
        out_ch = c.block_out_channels[i];
        const bool attn = c.down_block_types[i] == "CrossAttnDownBlock2D";
        auto blk = UNetBlock();
        for (int j = 0; j < c.layers_per_block[i]; ++j)
            add_layer(*blk, j == 0 ? in_ch : out_ch, out_ch, attn, c.heads[i], c.transformer_layers_per_block[i]);
        if (i + 1 < n) {
            blk->samplers = blk->register_module("downsamplers", torch::nn::ModuleList());
            blk->down = Downsample2D(out_ch, 1);
            blk->samplers->push_back(blk->down);
        }
        downs.push_back(blk);
        down_blocks->push_back(blk);
    }
    if (c.mid_block) {
        const int64_t ch = c.block_out_channels.back();
        mid_block = register_module("mid_block", UNetMidBlock());
        mid_block->resnets = mid_block->register_module("resnets", torch::nn::ModuleList());
        mid_block->attentions = mid_block->register_module("attentions", torch::nn::ModuleList());
        for (int j = 0; j < 2; ++j) {
            mid_block->res.emplace_back(ch, ch, temb, groups, eps);
            mid_block->resnets->push_back(mid_block->res.back());
        }
        mid_block->attn.emplace_back(ch, c.heads.back(), c.transformer_layers_per_block.back(), c.cross_attention_dim,
                                     groups, c.use_linear_projection);
        mid_block->attentions->push_back(mid_block->attn.back());
    }
    if (!decoder) return;
    up_blocks = register_module("up_blocks", torch::nn::ModuleList());
    std::vector<int> rev(c.block_out_channels.rbegin(), c.block_out_channels.rend());
    std::vector<int> rev_heads(c.heads.rbegin(), c.heads.rend());
    std::vector<int> rev_layers(c.layers_per_block.rbegin(), c.layers_per_block.rend());
    std::vector<int> rev_depth(c.transformer_layers_per_block.rbegin(), c.transformer_layers_per_block.rend());
    int64_t prev_out = rev[0];
    for (size_t i = 0; i < n; ++i) {
        const int64_t o = rev[i], in_ch = rev[std::min(i + 1, n - 1)];
        const bool attn = c.up_block_types[i] == "CrossAttnUpBlock2D";
        const int layers = rev_layers[i] + 1;
        auto blk = UNetBlock();
        for (int j = 0; j < layers; ++j) {
            const int64_t skip = j == layers - 1 ? in_ch : o;
            add_layer(*blk, (j == 0 ? prev_out : o) + skip, o, attn, rev_heads[i], rev_depth[i]);
        }
        if (i + 1 < n) {
            blk->samplers = blk->register_module("upsamplers", torch::nn::ModuleList());
            blk->up = Upsample2D(o);
            blk->samplers->push_back(blk->up);
        }
        prev_out = o;
        ups.push_back(blk);
        up_blocks->push_back(blk);
    }
    conv_norm_out = register_module("conv_norm_out", group_norm(groups, ch0, eps));
    conv_out = register_module("conv_out", conv(ch0, c.out_channels, 3));
}

int UNet2DConditionModelImpl::num_skips() const {
    int n = 1;
    for (const auto& d : downs) n += int(d->res.size()) + (d->down ? 1 : 0);
    return n;
}

void UNet2DConditionModelImpl::load(const WeightMap& w) {
    w.load_into(*this);
}

void UNet2DConditionModelImpl::set_fast_paths(bool on) {
    for (const auto& m : modules(true))
        if (auto* f = dynamic_cast<perf::FastPaths*>(m.get())) f->fast = on;
}

void UNet2DConditionModelImpl::set_fused_qkv(bool on) {
    for (const auto& m : modules(false))
        if (auto* b = dynamic_cast<BasicTransformerBlockImpl*>(m.get())) b->attn1->set_fused_qkv(on);
}

void UNet2DConditionModelImpl::set_attention_kernel(kernels::AttentionKernel k) {
    for (const auto& m : modules(false))
        if (auto* a = dynamic_cast<CrossAttentionImpl*>(m.get())) a->kernel = k;
}

std::vector<CrossAttentionImpl*> UNet2DConditionModelImpl::cross_attentions() {
    std::vector<CrossAttentionImpl*> out;
    for (const auto& m : modules(false))
        if (auto* b = dynamic_cast<BasicTransformerBlockImpl*>(m.get())) out.push_back(b->attn2.get());
    return out;
}

UNet2DConditionModelImpl::ContextKvScope::ContextKvScope(UNet2DConditionModelImpl& unet)
    : attn_(unet.cross_attentions()) {
    for (auto* a : attn_) a->set_context_kv_reuse(true);
}

UNet2DConditionModelImpl::ContextKvScope::~ContextKvScope() {
    for (auto* a : attn_) a->set_context_kv_reuse(false);
}

Tensor UNet2DConditionModelImpl::forward(const Tensor& sample, const Tensor& timestep, const UNetCond& cond,
                                         FeatureObserver* features, const Tensor& stem, AttentionHook* attention) {
    return run(sample, timestep, cond, features, -1, Tensor(), stem, attention);
}

Tensor UNet2DConditionModelImpl::stem(const Tensor& sample) {
    c10::InferenceMode guard(!is_training());
    return perf::conv2d(conv_in, sample.to(conv_in->bias.scalar_type()), *this);
}

Tensor UNet2DConditionModelImpl::forward_shallow(const Tensor& sample, const Tensor& timestep, const UNetCond& cond,
                                                 int branch, const Tensor& cached_feature, const Tensor& stem,
                                                 AttentionHook* attention) {
    check_branch(branch);
    if (!cached_feature.defined()) throw Error("DeepCache shallow step without a cached feature");
    return run(sample, timestep, cond, nullptr, branch, cached_feature, stem, attention);
}

UNet2DConditionModelImpl::Encoding UNet2DConditionModelImpl::encode(const Tensor& sample, const Tensor& timestep,
                                                                    const UNetCond& cond, const Tensor& stem, int skips,
                                                                    bool mid) {
    Encoding e;
    e.skips.resize(size_t(std::clamp(skips, 1, num_skips())));
    if (mid) e.mid = torch::empty({0}); // defined: run() runs the mid block and puts its output here
    run(sample, timestep, cond, nullptr, -1, Tensor(), stem, nullptr, &e);
    return e;
}

void UNet2DConditionModelImpl::check_branch(int branch) const {
    if (branch < 0 || branch >= num_skips())
        throw Error("DeepCache branch " + std::to_string(branch) + " out of range [0, " + std::to_string(num_skips()) +
                    ")");
}

std::vector<FeatureId> UNet2DConditionModelImpl::shallow_attention_layers(int branch) const {
    check_branch(branch);
    // The walk of run() with shallow = branch: the down layers producing skips 1..B, the up layers consuming B..0.
    std::vector<FeatureId> out;
    const auto dl = down_layers();
    for (size_t s = 0; s < size_t(branch); ++s)
        if (!dl[s].downsampler && !downs[size_t(dl[s].block)]->attn.empty())
            out.push_back({FeatureKind::DownAttention, dl[s].block, dl[s].index});
    const auto ul = up_layers();
    for (size_t q = size_t(num_skips() - 1 - branch); q < ul.size(); ++q)
        if (!ups[size_t(ul[q].block)]->attn.empty())
            out.push_back({FeatureKind::UpAttention, ul[q].block, ul[q].index});
    return out;
}

std::vector<UNet2DConditionModelImpl::DownLayer> UNet2DConditionModelImpl::down_layers() const {
    std::vector<DownLayer> out;
    int skip = 1;
    for (size_t i = 0; i < downs.size(); ++i) {
        const int first = skip, nres = int(downs[i]->res.size());
        const bool down = bool(downs[i]->down);
        for (int j = 0; j < nres; ++j, ++skip) out.push_back({int(i), j, false, first, j == nres - 1 && !down});
        if (down) out.push_back({int(i), 0, true, first, true}), ++skip;
    }
    return out;
}

std::vector<UNet2DConditionModelImpl::UpLayer> UNet2DConditionModelImpl::up_layers() const {
    std::vector<UpLayer> out;
    for (size_t i = 0; i < ups.size(); ++i) {
        const int nres = int(ups[i]->res.size());
        for (int j = 0; j < nres; ++j) out.push_back({int(i), j, j == nres - 1});
    }
    return out;
}

Tensor UNet2DConditionModelImpl::run(const Tensor& sample, const Tensor& timestep, const UNetCond& cond,
                                     FeatureObserver* obs, int shallow, const Tensor& cached, const Tensor& stem,
                                     AttentionHook* hook, Encoding* encoding) {
    c10::InferenceMode guard(!is_training()); // train() mode keeps autograd (unet/train/)
    util::HeapScope heap;                     // reuse the step's freed blocks (cache/util/heap.h)
    // The compute dtype is the biases' (weights may be stored in reduced precision, unet/model/checkpoint.h weights_dtype).
    const auto dtype = conv_in->bias.scalar_type();
    TORCH_CHECK(sample.dim() == 4, "UNet sample must be [B, C, H, W], got ", sample.sizes());
    const int64_t B = sample.size(0);
    auto x = sample.to(dtype);
    auto ctx = cond.context.to(dtype);
    auto t = timestep.dim() == 0 ? timestep.reshape({1}) : timestep;
    if (t.size(0) == 1 && B != 1) t = t.expand({B});
    TORCH_CHECK(t.dim() == 1 && t.size(0) == B, "UNet timestep must be 0-dim or [", B, "], got ", timestep.sizes());
    auto emit = [obs](FeatureKind k, int block, int index, const Tensor& v) {
        if (obs) obs->on_feature({k, block, index}, v);
    };
    // An attention layer, its submodules reported too when someone observes.
    auto attention = [&](Transformer2DModel& a, const Tensor& in, FeatureKind k, int block, int index) {
        const FeatureId id{k, block, index};
        if (hook) {
            const Tensor r = hook->reuse(id, in);
            if (r.defined()) {
                if (r.sizes() != in.sizes())
                    throw Error("UNet: the residual handed for " + id.name() + " has shape " +
                                shape_str(r.sizes().vec()) + ", its input " + shape_str(in.sizes().vec()));
                auto out = in + r.to(in.scalar_type());
                emit(k, block, index, out);
                return out;
            }
        }
        Transformer2DModelImpl::Tap tap;
        if (obs) tap = [&](const char* part, const Tensor& v) { obs->on_feature({k, block, index, part}, v); };
        auto out = a->forward(in, ctx, tap);
        if (hook) hook->computed(id, in, out);
        emit(k, block, index, out);
        return out;
    };

    auto tproj = timestep_embedding(t.to(x.device()), cfg_.block_out_channels[0], cfg_.flip_sin_to_cos, cfg_.freq_shift)
                     .to(dtype);
    auto temb = time_embedding->forward(tproj, cond.timestep_cond);
    emit(FeatureKind::TimeProj, -1, -1, tproj);
    emit(FeatureKind::TimeEmbedding, -1, -1, temb);
    if (add_embedding) {
        // diffusers UNet2DConditionModel.get_aug_embed, "text_time": every time id embedded on its own.
        if (!cond.text_embeds.defined() || !cond.time_ids.defined())
            throw Error("SDXL UNet: the conditioning lacks text_embeds (pooled text embedding) and time_ids "
                        "(micro-conditioning)");
        const int64_t want = cfg_.projection_class_embeddings_input_dim;
        const int64_t got = cond.text_embeds.size(-1) + cond.time_ids.size(-1) * cfg_.addition_time_embed_dim;
        if (cond.text_embeds.dim() != 2 || cond.time_ids.dim() != 2 || cond.text_embeds.size(0) != B ||
            cond.time_ids.size(0) != B || got != want)
            throw Error("SDXL UNet: text_embeds " + shape_str(cond.text_embeds.sizes().vec()) + " and time_ids " +
                        shape_str(cond.time_ids.sizes().vec()) + " do not give add_embedding's input [" +
                        std::to_string(B) + ", " + std::to_string(want) + "]");
        auto ids = cond.time_ids.to(x.device(), torch::kFloat).flatten();
        auto tids = timestep_embedding(ids, cfg_.addition_time_embed_dim, cfg_.flip_sin_to_cos, cfg_.freq_shift);
        emit(FeatureKind::AddTimeProj, -1, -1, tids);
        auto add_in = torch::cat({cond.text_embeds.to(x.device(), torch::kFloat), tids.reshape({B, -1})}, -1);
        auto aug = add_embedding->forward(add_in.to(dtype));
        emit(FeatureKind::AddEmbedding, -1, -1, aug);
        temb = temb + aug;
        emit(FeatureKind::TembPlusAug, -1, -1, temb);
    }
    auto temb_act = torch::silu(temb); // every resnet applies silu to temb first: do it once

    if (stem.defined()) {
        const std::vector<int64_t> want{B, conv_in->weight.size(0), x.size(2), x.size(3)};
        if (stem.sizes().vec() != want)
            throw Error("UNet: the given conv_in output has shape " + shape_str(stem.sizes().vec()) + ", expected " +
                        shape_str(want));
    }
    auto h = stem.defined() ? stem.to(dtype) : perf::conv2d(conv_in, x, *this);
    emit(FeatureKind::ConvIn, -1, -1, h);
    std::vector<Tensor> skips{h};
    const auto downs_walk = down_layers();
    // producing skips 1..n_down
    const size_t n_down = encoding ? encoding->skips.size() - 1 : shallow >= 0 ? size_t(shallow) : downs_walk.size();
    for (size_t s = 0; s < n_down; ++s) {
        const DownLayer& l = downs_walk[s];
        auto& d = downs[size_t(l.block)];
        if (l.downsampler) {
            h = d->down->forward(h);
            emit(FeatureKind::Downsampler, l.block, 0, h);
        } else {
            h = d->res[size_t(l.index)]->forward(h, temb_act);
            emit(FeatureKind::DownResnet, l.block, l.index, h);
            if (!d->attn.empty()) {
                h = attention(d->attn[size_t(l.index)], h, FeatureKind::DownAttention, l.block, l.index);
            }
        }
        skips.push_back(h);
        if (obs && shallow < 0 && l.last_in_block) {
            emit(FeatureKind::DownHidden, l.block, -1, h);
            for (size_t k = size_t(l.block_first_skip); k < skips.size(); ++k)
                emit(FeatureKind::DownResSample, l.block, int(k) - l.block_first_skip, skips[k]);
        }
    }
    const bool run_mid = shallow < 0 && (!encoding || encoding->mid.defined());
    if (encoding && !run_mid) {
        std::copy(skips.begin(), skips.end(), encoding->skips.begin());
        return h;
    }
    if (run_mid && mid_block) {
        h = mid_block->res[0]->forward(h, temb_act);
        emit(FeatureKind::MidResnet, -1, 0, h);
        for (size_t j = 0; j < mid_block->attn.size(); ++j) {
            h = attention(mid_block->attn[j], h, FeatureKind::MidAttention, -1, int(j));
            h = mid_block->res[j + 1]->forward(h, temb_act);
            emit(FeatureKind::MidResnet, -1, int(j) + 1, h);
        }
        emit(FeatureKind::Mid, -1, -1, h);
    }
    if (encoding) {
        std::copy(skips.begin(), skips.end(), encoding->skips.begin());
        encoding->mid = h;
        return h;
    }
    const int n = num_skips();
    // The ControlNet residuals (diffusers: added to every skip after the down pass and to the mid block's output):
    // those of the skips this walk consumes; a shallow step's reused feature carries the deeper ones already.
    SkipResiduals extra = cond.residuals;
    if (cond.control) {
        UNetCond plain = cond;
        plain.control.reset(), plain.residuals = SkipResiduals();
        extra =
            extra.plus(cond.control->residuals(sample, timestep, plain, shallow >= 0 ? shallow + 1 : n, shallow < 0));
    }
    if (!extra.down.empty() && int(extra.down.size()) != n && int(extra.down.size()) != shallow + 1)
        throw Error("UNet: " + std::to_string(extra.down.size()) + " skip residuals for " + std::to_string(n) +
                    " skip connections");
    auto skip_of = [&](int k) -> Tensor {
        const Tensor& s = skips[size_t(k)];
        if (size_t(k) >= extra.down.size() || !extra.down[size_t(k)].defined()) return s;
        const Tensor& r = extra.down[size_t(k)];
        if (r.sizes() != s.sizes())
            throw Error("UNet: the residual for skip " + std::to_string(k) + " has shape " +
                        shape_str(r.sizes().vec()) + ", the skip " + shape_str(s.sizes().vec()));
        return s + r.to(s.device(), s.scalar_type());
    };
    if (shallow < 0 && extra.mid.defined()) {
        if (extra.mid.sizes() != h.sizes())
            throw Error("UNet: the mid-block residual has shape " + shape_str(extra.mid.sizes().vec()) +
                        ", the mid block's output " + shape_str(h.sizes().vec()));
        h = h + extra.mid.to(h.device(), h.scalar_type());
    }
    const auto ups_walk = up_layers();
    if (shallow >= 0) h = cached.to(dtype); // the cached input of the layer consuming skip `shallow`
    for (size_t q = shallow >= 0 ? size_t(n - 1 - shallow) : 0; q < ups_walk.size(); ++q) {
        const UpLayer& l = ups_walk[q];
        auto& u = ups[size_t(l.block)];
        const int k = n - 1 - int(q); // the skip this layer consumes
        emit(FeatureKind::UpSkipInput, l.block, k, h);
        h = torch::cat({h, skip_of(k)}, 1);
        h = u->res[size_t(l.index)]->forward(h, temb_act);
        emit(FeatureKind::UpResnet, l.block, l.index, h);
        if (!u->attn.empty()) {
            h = attention(u->attn[size_t(l.index)], h, FeatureKind::UpAttention, l.block, l.index);
        }
        if (!l.last_in_block) continue;
        if (u->up) {
            // Upsample to the size of the next skip (diffusers' upsample_size; equals 2x for even sizes).
            const auto& next = skips[size_t(k - 1)];
            h = u->up->forward(h, std::vector<int64_t>{next.size(2), next.size(3)});
            emit(FeatureKind::Upsampler, l.block, 0, h);
        }
        emit(FeatureKind::Up, l.block, -1, h);
    }
    h = conv_norm_out->forward(h);
    emit(FeatureKind::ConvNormOut, -1, -1, h);
    h = perf::conv2d(conv_out, torch::silu(h), *this);
    emit(FeatureKind::ConvOut, -1, -1, h);
    return h;
}

bool FeatureId::inner() const {
    switch (kind) {
    case FeatureKind::DownResnet:
    case FeatureKind::DownAttention:
    case FeatureKind::Downsampler:
    case FeatureKind::MidResnet:
    case FeatureKind::MidAttention:
    case FeatureKind::UpResnet:
    case FeatureKind::UpAttention:
    case FeatureKind::Upsampler:
        return true;
    default:
        return false;
    }
}

std::string FeatureId::name() const {
    const std::string b = std::to_string(block), i = std::to_string(index);
    if (part) return FeatureId{kind, block, index}.name() + "." + part;
    switch (kind) {
    case FeatureKind::TimeProj:
        return "time_proj";
    case FeatureKind::TimeEmbedding:
        return "time_embedding";
    case FeatureKind::AddTimeProj:
        return "add_time_proj";
    case FeatureKind::AddEmbedding:
        return "add_embedding";
    case FeatureKind::TembPlusAug:
        return "temb_plus_aug";
    case FeatureKind::ConvIn:
        return "conv_in";
    case FeatureKind::DownResnet:
        return "down_blocks." + b + ".resnets." + i;
    case FeatureKind::DownAttention:
        return "down_blocks." + b + ".attentions." + i;
    case FeatureKind::Downsampler:
        return "down_blocks." + b + ".downsamplers.0";
    case FeatureKind::DownHidden:
        return "down_blocks." + b + ".hidden";
    case FeatureKind::DownResSample:
        return "down_blocks." + b + ".res_samples." + i;
    case FeatureKind::MidResnet:
        return "mid_block.resnets." + i;
    case FeatureKind::MidAttention:
        return "mid_block.attentions." + i;
    case FeatureKind::Mid:
        return "mid_block";
    case FeatureKind::UpSkipInput:
        return "up_skip_input." + i;
    case FeatureKind::UpResnet:
        return "up_blocks." + b + ".resnets." + i;
    case FeatureKind::UpAttention:
        return "up_blocks." + b + ".attentions." + i;
    case FeatureKind::Upsampler:
        return "up_blocks." + b + ".upsamplers.0";
    case FeatureKind::Up:
        return "up_blocks." + b;
    case FeatureKind::ConvNormOut:
        return "conv_norm_out";
    case FeatureKind::ConvOut:
        return "conv_out";
    }
    return "?";
}

void UNetFeatures::on_feature(const FeatureId& id, const torch::Tensor& t) {
    if (id.kind == FeatureKind::UpSkipInput) {
        if (id.index == cache_branch) cache_feature = t;
        return;
    }
    if (record_inner || !id.inner()) named[id.name()] = t;
}

} // namespace anchor::unet
