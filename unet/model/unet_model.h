// Stable Diffusion's conditional UNet (Rombach et al. 2022, "High-Resolution Image Synthesis with Latent Diffusion
// Models"), laid out exactly like diffusers' UNet2DConditionModel so that registered module names equal the checkpoint
// names (conv_in, time_embedding.linear_1, down_blocks.i.resnets.j, ..., conv_out) and loading is WeightMap::load_into.
//
// The forward loop is written over "layers" (resnet+attention pairs and samplers) rather than nested block forwards
// so that a feature cache can stop early: forward_shallow() implements DeepCache (Ma et al. 2023) for any branch.
#pragma once

#include "kernels/attention.h"
#include "unet/model/unet_perf.h"

#include <torch/torch.h>

#include <nlohmann/json_fwd.hpp>

#include <array>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace anchor {
class WeightMap;
}

namespace anchor::unet {

// Multi-head scaled dot-product attention of the UNet and VAE (diffusers' AttnProcessor): q [B, N, C], k/v [B, M, C]
// -> [B, N, C], scale head_dim^-0.5, through kernels::attention with `kernel` (the reference ops when the module fast
// paths are off, unet_perf.h).
// bf16_products: the tiled kernel's products on bfloat16 operands (AttentionOptions::bf16_products; --gemm bf16).
torch::Tensor multi_head_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                   int64_t heads, kernels::AttentionKernel kernel = kernels::AttentionKernel::Exact,
                                   bool fast = true, bool bf16_products = false);

// ---- building blocks shared with the VAE ----------------------------------------------------------------------------

struct ResnetBlock2DImpl : torch::nn::Module, perf::FastPaths {
    // temb_channels <= 0: no time embedding projection (VAE).
    ResnetBlock2DImpl(int64_t in, int64_t out, int64_t temb_channels, int64_t groups, double eps);
    // temb_act: silu(temb) (already activated, computed once per UNet call), or undefined.
    // x moved in (its only reference) lets the oneDNN paths normalise it in place.
    torch::Tensor forward(torch::Tensor x, const torch::Tensor& temb_act);
    torch::nn::GroupNorm norm1{nullptr}, norm2{nullptr};
    torch::nn::Conv2d conv1{nullptr}, conv2{nullptr}, conv_shortcut{nullptr};
    torch::nn::Linear time_emb_proj{nullptr};
};
TORCH_MODULE(ResnetBlock2D);

struct Downsample2DImpl : torch::nn::Module, perf::FastPaths {
    // padding 1 (UNet) or 0 with an asymmetric (0,1,0,1) pad first (VAE encoder).
    Downsample2DImpl(int64_t channels, int64_t padding);
    torch::Tensor forward(const torch::Tensor& x);
    torch::nn::Conv2d conv{nullptr};
    int64_t padding;
};
TORCH_MODULE(Downsample2D);

struct Upsample2DImpl : torch::nn::Module, perf::FastPaths {
    explicit Upsample2DImpl(int64_t channels);
    // Nearest 2x (or to `size` when given: diffusers' upsample_size for odd shapes), then a 3x3 conv.
    torch::Tensor forward(const torch::Tensor& x, c10::optional<std::vector<int64_t>> size = c10::nullopt);
    torch::nn::Conv2d conv{nullptr};
};
TORCH_MODULE(Upsample2D);

// ---- transformer -------------------------------------------------------------------------------------------------

struct CrossAttentionImpl : torch::nn::Module, perf::FastPaths {
    CrossAttentionImpl(int64_t query_dim, int64_t context_dim, int64_t heads, int64_t head_dim);
    torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& context); // context undefined: self-attention
    torch::nn::Linear to_q{nullptr}, to_k{nullptr}, to_v{nullptr};
    torch::nn::ModuleList to_out;          // [0] Linear (to_out.1 is dropout in diffusers and has no weights)
    torch::nn::Linear out_linear{nullptr}; // = to_out[0]
    int64_t heads;
    kernels::AttentionKernel kernel = kernels::AttentionKernel::Exact; // the model's choice (set_attention_kernel)

    // Prompt K/V reuse: the text context is the same tensor at every denoising step, so to_k(context) and
    // to_v(context) are too. While enabled (UNet2DConditionModelImpl::ContextKvScope), the first call with a context
    // stores its K/V and later calls with the same tensor (identity: the stored handle keeps its storage alive, so it
    // cannot be another context at the same address) reuse them. Exact: the same products, computed once.
    void set_context_kv_reuse(bool on);
    int64_t context_kv_hits() const { return kv_hits_; }

    // Fused QKV (LoadOptions::fused_qkv): a self-attention call projects x once through cat(W_q, W_k, W_v), one
    // matrix product three times as wide instead of three (fewer launches and a better-shaped GEMM on a GPU). The
    // fused matrix is built from the current weights and built again when any of them was replaced or changed in
    // place (a LoRA merged later, a dtype or device move). Cross-attention (another context) keeps its projections.
    void set_fused_qkv(bool on);
    bool fused_qkv() const { return fused_; }

