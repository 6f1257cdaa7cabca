// Stable Diffusion 3 / 3.5's denoiser: the multimodal diffusion transformer (MMDiT; Esser et al. 2024, "Scaling
// Rectified Flow Transformers for High-Resolution Image Synthesis", sec. 4 and fig. 2), laid out like diffusers'
// SD3Transformer2DModel so that registered module names equal the checkpoint names (pos_embed.proj,
// time_text_embed.timestep_embedder.linear_1, context_embedder, transformer_blocks.i.attn.to_q, norm_out.linear,
// proj_out, ...) and loading is WeightMap::load_into.
//
// The forward: the latent is cut into p x p patches (a strided convolution) plus a 2-D sine-cosine position embedding
// cropped from a pos_embed_max_size^2 grid around its centre; the timestep's sinusoidal embedding plus the pooled text
// embedding, both through two-layer MLPs, form the conditioning vector c; the text tokens are mapped to the model
// width by context_embedder. Each joint block modulates both streams with adaLN-Zero (shift, scale and gate from
// Linear(SiLU(c))), attends over the concatenated [image; text] tokens with separate projections per stream, and adds
// a gated MLP per stream. The last block keeps only the image stream (context_pre_only). SD 3.5 adds an RMSNorm of
// q and k per head (qk_norm "rms_norm") and, in its Medium model, a second self-attention over the image tokens in
// the first blocks (dual_attention_layers, MMDiT-X), modulated by three more adaLN outputs. norm_out (adaLN with
// scale and shift, no gate) and proj_out give p*p*C per token, unpatchified to the latent's shape.
#pragma once

#include "kernels/attention.h"

#include <torch/torch.h>

#include <nlohmann/json_fwd.hpp>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace anchor {
class WeightMap;
}

namespace anchor::unet {

// The per-head normalisation of q and k (diffusers' qk_norm; null or "rms_norm" in SD 3 / 3.5).
enum class QkNorm { None, RmsNorm };

struct SD3TransformerConfig {
    int sample_size = 128; // latent size of training: the position grid's base_size = sample_size / patch_size
    int patch_size = 2;
    int in_channels = 16;
    int out_channels = 16;
    int num_layers = 18;
    int attention_head_dim = 64;
    int num_attention_heads = 18;
    int joint_attention_dim = 4096;         // width of the text encoders' tokens
    int caption_projection_dim = 1152;      // context_embedder's output: the model width (heads x head_dim)
    int pooled_projection_dim = 2048;       // width of the pooled text embedding
    int pos_embed_max_size = 96;            // side of the stored position grid, cropped to the latent's patch grid
    std::vector<int> dual_attention_layers; // blocks with the MMDiT-X second self-attention (SD 3.5 Medium)
    QkNorm qk_norm = QkNorm::None;

    int inner_dim() const { return num_attention_heads * attention_head_dim; }
    bool dual_attention(int block) const;

