// CLIP text transformer (Radford et al. 2021) with the Hugging Face `CLIPTextModel` tensor names that SD checkpoints
// use: text_model.embeddings.{token,position}_embedding, text_model.encoder.layers.i.{self_attn.{q,k,v,out}_proj,
// layer_norm1, mlp.fc1, mlp.fc2, layer_norm2}, text_model.final_layer_norm.
#pragma once

#include "kernels/attention.h"

#include <torch/torch.h>

#include <nlohmann/json_fwd.hpp>

#include <string>
#include <vector>

namespace anchor {
class WeightMap;
}

namespace anchor::unet {

struct ClipTextConfig {
    int vocab_size = 49408;
    int hidden_size = 768;
    int intermediate_size = 3072;
    int num_hidden_layers = 12;
    int num_attention_heads = 12;
    int max_position_embeddings = 77;
    std::string hidden_act = "quick_gelu"; // "quick_gelu" (openai CLIP, SD 1.x) | "gelu" (OpenCLIP, SD 2.x)
    double layer_norm_eps = 1e-5;
    // CLIPTextModelWithProjection (SDXL's second encoder): text_projection [projection_dim, hidden] without bias on
    // the pooled output. 0: CLIPTextModel, no projection.
    int projection_dim = 0;

    // HF config.json (`CLIPTextConfig` fields; missing ones keep the defaults).
    static ClipTextConfig from_json(const nlohmann::json& j, const std::string& source = "text encoder config");
    static ClipTextConfig from_json_file(const std::string& path);
    // The HF config.json of this config (what from_json reads back), its fields through the binding from_json reads.
    nlohmann::json to_json() const;
    // Sizes from tensor shapes (names relative to the model root, i.e. starting with `text_model.`). Shapes cannot tell
    // the head count: real CLIP uses head dim 64 (hidden >= 512), tiny test models head dim 8; hidden 1024 means
    // OpenCLIP ViT-H (SD 2.x) with gelu, otherwise quick_gelu.
    static ClipTextConfig detect_from_weights(const WeightMap& w);
};

struct ClipAttentionImpl : torch::nn::Module {
    ClipAttentionImpl(const ClipTextConfig& c);
    torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& mask);
    torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, out_proj{nullptr};
    int heads, head_dim;
    // Exact: Hugging Face's arithmetic with the additive causal mask (the goldens' bits); Fused/Flash: the tiled
    // kernel with its causal mask, the same mask without an N x N buffer (kernels/attention.h).
    kernels::AttentionKernel kernel = kernels::AttentionKernel::Exact;
};
TORCH_MODULE(ClipAttention);

struct ClipMlpImpl : torch::nn::Module {
    ClipMlpImpl(const ClipTextConfig& c);
    torch::Tensor forward(const torch::Tensor& x);
    torch::nn::Linear fc1{nullptr}, fc2{nullptr};
    bool quick_gelu;
};
TORCH_MODULE(ClipMlp);

struct ClipEncoderLayerImpl : torch::nn::Module {
    ClipEncoderLayerImpl(const ClipTextConfig& c);
    torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& mask);
    ClipAttention self_attn{nullptr};
    torch::nn::LayerNorm layer_norm1{nullptr}, layer_norm2{nullptr};
    ClipMlp mlp{nullptr};
};
TORCH_MODULE(ClipEncoderLayer);

struct ClipEmbeddingsImpl : torch::nn::Module {
    ClipEmbeddingsImpl(const ClipTextConfig& c);
    torch::nn::Embedding token_embedding{nullptr}, position_embedding{nullptr};
};
TORCH_MODULE(ClipEmbeddings);

struct ClipEncoderImpl : torch::nn::Module {
    ClipEncoderImpl(const ClipTextConfig& c);
    torch::nn::ModuleList layers;
    std::vector<ClipEncoderLayer> items;
};
TORCH_MODULE(ClipEncoder);

struct ClipTextTransformerImpl : torch::nn::Module {
    ClipTextTransformerImpl(const ClipTextConfig& c);
    ClipEmbeddings embeddings{nullptr};
    ClipEncoder encoder{nullptr};
    torch::nn::LayerNorm final_layer_norm{nullptr};
};
TORCH_MODULE(ClipTextTransformer);

// SDXL's text conditioning from one encoder (diffusers StableDiffusionXLPipeline.encode_prompt): the hidden state
// hidden_states[-(clip_skip + 2)] without the final layer norm, and the pooled embedding: final_layer_norm of the
// last layer at the EOS position (input_ids.argmax(-1), the first end-of-text), through text_projection when the
// model has one (CLIPTextModelWithProjection's text_embeds).
struct ClipConditioning {
    torch::Tensor hidden; // [B, T, hidden]
    torch::Tensor pooled; // [B, projection_dim or hidden]
};

// Input embeddings replaced before the position embeddings are added (textual inversion, unet/model/embeddings.h):
// rows [position, position + n) of batch row `row` of the token-embedding output become `vectors` [n, hidden].
struct TokenSplice {
    int64_t row = 0, position = 0;
    torch::Tensor vectors;
};

struct ClipTextOutput {
    torch::Tensor last_hidden_state;          // final_layer_norm(hidden_states.back())
    std::vector<torch::Tensor> hidden_states; // [0] embeddings, [i] output of layer i (before final_layer_norm)
};

class ClipTextModelImpl : public torch::nn::Module {
public:
    explicit ClipTextModelImpl(const ClipTextConfig& c);
    // input_ids [B, T] int64 -> all hidden states. No padding mask (SD pipelines pass none); causal mask always.
    ClipTextOutput forward(const torch::Tensor& input_ids, const std::vector<TokenSplice>& splices = {});
    // The conditioning an SD pipeline uses. clip_skip (diffusers semantics): 0 -> last_hidden_state;
    // k >= 1 -> final_layer_norm(hidden_states[-(k+1)]).
    torch::Tensor encode(const torch::Tensor& input_ids, int clip_skip = 0, const std::vector<TokenSplice>& splices = {});
    // SDXL's conditioning (ClipConditioning); clip_skip in [0, layers - 2].
    ClipConditioning encode_penultimate(const torch::Tensor& input_ids, int clip_skip = 0,
                                        const std::vector<TokenSplice>& splices = {});
    // final_layer_norm(last layer) at each row's EOS, through text_projection when there is one.
    torch::Tensor pooled(const ClipTextOutput& out, const torch::Tensor& input_ids);
    const ClipTextConfig& config() const { return cfg_; }
    void set_attention_kernel(kernels::AttentionKernel k); // every layer's (ClipAttentionImpl::kernel)
    // Loads HF-named weights (the `text_model.embeddings.position_ids` buffer is ignored whatever its dtype).
    void load(const WeightMap& w);

    ClipTextTransformer text_model{nullptr};
    torch::nn::Linear text_projection{nullptr}; // ClipTextConfig::projection_dim > 0

private:
    ClipTextConfig cfg_;
};
TORCH_MODULE(ClipTextModel);

} // namespace anchor::unet