private:
    std::array<torch::Tensor, 3> fused_projection(const torch::Tensor& x);
    bool fused_ = false;
    torch::nn::Linear qkv_{nullptr};
    std::array<const void*, 3> qkv_src_{};
    std::array<uint32_t, 3> qkv_version_{};
    bool kv_reuse_ = false;
    int64_t kv_hits_ = 0;
    torch::Tensor kv_ctx_, k_ctx_, v_ctx_;
};
TORCH_MODULE(CrossAttention);

struct GegluImpl : torch::nn::Module, perf::FastPaths {
    GegluImpl(int64_t dim_in, int64_t dim_out);
    torch::Tensor forward(const torch::Tensor& x);
    torch::nn::Linear proj{nullptr};
};
TORCH_MODULE(Geglu);

struct FeedForwardImpl : torch::nn::Module, perf::FastPaths {
    FeedForwardImpl(int64_t dim, int64_t mult = 4);
    torch::Tensor forward(const torch::Tensor& x);
    torch::nn::ModuleList net; // net.0 = GEGLU, net.1 = dropout (no weights), net.2 = Linear
    Geglu geglu{nullptr};
    torch::nn::Linear out{nullptr};
};
TORCH_MODULE(FeedForward);

struct BasicTransformerBlockImpl : torch::nn::Module, perf::FastPaths {
    BasicTransformerBlockImpl(int64_t dim, int64_t heads, int64_t head_dim, int64_t context_dim);
    torch::Tensor forward(torch::Tensor x, const torch::Tensor& context);
    torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr}, norm3{nullptr};
    CrossAttention attn1{nullptr}, attn2{nullptr};
    FeedForward ff{nullptr};
};
TORCH_MODULE(BasicTransformerBlock);

struct Transformer2DModelImpl : torch::nn::Module, perf::FastPaths {
    Transformer2DModelImpl(int64_t channels, int64_t heads, int64_t depth, int64_t context_dim, int64_t groups,
                           bool linear_projection);
    // `tap`, when given, sees the output of each submodule by its name (FeatureId::part).
    using Tap = std::function<void(const char* part, const torch::Tensor&)>;
    torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& context, const Tap& tap = {});
    torch::nn::GroupNorm norm{nullptr};
    torch::nn::Conv2d proj_in_conv{nullptr}, proj_out_conv{nullptr};
    torch::nn::Linear proj_in_linear{nullptr}, proj_out_linear{nullptr};
    torch::nn::ModuleList transformer_blocks;
    std::vector<BasicTransformerBlock> blocks;
    bool linear_projection;
};
TORCH_MODULE(Transformer2DModel);

// ---- UNet --------------------------------------------------------------------------------------------------------

struct UNetConfig {
    int sample_size = 64;
    int in_channels = 4;
    int out_channels = 4;
    std::vector<std::string> down_block_types{"CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D",
                                              "DownBlock2D"};
    std::vector<std::string> up_block_types{"UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D",
                                            "CrossAttnUpBlock2D"};
    std::vector<int> block_out_channels{320, 640, 1280, 1280};
    std::vector<int> layers_per_block{2, 2, 2, 2}; // per down block (up blocks have one more)
    std::vector<int> heads{8, 8, 8, 8};            // per down block; mid uses heads.back()
    std::vector<int> transformer_layers_per_block{1, 1, 1, 1};
    int cross_attention_dim = 768;
    bool use_linear_projection = false;
    bool upcast_attention = false; // only matters in reduced precision; softmax is always float32 there
    int norm_num_groups = 32;
    double norm_eps = 1e-5;
    bool flip_sin_to_cos = true;
    double freq_shift = 0.0;
    bool mid_block = true; // UNetMidBlock2DCrossAttn (false: mid_block_type null)
    // SDXL's added conditioning (diffusers addition_embed_type "text_time"; Podell et al. 2023, "SDXL", sec. 2.2):
    // each micro-conditioning value embedded sinusoidally to addition_time_embed_dim, concatenated after the pooled
    // text embedding (projection_class_embeddings_input_dim = pooled width + n_values * addition_time_embed_dim)
    // and mapped by add_embedding to the time-embedding width, where it is added. 0: none (SD 1.x / 2.x).
    int addition_time_embed_dim = 0;
    int projection_class_embeddings_input_dim = 0;
    bool text_time() const { return addition_time_embed_dim > 0; }
    // Latent consistency models (Luo et al. 2023, sec. 4.2; diffusers time_cond_proj_dim): the guidance scale w is an
    // input, its sinusoidal embedding (guidance_scale_embedding) mapped by time_embedding.cond_proj (no bias) and
    // added to the time embedding's input. 0: none.
    int time_cond_proj_dim = 0;

