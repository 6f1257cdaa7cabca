// T5 encoder forward (unet/model/t5_encoder.h), following Hugging Face's T5EncoderModel arithmetic op for op so that
// float32 results match it within rounding.
#include "unet/model/t5_encoder.h"

#include "cache/io/deferred_weights.h"
#include "cache/io/error.h"
#include "cache/io/json_config.h"
#include "cache/io/model_source.h"
#include "cache/io/weight_map.h"
#include "kernels/linear.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <limits>

namespace anchor::unet {

namespace {

std::vector<JsonField> t5_json_fields(T5EncoderConfig& c) {
    return {ANCHOR_JSON_FIELD(c, vocab_size),
            ANCHOR_JSON_FIELD(c, d_model),
            ANCHOR_JSON_FIELD(c, d_kv),
            ANCHOR_JSON_FIELD(c, d_ff),
            ANCHOR_JSON_FIELD(c, num_layers),
            ANCHOR_JSON_FIELD(c, num_heads),
            ANCHOR_JSON_FIELD(c, relative_attention_num_buckets),
            ANCHOR_JSON_FIELD(c, relative_attention_max_distance),
            ANCHOR_JSON_FIELD(c, layer_norm_epsilon),
            ANCHOR_JSON_FIELD(c, feed_forward_proj)};
}

// HF's NewGELUActivation ("gelu_new"): the tanh approximation, written as transformers writes it.
torch::Tensor t5_gelu_new(const torch::Tensor& x) {
    return 0.5 * x * (1.0 + torch::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * torch::pow(x, 3.0))));
}

torch::Tensor t5_activation(const std::string& act, const torch::Tensor& x) {
    if (act == "gelu_new") return t5_gelu_new(x);
    if (act == "gelu") return torch::gelu(x);
    return torch::relu(x);
}

// HF's T5 float16 guard: hidden states that overflowed to inf are clamped just below the float16 maximum (T5-XXL's
// activations exceed it; float32 / bfloat16 never take this branch).
torch::Tensor t5_clamp_f16(const torch::Tensor& x) {
    if (x.scalar_type() != torch::kHalf || !torch::isinf(x).any().item<bool>()) return x;
    const double m = double(std::numeric_limits<c10::Half>::max()) - 1000;
    return x.clamp(-m, m);
}

} // namespace

std::string T5EncoderConfig::activation() const {
    const std::string a = gated() ? feed_forward_proj.substr(6) : feed_forward_proj;
    return a == "gelu" && gated() ? "gelu_new" : a; // HF's T5Config: "gated-gelu" means gelu_new
}

T5EncoderConfig T5EncoderConfig::from_json(const nlohmann::json& j, const std::string& source) {
    const JsonConfig f(j, source);
    T5EncoderConfig c;
    f.read(t5_json_fields(c));
    const std::string act = c.activation();
    if (act != "relu" && act != "gelu" && act != "gelu_new")
        f.fail("feed_forward_proj", "must be relu, gelu, gated-gelu, gated-relu or gated-gelu_new",
               f.json().at("feed_forward_proj"));
    // An explicit dense_act_fn overrides the mapping (T5Config reads it only from feed_forward_proj; a config that
    // names another activation than the one implied is refused rather than guessed).
    if (f.has("dense_act_fn") && f.get_string("dense_act_fn", act) != act)
        f.fail("dense_act_fn", "must be " + act + " (what feed_forward_proj '" + c.feed_forward_proj + "' implies)",
               f.json().at("dense_act_fn"));
    f.reject("is_decoder", "a T5 decoder is not an encoder");
    if (c.num_heads <= 0 || c.d_kv <= 0 || c.d_model <= 0 || c.num_layers <= 0)
        f.fail("num_heads, d_kv, d_model and num_layers must be positive");
    if (c.relative_attention_num_buckets < 4 || c.relative_attention_max_distance <= c.relative_attention_num_buckets / 4)
        f.fail("relative_attention_num_buckets " + std::to_string(c.relative_attention_num_buckets) +
               " / relative_attention_max_distance " + std::to_string(c.relative_attention_max_distance) +
               ": need at least 4 buckets and a max distance above a quarter of them");
    return c;
}

T5EncoderConfig T5EncoderConfig::from_json_file(const std::string& path) {
    return from_json(JsonConfig::load(path, "T5 config").json(), path);
}