    // diffusers config.json of SD3Transformer2DModel; an anchor::Error naming the file and key for values this engine
    // does not run (another qk_norm, a caption_projection_dim other than the model width, ...).
    static SD3TransformerConfig from_json(const nlohmann::json& j,
                                          const std::string& source = "SD3 transformer config");
    static SD3TransformerConfig from_json_file(const std::string& path);
    nlohmann::json to_json() const;
    // From diffusers-named tensor shapes (sample_size, which shapes cannot show, stays the default).
    static SD3TransformerConfig detect_from_weights(const WeightMap& w);
};

// The 2-D sine-cosine position embedding of diffusers' get_2d_sincos_pos_embed for a grid x grid patch grid with
// positions i / (grid / base_size): [grid*grid, dim], the first dim/2 channels from the column, the rest from the row,
// each half sin then cos of pos * 10000^(-k / (dim/4)).
torch::Tensor sincos_pos_embed_2d(int64_t dim, int64_t grid, int64_t base_size);

// RMSNorm over the last dimension with a learned gain (Zhang & Sennrich 2019): x / sqrt(mean(x^2) + eps) * weight.
struct RmsNormImpl : torch::nn::Module {
    RmsNormImpl(int64_t dim, double eps);
    torch::Tensor forward(const torch::Tensor& x);
    torch::Tensor weight;
    double eps;
};
TORCH_MODULE(RmsNorm);

// Attention of a joint block: the image stream's to_q/to_k/to_v/to_out and, for a joint attention, the text stream's
// add_q_proj/add_k_proj/add_v_proj/to_add_out (none without the text stream's output: context_pre_only). Returns the
// image tokens' output and the text tokens' output (undefined for self-attention and context_pre_only).
struct JointAttentionImpl : torch::nn::Module {
    JointAttentionImpl(int64_t dim, int64_t heads, int64_t head_dim, bool joint, bool context_pre_only, QkNorm qk_norm);
    std::pair<torch::Tensor, torch::Tensor> forward(const torch::Tensor& x, const torch::Tensor& context = {});
    torch::nn::Linear to_q{nullptr}, to_k{nullptr}, to_v{nullptr}, out_linear{nullptr};
    torch::nn::ModuleList to_out; // [0] Linear (diffusers' to_out.1 is dropout, no weights)
    torch::nn::Linear add_q_proj{nullptr}, add_k_proj{nullptr}, add_v_proj{nullptr}, to_add_out{nullptr};
    RmsNorm norm_q{nullptr}, norm_k{nullptr}, norm_added_q{nullptr}, norm_added_k{nullptr};
    int64_t heads, head_dim;
    kernels::AttentionKernel kernel = kernels::AttentionKernel::Exact;
};
TORCH_MODULE(JointAttention);

// The MLP of each stream: Linear(dim, 4 dim), tanh-approximated GELU, Linear(4 dim, dim) (net.0.proj, net.2).
struct GeluFeedForwardImpl : torch::nn::Module {
    explicit GeluFeedForwardImpl(int64_t dim);
    torch::Tensor forward(const torch::Tensor& x);
    torch::nn::ModuleList net;
    torch::nn::Linear proj{nullptr}, out{nullptr};
};
TORCH_MODULE(GeluFeedForward);

// A Linear(SiLU(c)) producing `chunks` modulation vectors of width dim (diffusers' AdaLayerNormZero: 6,
// SD35AdaLayerNormZeroX: 9, AdaLayerNormContinuous: 2) registered as `linear`.
struct AdaLinearImpl : torch::nn::Module {
    AdaLinearImpl(int64_t dim, int64_t chunks);
    std::vector<torch::Tensor> forward(const torch::Tensor& c); // `chunks` tensors [B, dim]
    torch::nn::Linear linear{nullptr};
    int64_t chunks;
};
TORCH_MODULE(AdaLinear);

struct JointTransformerBlockImpl : torch::nn::Module {
    JointTransformerBlockImpl(int64_t dim, int64_t heads, int64_t head_dim, bool context_pre_only, QkNorm qk_norm,
                              bool dual_attention);
    // x [B, N, dim] image tokens, context [B, T, dim], temb [B, dim] -> (image tokens, text tokens; the latter
    // undefined when context_pre_only).
    std::pair<torch::Tensor, torch::Tensor> forward(const torch::Tensor& x, const torch::Tensor& context,
                                                    const torch::Tensor& temb);
    AdaLinear norm1{nullptr}, norm1_context{nullptr};
    JointAttention attn{nullptr}, attn2{nullptr};
    GeluFeedForward ff{nullptr}, ff_context{nullptr};
    bool context_pre_only, dual_attention;
    int64_t dim;
};
TORCH_MODULE(JointTransformerBlock);

using FeatureMap = std::map<std::string, torch::Tensor>;

// The transformer's state between its stages, for block-level caching (unet/cache/dit_cache.h): the image tokens
// `hs` [B, h*w, dim] and text tokens `ctx` [B, T, dim] after `done` blocks, the conditioning vector `temb` [B, dim]
// and the patch grid. forward() is embed, run_blocks over every block, head, so a caller composing the stages
// computes the same bits.
struct SD3Tokens {
    torch::Tensor hs, ctx, temb;
    int64_t batch = 0, grid_h = 0, grid_w = 0;
    int done = 0; // blocks applied so far
};

class SD3Transformer2DModelImpl : public torch::nn::Module {
public:
    explicit SD3Transformer2DModelImpl(const SD3TransformerConfig& c);
    // x [B, in_channels, H, W] (H, W multiples of patch_size, at most pos_embed_max_size patches a side), context
    // [B, T, joint_attention_dim], pooled [B, pooled_projection_dim], timestep [B] or a single value (float, the
    // scheduler's sigma * 1000) -> [B, out_channels, H, W]. When `f` is given it receives every block's outputs as
    // the golden files name them: "transformer_blocks.<i>.hidden_states" and, except for the last block,
    // "transformer_blocks.<i>.encoder_hidden_states". The blocks listed in `skip_layers` are left out (both streams
    // pass through unchanged), diffusers' skip_layers for skip-layer guidance; ParamError("skip_layers") for an index
    // outside [0, num_layers).
    torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& context, const torch::Tensor& pooled,
                          const torch::Tensor& timestep, FeatureMap* f = nullptr,
                          const std::vector<int>& skip_layers = {});
    const SD3TransformerConfig& config() const { return cfg_; }
    // The stages of forward() (same arguments and checks): patch and position embedding, conditioning and
    // context_embedder; blocks [tok.done, end) (those in `skip_layers` left out, features into `f`); norm_out,
    // proj_out and unpatchify of tok.hs.
    SD3Tokens embed(const torch::Tensor& x, const torch::Tensor& context, const torch::Tensor& pooled,
                    const torch::Tensor& timestep);
    void run_blocks(SD3Tokens& tok, int end, FeatureMap* f = nullptr, const std::vector<int>& skip_layers = {});
    torch::Tensor head(const SD3Tokens& tok);
    // The first block's timestep-modulated image input LayerNorm(hs) * (1 + scale) + shift (adaLN-Zero's attention
    // input; TeaCache's signal), for tokens before any block.
    torch::Tensor first_block_modulated_input(const SD3Tokens& tok);
    void load(const WeightMap& w);
    void set_attention_kernel(kernels::AttentionKernel k); // Exact by default (the reference's formula)