    // diffusers config.json (attention_head_dim is the head COUNT when num_attention_heads is unset).
    static UNetConfig from_json(const nlohmann::json& j, const std::string& source = "UNet config");
    static UNetConfig from_json_file(const std::string& path);
    // The diffusers config.json of this config (what from_json reads back; SD 1.x naming: the head counts as
    // attention_head_dim), its plain fields through the binding from_json reads.
    nlohmann::json to_json() const;
    // Empty per-block lists for a detector to fill from tensor shapes.
    static UNetConfig blank(int in_channels, int out_channels);
    // The fields both detectors (diffusers and LDM names) derive the same way once the blocks are read: the
    // cross-attention width (`cross`, or the mid block's attn2 to_k when the blocks had none), the projection kind,
    // the mid block and the head counts (sd_family's rule).
    void finish_detection(const WeightMap& w, const std::string& mid_attn2_to_k, const std::string& mid_resnet,
                          int cross, bool linear);
    // From diffusers-named tensor shapes only. Head counts are not visible in shapes: SD 2.x layouts (linear
    // projections or cross-attention width 1024) get head dim 64 per block, SD 1.x layouts 8 heads everywhere.
    static UNetConfig detect_from_weights(const WeightMap& w);
    // Latent downscaling of the UNet (2^number of downsamplers); latent sizes must be multiples of it... or not:
    // diffusers handles odd sizes through upsample sizes, and so do we.
    int num_levels() const { return int(block_out_channels.size()); }
    std::string describe() const;
};

// The attention arithmetic a model gets when neither LoadOptions nor a folder's anchorcache.json chooses one: Fused
// (the small-head and tiled kernels, within 2e-6 relative of the reference) when every GroupNorm group of the UNet
// holds at least 8 channels, as in the published SD 1.x / 2.x / XL checkpoints (320 / 32 = 10); Exact (the
// reference's bits) for narrower ones, such as the tiny reference models, whose GroupNorm over 1-2 channels at their
// 1x1 levels amplifies a last-bit difference ~1000x (tests/golden/sd/README.md).
kernels::AttentionKernel default_attention_kernel(const UNetConfig& c);
// The GEMM backend that goes with an attention choice: LibTorch (the reference's bits) for Exact/Reference, whose
// models must match their reference outputs bit for bit; oneDNN's inference kernels (kernels/onednn.h) with the wide
// 3x3 convolutions in Winograd form (kernels/winograd.h) for the fast attention kernels, where this build has them.
kernels::GemmBackend default_gemm_backend(kernels::AttentionKernel attention);

struct UNetCond;

// Residuals added to the UNet's skip connections and to its mid block's output: diffusers'
// down_block_additional_residuals / mid_block_additional_residual, what a ControlNet (Zhang et al. 2023, "Adding
// Conditional Control to Text-to-Image Diffusion Models", sec. 3.2) produces. down[k] is added to skip k (k = 0 is
// conv_in's output) where an up layer consumes it, mid to the mid block's output; undefined entries add nothing.
struct SkipResiduals {
    std::vector<torch::Tensor> down;
    torch::Tensor mid;
    bool empty() const { return down.empty() && !mid.defined(); }
    // this + other, entry by entry (several ControlNets add, as diffusers' MultiControlNetModel).
    SkipResiduals plus(const SkipResiduals& other) const;
    SkipResiduals index_select(const torch::Tensor& idx) const;
    SkipResiduals to(const torch::Device& d) const;
};

