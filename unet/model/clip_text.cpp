// CLIP text encoder forward, following the Hugging Face CLIPTextModel equations (pre-LN transformer, causal mask,
// q scaled by head_dim^-0.5 before the product).
#include "unet/model/clip_text.h"

#include "cache/io/deferred_weights.h"

#include "cache/io/error.h"
#include "cache/io/json_config.h"
#include "cache/io/weight_map.h"
#include "kernels/attention.h"
#include "kernels/linear.h"

#include <nlohmann/json.hpp>

#include <fstream>
#include <limits>

namespace anchor::unet {

namespace F = torch::nn::functional;

namespace {

// The fields from_json reads and to_json writes under HF's names.
std::vector<JsonField> json_fields(ClipTextConfig& c) {
    return {ANCHOR_JSON_FIELD(c, vocab_size),          ANCHOR_JSON_FIELD(c, hidden_size),
            ANCHOR_JSON_FIELD(c, intermediate_size),   ANCHOR_JSON_FIELD(c, num_hidden_layers),
            ANCHOR_JSON_FIELD(c, num_attention_heads), ANCHOR_JSON_FIELD(c, max_position_embeddings),
            ANCHOR_JSON_FIELD(c, hidden_act),          ANCHOR_JSON_FIELD(c, layer_norm_eps)};
}

} // namespace

ClipTextConfig ClipTextConfig::from_json(const nlohmann::json& j, const std::string& source) {
    // SD 2.x text_encoder/config.json nests nothing; a full CLIPConfig has the fields under text_config.
    const bool nested = j.contains("text_config") && j["text_config"].is_object();
    const JsonConfig f(nested ? j["text_config"] : j, nested ? source + "' text_config '" : source);
    ClipTextConfig c;
    f.read(json_fields(c));
    // Every HF CLIP text config carries projection_dim; only the WithProjection model has the layer.
    if (j.contains("architectures") && j["architectures"].is_array())
        for (const auto& a : j["architectures"])
            if (a.is_string() && a.get<std::string>() == "CLIPTextModelWithProjection")
                c.projection_dim = f.get_int("projection_dim", 512);
    if (c.hidden_act != "quick_gelu" && c.hidden_act != "gelu")
        f.fail("hidden_act", "must be quick_gelu or gelu", f.json().at("hidden_act"));
    if (c.num_attention_heads <= 0 || c.hidden_size % c.num_attention_heads != 0)
        f.fail("hidden_size " + std::to_string(c.hidden_size) + " is not divisible by " +
               std::to_string(c.num_attention_heads) + " heads");
    return c;
}

nlohmann::json ClipTextConfig::to_json() const {
    ClipTextConfig c = *this;
    nlohmann::json j = json_of(json_fields(c));
    j["architectures"] = {projection_dim > 0 ? "CLIPTextModelWithProjection" : "CLIPTextModel"};
    j["model_type"] = "clip_text_model";
    if (projection_dim > 0) j["projection_dim"] = projection_dim;
    // CLIP's <|startoftext|> and <|endoftext|> (SD pads with the latter).
    j["bos_token_id"] = 49406;
    j["eos_token_id"] = j["pad_token_id"] = 49407;
    return j;
}

ClipTextConfig ClipTextConfig::from_json_file(const std::string& path) {
    return from_json(JsonConfig::load(path, "text encoder config").json(), path);
}

ClipTextConfig ClipTextConfig::detect_from_weights(const WeightMap& w) {
    ClipTextConfig c;
    const std::string tok = "text_model.embeddings.token_embedding.weight";
    const std::string pos = "text_model.embeddings.position_embedding.weight";
    if (!w.has(tok) || !w.has(pos)) throw Error("text encoder weights lack '" + tok + "' / '" + pos + "'");
    auto ts = w.shape(tok);
    c.vocab_size = int(ts[0]);
    c.hidden_size = int(ts[1]);
    c.max_position_embeddings = int(w.shape(pos)[0]);
    int layers = 0;
    while (w.has("text_model.encoder.layers." + std::to_string(layers) + ".self_attn.q_proj.weight")) ++layers;
    if (layers == 0) throw Error("text encoder weights have no 'text_model.encoder.layers.0.*' tensors");
    c.num_hidden_layers = layers;
    c.intermediate_size = int(w.shape("text_model.encoder.layers.0.mlp.fc1.weight")[0]);
    c.num_attention_heads = c.hidden_size >= 512 ? c.hidden_size / 64 : std::max(1, c.hidden_size / 8);
    c.hidden_act = c.hidden_size == 1024 ? "gelu" : "quick_gelu";
    if (w.has("text_projection.weight")) c.projection_dim = int(w.shape("text_projection.weight")[0]);
    return c;
}

ClipAttentionImpl::ClipAttentionImpl(const ClipTextConfig& c)
    : heads(c.num_attention_heads), head_dim(c.hidden_size / c.num_attention_heads) {
    q_proj = register_module("q_proj", make_linear(torch::nn::LinearOptions(c.hidden_size, c.hidden_size)));
    k_proj = register_module("k_proj", make_linear(torch::nn::LinearOptions(c.hidden_size, c.hidden_size)));
    v_proj = register_module("v_proj", make_linear(torch::nn::LinearOptions(c.hidden_size, c.hidden_size)));
    out_proj = register_module("out_proj", make_linear(torch::nn::LinearOptions(c.hidden_size, c.hidden_size)));
}

torch::Tensor ClipAttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& mask) {
    // Hugging Face CLIPAttention: the query scaled by head_dim^-0.5 before the heads are split, the additive causal
    // mask on the scores.
    kernels::AttentionOptions o;
    o.heads = heads;
    o.scale = 1.0 / std::sqrt(double(head_dim));
    o.formula = kernels::ScoreFormula::PreScaledQuery;
    o.kernel = kernel;
    // The mask is CLIP's causal one (ClipTextModelImpl::forward): the fast kernels apply it themselves.
    if (kernel == kernels::AttentionKernel::Exact || kernel == kernels::AttentionKernel::Reference)
        o.additive_mask = mask;
    else
        o.causal = true;
    return kernels::linear(out_proj, kernels::attention(kernels::linear(q_proj, x), kernels::linear(k_proj, x),
                                                        kernels::linear(v_proj, x), o));
}

