// The encoder of T5 (Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a Unified Text-to-Text
// Transformer"; T5 v1.1's gated-GELU feed-forward), as Hugging Face's T5EncoderModel computes it: SD 3's
// text_encoder_3 (T5-XXL). Tensor names are HF's: shared.weight (encoder.embed_tokens.weight is the same tensor),
// encoder.block.<i>.layer.0.{layer_norm, SelfAttention.{q,k,v,o}}, block.0's SelfAttention.relative_attention_bias,
// encoder.block.<i>.layer.1.{layer_norm, DenseReluDense.{wi_0, wi_1, wo} | {wi, wo}}, encoder.final_layer_norm.
#pragma once

#include <torch/torch.h>

#include <nlohmann/json_fwd.hpp>

#include <string>
#include <vector>

namespace anchor {
class WeightMap;
}

namespace anchor::unet {

struct T5EncoderConfig {
    int vocab_size = 32128;
    int d_model = 4096;
    int d_kv = 64; // per-head width; heads * d_kv need not be d_model
    int d_ff = 10240;
    int num_layers = 24;
    int num_heads = 64;
    int relative_attention_num_buckets = 32;
    int relative_attention_max_distance = 128;
    double layer_norm_epsilon = 1e-6;
    // HF's feed_forward_proj: "gated-gelu" (T5 v1.1, SD 3's T5-XXL: act(wi_0 x) * wi_1 x with gelu_new) or "relu"
    // (the original T5: relu(wi x)); "gated-<act>" / "<act>" with act one of relu, gelu, gelu_new.
    std::string feed_forward_proj = "gated-gelu";

    bool gated() const { return feed_forward_proj.rfind("gated-", 0) == 0; }
    // The activation's name ("gated-gelu" means gelu_new, as HF's T5Config maps it).
    std::string activation() const;

    // HF config.json (T5Config fields; missing ones keep the defaults). Refuses decoders-only configs' fields it does
    // not implement (is_decoder true).
    static T5EncoderConfig from_json(const nlohmann::json& j, const std::string& source = "T5 config");
    static T5EncoderConfig from_json_file(const std::string& path);
    // Sizes from HF-named tensor shapes (a single file's text_encoders.t5xxl.transformer.*, prefix stripped): vocab
    // and d_model from shared.weight, heads and buckets from block 0's relative_attention_bias [buckets, heads],
    // d_kv = q rows / heads, d_ff and gated from wi_0 / wi; what shapes cannot show keeps T5 v1.1's values
    // (relative_attention_max_distance 128, layer_norm_epsilon 1e-6, gelu_new). Throws naming the missing tensor.
    static T5EncoderConfig detect_from_weights(const WeightMap& w);
};

// One self-attention layer: no 1/sqrt(d) scaling of q k^T (T5 folds it into the initialisation), the relative
// position bias added to the scores (the first layer's, shared by all layers), no padding mask (SD 3 passes none).
struct T5AttentionImpl : torch::nn::Module {
    T5AttentionImpl(const T5EncoderConfig& c, bool has_relative_bias);
    torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& position_bias);
    torch::nn::Linear q{nullptr}, k{nullptr}, v{nullptr}, o{nullptr};
    torch::nn::Embedding relative_attention_bias{nullptr}; // [num_buckets, heads], first layer only
    int heads, d_kv;
};
TORCH_MODULE(T5Attention);

// T5's RMSNorm (Zhang & Sennrich 2019): x / sqrt(mean(x^2) + eps) * weight, no mean subtraction, no bias, the
// variance in float32 whatever the input dtype.
struct T5LayerNormImpl : torch::nn::Module {
    T5LayerNormImpl(int dim, double eps);
    torch::Tensor forward(const torch::Tensor& x);
    torch::Tensor weight;
    double eps;
};
TORCH_MODULE(T5LayerNorm);

struct T5FeedForwardImpl : torch::nn::Module {
    explicit T5FeedForwardImpl(const T5EncoderConfig& c);
    torch::Tensor forward(const torch::Tensor& x);
    torch::nn::Linear wi{nullptr}, wi_0{nullptr}, wi_1{nullptr}, wo{nullptr}; // wi (plain) or wi_0/wi_1 (gated)
    std::string act;
};
TORCH_MODULE(T5FeedForward);

class T5EncoderModelImpl : public torch::nn::Module {
public:
    explicit T5EncoderModelImpl(const T5EncoderConfig& c);
    // input_ids [B, T] int64 -> last_hidden_state [B, T, d_model] (final_layer_norm of the last block). `blocks`,
    // when given, receives the embeddings then each block's output (before the final norm).
    torch::Tensor forward(const torch::Tensor& input_ids, std::vector<torch::Tensor>* blocks = nullptr);
    // The [1, heads, T, T] bias of the first layer's buckets (added to every layer's scores).
    torch::Tensor position_bias(int64_t T);
    const T5EncoderConfig& config() const { return cfg_; }
    // HF-named weights (T5EncoderModel's state dict: shared.weight, encoder.*); encoder.embed_tokens.weight, when
    // present, must be shared.weight's tied copy and is not loaded twice.
    void load(const WeightMap& w);

    torch::nn::Embedding shared{nullptr};
    std::vector<T5Attention> attention;
    std::vector<T5LayerNorm> attention_norm, ff_norm;
    std::vector<T5FeedForward> ff;
    T5LayerNorm final_layer_norm{nullptr};

private:
    T5EncoderConfig cfg_;
};
TORCH_MODULE(T5EncoderModel);

// The bidirectional bucket of each relative position (key - query), HF's T5Attention._relative_position_bucket:
// half the buckets per direction; within one, distances below half of them are exact, the rest logarithmic up to
// max_distance, then the last bucket.
torch::Tensor t5_relative_position_bucket(const torch::Tensor& relative_position, int num_buckets, int max_distance);

// A T5EncoderModel folder (config.json + model.safetensors or a sharded index) through the one resolver.
T5EncoderModel load_t5_encoder_folder(const std::string& dir, torch::ScalarType dtype = torch::kFloat);

} // namespace anchor::unet