// Residuals computed for the rows and timestep of the call that needs them (a ControlNet): the UNet asks for the
// first `skips` down residuals (a DeepCache shallow step consumes only skips 0..B) and the mid one when it runs its
// mid block, so a model that does not run (a reused step) computes nothing.
class ResidualSource {
public:
    virtual ~ResidualSource() = default;
    virtual SkipResiduals residuals(const torch::Tensor& sample, const torch::Tensor& timestep, const UNetCond& cond,
                                    int skips, bool mid) const = 0;
    // The same source for rows `idx` of the batch (UNetCond::index_select).
    virtual std::shared_ptr<const ResidualSource> index_select(const torch::Tensor& idx) const = 0;
};

// What the UNet is conditioned on besides the timestep. SD 1.x / 2.x: the text context [B, T, D] of the
// cross-attentions (a Tensor converts to it). SDXL (UNetConfig::text_time): also the pooled text embedding
// text_embeds [B, P] and the micro-conditioning time_ids [B, k] (original size, crop top-left, target size; k = 6).
struct UNetCond {
    UNetCond() = default;
    UNetCond(torch::Tensor ctx) : context(std::move(ctx)) {} // NOLINT(google-explicit-constructor): the SD 1.x case
    UNetCond(torch::Tensor ctx, torch::Tensor text, torch::Tensor ids)
        : context(std::move(ctx)), text_embeds(std::move(text)), time_ids(std::move(ids)) {}
    torch::Tensor context, text_embeds, time_ids;
    // LCM UNets (UNetConfig::time_cond_proj_dim): the guidance embedding [B, time_cond_proj_dim]; undefined: none
    // added (as diffusers with timestep_cond None).
    torch::Tensor timestep_cond;
    // Added to the skip connections (SkipResiduals), given as tensors and/or computed per call by `control`.
    SkipResiduals residuals;
    std::shared_ptr<const ResidualSource> control;
    UNetCond to(const torch::Device& d) const;
    // Rows `idx` of every tensor (a per-image slice of a CFG batch).
    UNetCond index_select(const torch::Tensor& idx) const;
};

// An intermediate tensor of the UNet forward. name() is its diffusers module path as in
// tests/golden/sd/unet_sd15_tiny: time_proj, time_embedding, conv_in, down_blocks.i.hidden,
// down_blocks.i.res_samples.k, mid_block, up_blocks.i, conv_norm_out, conv_out, and the per-layer (inner()) features
// down_blocks.i.resnets.j / attentions.j / downsamplers.0, mid_block.resnets.j / attentions.0, up_blocks.i.resnets.j
// / attentions.j / upsamplers.0. UpSkipInput (index = skip k) is the input of the up layer consuming skip k, before
// the concatenation: the feature DeepCache keeps for branch k.
enum class FeatureKind {
    TimeProj,
    TimeEmbedding,
    AddTimeProj,  // SDXL: the sinusoidal embedding of the flattened time ids [B * k, addition_time_embed_dim]
    AddEmbedding, // SDXL: add_embedding(cat(text_embeds, time embeds)) [B, temb]
    TembPlusAug,  // SDXL: time_embedding + add_embedding, what every resnet gets
    ConvIn,
    DownResnet,
    DownAttention,
    Downsampler,
    DownHidden,
    DownResSample,
    MidResnet,
    MidAttention,
    Mid,
    UpSkipInput,
    UpResnet,
    UpAttention,
    Upsampler,
    Up,
    ConvNormOut,
    ConvOut,
};
struct FeatureId {
    FeatureKind kind;
    int block = -1; // down/up block (-1: none)
    int index = -1; // layer within the block, res sample, mid layer, or skip (UpSkipInput)
    // Inside an attention (Down/Mid/UpAttention): the Transformer2DModel's submodule, "norm", "proj_in",
    // "transformer_blocks.k", "proj_out"; null for the attention's output.
    const char* part = nullptr;
    bool inner() const; // a per-layer feature (resnets, attentions, samplers)
    std::string name() const;
};

// The forward reports each feature as it computes it (the tensors are the forward's own, no copies); a model without
// an observer does nothing more than compute.
class FeatureObserver {
public:
    virtual ~FeatureObserver() = default;
    virtual void on_feature(const FeatureId& id, const torch::Tensor& t) = 0;
};