    // pos_embed.{proj, pos_embed (buffer)}, time_text_embed.{timestep_embedder, text_embedder}.{linear_1, linear_2}
    std::shared_ptr<torch::nn::Module> pos_embed_module, time_text_embed, timestep_embedder, text_embedder;
    torch::nn::Conv2d patch_proj{nullptr};
    torch::Tensor pos_embed;
    torch::nn::Linear t_linear_1{nullptr}, t_linear_2{nullptr}, p_linear_1{nullptr}, p_linear_2{nullptr};
    torch::nn::Linear context_embedder{nullptr}, proj_out{nullptr};
    torch::nn::ModuleList transformer_blocks;
    std::vector<JointTransformerBlock> blocks;
    AdaLinear norm_out{nullptr};

private:
    SD3TransformerConfig cfg_;
};
TORCH_MODULE(SD3Transformer2DModel);

// The transformer of an original SD 3 / 3.5 single file (Stability's MMDiT names under `prefix`:
// x_embedder, pos_embed, t_embedder, y_embedder, context_embedder, joint_blocks.N.{x_block, context_block}.{attn
// (fused qkv, proj, ln_q/ln_k), attn2, adaLN_modulation.1, mlp.fc1/fc2}, final_layer) under diffusers' names: q, k, v
// split from qkv, and the (shift, scale) rows of the modulations diffusers keeps as (scale, shift) (the last block's
// context norm and final_layer) swapped. Tensors outside `prefix` are ignored; one under it that no rule takes is an
// anchor::Error listing them all.
WeightMap sd3_transformer_weights_from_single_file(const WeightMap& file,
                                                   const std::string& prefix = "model.diffusion_model.");

// A diffusers SD3Transformer2DModel folder (config.json + diffusion_pytorch_model weights), through the one resolver.
SD3Transformer2DModel load_sd3_transformer_folder(const std::string& dir, torch::ScalarType dtype = torch::kFloat);

} // namespace anchor::unet