T5EncoderConfig T5EncoderConfig::detect_from_weights(const WeightMap& w) {
    auto need = [&](const std::string& n) {
        if (!w.has(n)) throw Error("T5 encoder weights lack '" + n + "'");
        return w.shape(n);
    };
    T5EncoderConfig c;
    const auto emb = w.has("shared.weight") ? need("shared.weight") : need("encoder.embed_tokens.weight");
    c.vocab_size = int(emb[0]);
    c.d_model = int(emb[1]);
    const std::string b0 = "encoder.block.0.layer.0.SelfAttention.";
    const auto bias = need(b0 + "relative_attention_bias.weight");
    c.relative_attention_num_buckets = int(bias[0]);
    c.num_heads = int(bias[1]);
    const int64_t inner = need(b0 + "q.weight")[0];
    if (c.num_heads <= 0 || inner % c.num_heads != 0)
        throw Error("T5 encoder weights: q rows " + std::to_string(inner) + " are not a multiple of the " +
                    std::to_string(c.num_heads) + " heads of relative_attention_bias");
    c.d_kv = int(inner / c.num_heads);
    int layers = 0;
    while (w.has("encoder.block." + std::to_string(layers) + ".layer.0.SelfAttention.q.weight")) ++layers;
    c.num_layers = layers;
    const std::string ff = "encoder.block.0.layer.1.DenseReluDense.";
    if (w.has(ff + "wi_0.weight")) {
        c.d_ff = int(w.shape(ff + "wi_0.weight")[0]);
        c.feed_forward_proj = "gated-gelu";
    } else {
        c.d_ff = int(need(ff + "wi.weight")[0]);
        c.feed_forward_proj = "relu";
    }
    return c;
}

torch::Tensor t5_relative_position_bucket(const torch::Tensor& relative_position, int num_buckets, int max_distance) {
    // Op for op as HF (bidirectional): the float32 log and the truncation to long decide the bucket edges.
    const int64_t half = num_buckets / 2;
    auto buckets = (relative_position > 0).to(torch::kLong) * half;
    const auto n = torch::abs(relative_position);
    const int64_t max_exact = half / 2;
    const auto is_small = n < max_exact;
    auto large = max_exact + (torch::log(n.to(torch::kFloat) / max_exact) /
                              std::log(double(max_distance) / double(max_exact)) * (half - max_exact))
                                 .to(torch::kLong);
    large = torch::min(large, torch::full_like(large, half - 1));
    return buckets + torch::where(is_small, n, large);
}

T5AttentionImpl::T5AttentionImpl(const T5EncoderConfig& c, bool has_relative_bias) : heads(c.num_heads), d_kv(c.d_kv) {
    const int inner = c.num_heads * c.d_kv;
    q = register_module("q", make_linear(torch::nn::LinearOptions(c.d_model, inner).bias(false)));
    k = register_module("k", make_linear(torch::nn::LinearOptions(c.d_model, inner).bias(false)));
    v = register_module("v", make_linear(torch::nn::LinearOptions(c.d_model, inner).bias(false)));
    o = register_module("o", make_linear(torch::nn::LinearOptions(inner, c.d_model).bias(false)));
    if (has_relative_bias)
        relative_attention_bias = register_module(
            "relative_attention_bias", torch::nn::Embedding(c.relative_attention_num_buckets, c.num_heads));
}

torch::Tensor T5AttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& position_bias) {
    const auto B = x.size(0), T = x.size(1);
    auto split = [&](const torch::Tensor& t) { return t.view({B, T, heads, d_kv}).transpose(1, 2); };
    const auto qh = split(kernels::linear(q, x)), kh = split(kernels::linear(k, x)), vh = split(kernels::linear(v, x));
    // No 1/sqrt(d_kv): T5 scales the query projection's initialisation instead (Raffel et al. 2020, Mesh TF).
    auto scores = torch::matmul(qh, kh.transpose(3, 2)) + position_bias.to(qh.scalar_type());
    const auto attn = torch::softmax(scores.to(torch::kFloat), -1).to(scores.scalar_type());
    const auto out = torch::matmul(attn, vh).transpose(1, 2).contiguous().view({B, T, heads * d_kv});
    return kernels::linear(o, out);
}

T5LayerNormImpl::T5LayerNormImpl(int dim, double eps_) : eps(eps_) {
    weight = register_parameter("weight", torch::ones({dim}));
}

torch::Tensor T5LayerNormImpl::forward(const torch::Tensor& x) {
    const auto variance = x.to(torch::kFloat).pow(2).mean(-1, true);
    auto h = x * torch::rsqrt(variance + eps);
    // HF casts back to a float16 / bfloat16 weight's dtype; float32 activations with reduced-precision weights
    // (--weights-dtype) keep float32 and upcast the weight (kernels/linear.h's rule).
    if (x.scalar_type() == torch::kFloat) return kernels::weight_for(weight, h) * h;
    if (weight.scalar_type() == torch::kHalf || weight.scalar_type() == torch::kBFloat16) h = h.to(weight.scalar_type());
    return weight * h;
}

T5FeedForwardImpl::T5FeedForwardImpl(const T5EncoderConfig& c) : act(c.activation()) {
    if (c.gated()) {
        wi_0 = register_module("wi_0", make_linear(torch::nn::LinearOptions(c.d_model, c.d_ff).bias(false)));
        wi_1 = register_module("wi_1", make_linear(torch::nn::LinearOptions(c.d_model, c.d_ff).bias(false)));
    } else {
        wi = register_module("wi", make_linear(torch::nn::LinearOptions(c.d_model, c.d_ff).bias(false)));
    }
    wo = register_module("wo", make_linear(torch::nn::LinearOptions(c.d_ff, c.d_model).bias(false)));
}