// Keeps the feature DeepCache caches for `branch` (UpSkipInput of that skip).
class SkipFeatureCapture : public FeatureObserver {
public:
    explicit SkipFeatureCapture(int branch) : branch_(branch) {}
    void on_feature(const FeatureId& id, const torch::Tensor& t) override {
        if (id.kind == FeatureKind::UpSkipInput && id.index == branch_) feature = t;
    }
    torch::Tensor feature;

private:
    int branch_;
};

// A hook point on the attention layers (Transformer2DModel) of a forward, for caches that skip them. A transformer is
// residual (output = input + proj_out(...)): before a layer runs, reuse() may hand a residual r, and the layer's output
// is input + r without running it; after a layer runs, computed() sees its input and output.
class AttentionHook {
public:
    virtual ~AttentionHook() = default;
    // The residual to add to `input` in place of layer `layer`; undefined: run the layer.
    virtual torch::Tensor reuse(const FeatureId& layer, const torch::Tensor& input) = 0;
    virtual void computed(const FeatureId& layer, const torch::Tensor& input, const torch::Tensor& output) = 0;
};

// Every feature by name (golden feature checks, tests); with record_inner the per-layer ones too. cache_branch >= 0
// also keeps that branch's DeepCache feature in cache_feature.
struct UNetFeatures : FeatureObserver {
    bool record_inner = false;
    int cache_branch = -1;
    std::map<std::string, torch::Tensor> named;
    torch::Tensor cache_feature;
    void on_feature(const FeatureId& id, const torch::Tensor& t) override;
};

// One level of the UNet ((CrossAttn)DownBlock2D / (CrossAttn)UpBlock2D): resnets, the transformers of a cross-attention
// level, and a sampler registered as `downsamplers` (down levels) or `upsamplers` (up levels).
struct UNetBlockImpl : torch::nn::Module {
    torch::nn::ModuleList resnets, attentions, samplers;
    std::vector<ResnetBlock2D> res;
    std::vector<Transformer2DModel> attn;
    Downsample2D down{nullptr};
    Upsample2D up{nullptr};
};
TORCH_MODULE(UNetBlock);

struct UNetMidBlockImpl : torch::nn::Module {
    torch::nn::ModuleList resnets, attentions;
    std::vector<ResnetBlock2D> res;
    std::vector<Transformer2DModel> attn;
};
TORCH_MODULE(UNetMidBlock);

struct TimestepEmbeddingImpl : torch::nn::Module {
    // cond_dim > 0: a cond_proj (cond_dim -> in, no bias) whose output forward adds to x (diffusers' TimestepEmbedding
    // with cond_proj_dim).
    TimestepEmbeddingImpl(int64_t in, int64_t dim, int64_t cond_dim = 0);
    torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& condition = {});
    torch::nn::Linear linear_1{nullptr}, linear_2{nullptr}, cond_proj{nullptr};
};
TORCH_MODULE(TimestepEmbedding);

// Sinusoidal timestep embedding exactly as diffusers' get_timestep_embedding (float32): t [B] -> [B, dim].
torch::Tensor timestep_embedding(const torch::Tensor& t, int64_t dim, bool flip_sin_to_cos, double freq_shift);
// The guidance-scale embedding of LCM UNets exactly as diffusers' LatentConsistencyModelPipeline
// get_guidance_scale_embedding (float32): w [B] -> [sin(1000 w f_k), cos(1000 w f_k)], f_k = 10000^(-k / (dim/2 - 1)),
// zero-padded to an odd dim. The pipelines give it w = guidance_scale - 1.
torch::Tensor guidance_scale_embedding(const torch::Tensor& w, int64_t dim);

class UNet2DConditionModelImpl : public torch::nn::Module, public perf::FastPaths {
public:
    // decoder false: the time embedding, conv_in, the down blocks and the mid block only (a ControlNet's encoder).
    explicit UNet2DConditionModelImpl(const UNetConfig& cfg, bool decoder = true);