ClipMlpImpl::ClipMlpImpl(const ClipTextConfig& c) : quick_gelu(c.hidden_act == "quick_gelu") {
    fc1 = register_module("fc1", make_linear(torch::nn::LinearOptions(c.hidden_size, c.intermediate_size)));
    fc2 = register_module("fc2", make_linear(torch::nn::LinearOptions(c.intermediate_size, c.hidden_size)));
}

torch::Tensor ClipMlpImpl::forward(const torch::Tensor& x) {
    auto h = kernels::linear(fc1, x);
    h = quick_gelu ? h * torch::sigmoid(h * 1.702) : torch::gelu(h);
    return kernels::linear(fc2, h);
}

ClipEncoderLayerImpl::ClipEncoderLayerImpl(const ClipTextConfig& c) {
    self_attn = register_module("self_attn", ClipAttention(c));
    layer_norm1 = register_module(
        "layer_norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden_size}).eps(c.layer_norm_eps)));
    mlp = register_module("mlp", ClipMlp(c));
    layer_norm2 = register_module(
        "layer_norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden_size}).eps(c.layer_norm_eps)));
}

torch::Tensor ClipEncoderLayerImpl::forward(const torch::Tensor& x, const torch::Tensor& mask) {
    auto h = x + self_attn->forward(layer_norm1->forward(x), mask);
    return h + mlp->forward(layer_norm2->forward(h));
}

ClipEmbeddingsImpl::ClipEmbeddingsImpl(const ClipTextConfig& c) {
    token_embedding = register_module("token_embedding", torch::nn::Embedding(c.vocab_size, c.hidden_size));
    position_embedding =
        register_module("position_embedding", torch::nn::Embedding(c.max_position_embeddings, c.hidden_size));
}

ClipEncoderImpl::ClipEncoderImpl(const ClipTextConfig& c) {
    layers = register_module("layers", torch::nn::ModuleList());
    for (int i = 0; i < c.num_hidden_layers; ++i) {
        items.emplace_back(c);
        layers->push_back(items.back());
    }
}

ClipTextTransformerImpl::ClipTextTransformerImpl(const ClipTextConfig& c) {
    embeddings = register_module("embeddings", ClipEmbeddings(c));
    encoder = register_module("encoder", ClipEncoder(c));
    final_layer_norm = register_module(
        "final_layer_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden_size}).eps(c.layer_norm_eps)));
}

void ClipTextModelImpl::set_attention_kernel(kernels::AttentionKernel k) {
    for (auto& layer : text_model->encoder->items) layer->self_attn->kernel = k;
}

ClipTextModelImpl::ClipTextModelImpl(const ClipTextConfig& c) : cfg_(c) {
    text_model = register_module("text_model", ClipTextTransformer(c));
    if (c.projection_dim > 0)
        text_projection = register_module(
            "text_projection", make_linear(torch::nn::LinearOptions(c.hidden_size, c.projection_dim).bias(false)));
}

ClipTextOutput ClipTextModelImpl::forward(const torch::Tensor& input_ids, const std::vector<TokenSplice>& splices) {
    TORCH_CHECK(input_ids.dim() == 2, "CLIP input_ids must be [batch, tokens]");
    const auto T = input_ids.size(1);
    if (T > cfg_.max_position_embeddings)
        throw Error("CLIP text encoder: " + std::to_string(T) + " tokens exceed the " +
                    std::to_string(cfg_.max_position_embeddings) + " positions of the model");
    auto& emb = text_model->embeddings;
    // The encoder runs where its weights are (a GPU with --device cuda); the ids come from the CPU tokenizer.
    auto ids = input_ids.to(emb->token_embedding->weight.device(), torch::kLong);
    auto x = emb->token_embedding->forward(ids);
    for (const auto& s : splices) {
        TORCH_CHECK(s.row >= 0 && s.row < x.size(0) && s.position >= 0 && s.vectors.dim() == 2 &&
                        s.position + s.vectors.size(0) <= T && s.vectors.size(1) == x.size(2),
                    "CLIP token splice out of range: row ", s.row, " position ", s.position, " vectors ",
                    s.vectors.sizes(), " into ", x.sizes());
        x[s.row].narrow(0, s.position, s.vectors.size(0)).copy_(s.vectors);
    }
    x = x + emb->position_embedding->weight.narrow(0, 0, T).unsqueeze(0);
    auto mask = torch::full({T, T}, -std::numeric_limits<float>::infinity(), x.options()).triu(1);
    ClipTextOutput out;
    out.hidden_states.reserve(text_model->encoder->items.size() + 1);
    out.hidden_states.push_back(x);
    for (auto& layer : text_model->encoder->items) {
        x = layer->forward(x, mask);
        out.hidden_states.push_back(x);
    }
    out.last_hidden_state = text_model->final_layer_norm->forward(x);
    return out;
}

torch::Tensor ClipTextModelImpl::encode(const torch::Tensor& input_ids, int clip_skip,
                                        const std::vector<TokenSplice>& splices) {
    if (clip_skip < 0 || clip_skip >= cfg_.num_hidden_layers)
        throw ParamError("clip_skip", "skipping " + std::to_string(clip_skip) +
                                          " layers is out of range for a text encoder with " +
                                          std::to_string(cfg_.num_hidden_layers) + " layers");
    auto out = forward(input_ids, splices);
    // The embeddings go back to the ids' device: the pipeline weights and concatenates them there (prompt_syntax).
    if (clip_skip == 0) return out.last_hidden_state.to(input_ids.device());
    const auto n = out.hidden_states.size();
    return text_model->final_layer_norm->forward(out.hidden_states[n - 1 - size_t(clip_skip)]).to(input_ids.device());
}

torch::Tensor ClipTextModelImpl::pooled(const ClipTextOutput& out, const torch::Tensor& input_ids) {
    const auto eos = input_ids.to(torch::kLong).argmax(-1).to(out.last_hidden_state.device());
    auto rows = torch::arange(out.last_hidden_state.size(0), eos.options());
    auto p = out.last_hidden_state.index({rows, eos});
    return text_projection ? kernels::linear(text_projection, p) : p;
}

ClipConditioning ClipTextModelImpl::encode_penultimate(const torch::Tensor& input_ids, int clip_skip,
                                                        const std::vector<TokenSplice>& splices) {
    if (clip_skip < 0 || clip_skip + 2 > cfg_.num_hidden_layers + 1)
        throw ParamError("clip_skip", "skipping " + std::to_string(clip_skip) +
                                          " layers after the penultimate is out of range for a text encoder with " +
                                          std::to_string(cfg_.num_hidden_layers) + " layers");
    auto out = forward(input_ids, splices);
    const auto n = out.hidden_states.size();
    return {out.hidden_states[n - 2 - size_t(clip_skip)].to(input_ids.device()),
            pooled(out, input_ids).to(input_ids.device())};
}

void ClipTextModelImpl::load(const WeightMap& w) {
    w.load_into(*this, {"text_model\\.embeddings\\.position_ids"});
}

} // namespace anchor::unet