torch::Tensor T5FeedForwardImpl::forward(const torch::Tensor& x) {
    const auto h = wi ? t5_activation(act, kernels::linear(wi, x))
                      : t5_activation(act, kernels::linear(wi_0, x)) * kernels::linear(wi_1, x);
    return kernels::linear(wo, h);
}

T5EncoderModelImpl::T5EncoderModelImpl(const T5EncoderConfig& c) : cfg_(c) {
    shared = register_module("shared", torch::nn::Embedding(c.vocab_size, c.d_model));
    // HF's module tree (encoder.block.<i>.layer.<0|1>.*), so the state-dict names load as they are.
    auto encoder = register_module("encoder", std::make_shared<torch::nn::Module>());
    auto block = encoder->register_module("block", torch::nn::ModuleList());
    for (int i = 0; i < c.num_layers; ++i) {
        attention.emplace_back(c, i == 0);
        attention_norm.emplace_back(c.d_model, c.layer_norm_epsilon);
        ff.emplace_back(c);
        ff_norm.emplace_back(c.d_model, c.layer_norm_epsilon);
        auto b = std::make_shared<torch::nn::Module>();
        auto layer = b->register_module("layer", torch::nn::ModuleList());
        auto l0 = std::make_shared<torch::nn::Module>(), l1 = std::make_shared<torch::nn::Module>();
        l0->register_module("SelfAttention", attention.back());
        l0->register_module("layer_norm", attention_norm.back());
        l1->register_module("DenseReluDense", ff.back());
        l1->register_module("layer_norm", ff_norm.back());
        layer->push_back(l0);
        layer->push_back(l1);
        block->push_back(b);
    }
    final_layer_norm = encoder->register_module("final_layer_norm", T5LayerNorm(c.d_model, c.layer_norm_epsilon));
}

torch::Tensor T5EncoderModelImpl::position_bias(int64_t T) {
    const auto dev = shared->weight.device();
    const auto pos = torch::arange(T, torch::TensorOptions().dtype(torch::kLong).device(dev));
    const auto rel = pos.unsqueeze(0) - pos.unsqueeze(1); // [query, key]: key - query
    const auto buckets =
        t5_relative_position_bucket(rel, cfg_.relative_attention_num_buckets, cfg_.relative_attention_max_distance);
    return attention.front()->relative_attention_bias->forward(buckets).permute({2, 0, 1}).unsqueeze(0);
}

torch::Tensor T5EncoderModelImpl::forward(const torch::Tensor& input_ids, std::vector<torch::Tensor>* blocks) {
    TORCH_CHECK(input_ids.dim() == 2, "T5 input_ids must be [batch, tokens]");
    const auto ids = input_ids.to(shared->weight.device(), torch::kLong);
    auto x = shared->forward(ids);
    // Reduced-precision weights under a float32 compute (kernels/linear.h): the activations stay float32.
    if (kernels::upcast_at_use(shared->weight, torch::empty({0}, torch::kFloat))) x = x.to(torch::kFloat);
    auto bias = position_bias(ids.size(1));
    if (x.scalar_type() == torch::kFloat) bias = bias.to(torch::kFloat);
    if (blocks) blocks->push_back(x);
    for (size_t i = 0; i < attention.size(); ++i) {
        x = t5_clamp_f16(x + attention[i]->forward(attention_norm[i]->forward(x), bias));
        x = t5_clamp_f16(x + ff[i]->forward(ff_norm[i]->forward(x)));
        if (blocks) blocks->push_back(x);
    }
    return final_layer_norm->forward(x);
}

void T5EncoderModelImpl::load(const WeightMap& w) {
    if (!w.has("shared.weight") && w.has("encoder.embed_tokens.weight")) {
        // Some exports keep only the encoder's (tied) copy of the embedding.
        load(w.renamed([](const std::string& n) { return n == "encoder.embed_tokens.weight" ? "shared.weight" : n; }));
        return;
    }
    w.load_into(*this, {"encoder\\.embed_tokens\\.weight"});
}

T5EncoderModel load_t5_encoder_folder(const std::string& dir, torch::ScalarType dtype) {
    if (!std::filesystem::is_directory(dir)) throw Error("T5 encoder folder '" + dir + "' does not exist");
    // The linear weights allocated in the load dtype: T5-XXL's 4.7 G parameters never exist in float32 for a
    // bf16 / f16 load.
    const DeferredWeights deferred(dtype);
    const ModelSource src = resolve_model(dir, {nullptr, "T5 encoder"});
    if (src.config_file.empty()) throw Error("T5 encoder folder '" + dir + "' has no config.json");
    T5EncoderModel m(T5EncoderConfig::from_json_file(src.config_file));
    m->load(src.load_weights());
    m->eval();
    if (dtype != torch::kFloat) m->to(dtype);
    return m;
}

} // namespace anchor::unet