    // sample [B, C, H, W]; timestep: 0-dim (broadcast) or [B], integer or floating; context [B, T, D].
    // `stem`, when given, is conv_in(sample) as stem() computes it: a cache probe that has looked at it already hands
    // it over instead of the UNet computing it a second time.
    // `attention`: see AttentionHook.
    torch::Tensor forward(const torch::Tensor& sample, const torch::Tensor& timestep, const UNetCond& cond,
                          FeatureObserver* features = nullptr, const torch::Tensor& stem = {},
                          AttentionHook* attention = nullptr);
    // DeepCache shallow path for `branch` B: conv_in, time embedding, the down layers producing skips 0..B, then only
    // the up layers consuming skips B..0, starting from `cached_feature` (the full forward's UpSkipInput of skip B,
    // see SkipFeatureCapture). Branch 0: up_blocks[-1]'s last resnet+attention pair and the output head.
    torch::Tensor forward_shallow(const torch::Tensor& sample, const torch::Tensor& timestep, const UNetCond& cond,
                                  int branch, const torch::Tensor& cached_feature, const torch::Tensor& stem = {},
                                  AttentionHook* attention = nullptr);
    // The attention layers forward_shallow(.., branch, ..) runs (DownAttention / UpAttention ids), in forward order.
    std::vector<FeatureId> shallow_attention_layers(int branch) const;
    // conv_in(sample) exactly as the forwards compute it (the first skip tensor; what the cache probes look at).
    torch::Tensor stem(const torch::Tensor& sample);
    // Number of skip tensors (conv_in + every down layer + every downsampler): valid branches are 0..n-1.
    int num_skips() const;
    // For the length of one sampling loop, every cross-attention computes the prompt's K/V once (see CrossAttention).
    class ContextKvScope {
    public:
        explicit ContextKvScope(UNet2DConditionModelImpl& unet);
        ~ContextKvScope();
        ContextKvScope(const ContextKvScope&) = delete;
        ContextKvScope& operator=(const ContextKvScope&) = delete;

    private:
        std::vector<CrossAttentionImpl*> attn_;
    };
    std::vector<CrossAttentionImpl*> cross_attentions(); // every attn2 (the text cross-attentions)
    // The attention arithmetic of every attention layer (kernels/attention.h); Exact unless the model asks otherwise.
    void set_attention_kernel(kernels::AttentionKernel k);
    // Every transformer block's self-attention projects through one fused QKV matrix (CrossAttentionImpl::set_fused_qkv).
    void set_fused_qkv(bool on);
    // Fast paths (unet_perf.h) on every module, or the plain module forwards (the reference; training).
    void set_fast_paths(bool on);
    const UNetConfig& config() const { return cfg_; }
    // The default image size only (no weight depends on it): a single file's config is read from shapes, which do
    // not show it.
    void set_sample_size(int s) { cfg_.sample_size = s; }
    void load(const WeightMap& w);

    torch::nn::Conv2d conv_in{nullptr}, conv_out{nullptr};
    TimestepEmbedding time_embedding{nullptr};
    TimestepEmbedding add_embedding{nullptr}; // SDXL text_time conditioning (UNetConfig::text_time)
    torch::nn::ModuleList down_blocks, up_blocks;
    UNetMidBlock mid_block{nullptr};
    torch::nn::GroupNorm conv_norm_out{nullptr};
    std::vector<UNetBlock> downs, ups;

protected:
    // The encoder half of a forward: `stem` (or conv_in(sample)), the down layers producing skips 1..skips-1 and, with
    // `mid`, the mid block. What a ControlNet runs (diffusers' ControlNetModel shares these blocks' code).
    struct Encoding {
        std::vector<torch::Tensor> skips;
        torch::Tensor mid;
    };
    Encoding encode(const torch::Tensor& sample, const torch::Tensor& timestep, const UNetCond& cond,
                    const torch::Tensor& stem, int skips, bool mid);

private:
    torch::Tensor run(const torch::Tensor& sample, const torch::Tensor& timestep, const UNetCond& cond,
                      FeatureObserver* obs, int shallow_branch, const torch::Tensor& cached, const torch::Tensor& stem,
                      AttentionHook* hook, Encoding* encoding = nullptr);
    // The forward as a walk over layers: each down layer produces one skip (skip 0 is conv_in's output), each up
    // layer consumes one, last skip first. A DeepCache shallow step walks the down layers producing skips 1..B and
    // the up layers consuming skips B..0.
    struct DownLayer {
        int block, index;     // resnet(+attention) `index` of down block `block`, or its downsampler
        bool downsampler;     // (index 0)
        int block_first_skip; // the first skip this block produces
        bool last_in_block;
    };
    struct UpLayer {
        int block, index; // resnet(+attention) `index` of up block `block`
        bool last_in_block;
    };
    void check_branch(int branch) const; // a DeepCache branch of this UNet, else an error naming the range
    std::vector<DownLayer> down_layers() const;
    std::vector<UpLayer> up_layers() const;
    UNetConfig cfg_;
};
TORCH_MODULE(UNet2DConditionModel);

} // namespace anchor::unet
