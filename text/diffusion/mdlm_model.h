// Masked diffusion language model (MDLM, Sahoo et al. 2024; backbone of SEDD, Lou et al. 2024): a bidirectional
// DiT-style transformer over GPT-2 BPE ids plus one [MASK] token, conditioned on the diffusion time.
//
// Block i (x: residual stream [B, L, D], c: conditioning vector [B, C] from the time embedding):
//     (shift1, scale1, shift2, scale2[, gate1, gate2]) = blocks.i.adaLN_modulation(c)
//     h  = norm1(x) * (1 + scale1) + shift1
//     x += g_attn(t) * attn_out(attention(rope(q), rope(k), v)),   q, k, v = attn_qkv(h)
//     h  = norm2(x) * (1 + scale2) + shift2
//     x += g_ffn(t) * mlp.2(gelu_tanh(mlp.0(h)))
// The gates are either the time-anchor gates g(t) = sigmoid(W_e E(t) + b_e), one per channel and branch
// (`blocks.i.gate_attn`, `blocks.i.gate_ffn`, E(t) = c), or SEDD/MDLM's plain gates (chunks 2 and 5 of the 6-way
// adaLN output). Both depend on t only, which is what lets the cross-step cache (text/diffusion/mdlm_cache.h) re-apply the
// current step's gate to a cached branch output exactly.
//
// Checkpoint names (ours = SEDD's `SEDD` module = MDLM's `DIT` backbone; MDLM's Hugging Face checkpoint
// `kuleshov-group/mdlm-owt` prefixes everything with `backbone.`, which the loader strips):
//
// | ours                                   | shape              | SEDD / MDLM                                   |
// |----------------------------------------|--------------------|-----------------------------------------------|
// | vocab_embed.embedding                  | [V, D]             | vocab_embed.embedding                         |
// | sigma_map.mlp.0.weight / .bias         | [C, 256] / [C]     | sigma_map.mlp.0 (TimestepEmbedder)            |
// | sigma_map.mlp.2.weight / .bias         | [C, C] / [C]       | sigma_map.mlp.2                               |
// | blocks.i.norm1.weight, norm2.weight    | [D]                | same (LayerNorm without bias)                 |
// | blocks.i.attn_qkv.weight               | [3D, D]            | same (no bias; q, k, v stacked, heads inside) |
// | blocks.i.attn_out.weight               | [D, D]             | same (no bias)                                |
// | blocks.i.mlp.0.weight / .bias          | [rD, D] / [rD]     | same                                          |
// | blocks.i.mlp.2.weight / .bias          | [D, rD] / [D]      | same                                          |
// | blocks.i.adaLN_modulation.weight/.bias | [6D, C] (adaln)    | same: shift/scale/gate msa, shift/scale/gate mlp |
// |                                        | [4D, C] (anchor)   | not in SEDD: shift1, scale1, shift2, scale2   |
// | blocks.i.gate_attn / gate_ffn .weight/.bias | [D, C] / [D]  | not in SEDD (time-anchor gates)               |
// | output_layer.norm_final.weight         | [D]                | same                                          |
// | output_layer.adaLN_modulation.weight/.bias | [2D, C] / [2D] | same (shift, scale)                           |
// | output_layer.linear.weight / .bias     | [V, D] / [V]       | same (weight absent when tied to vocab_embed) |
// | vocab_ids                              | [V] int64          | not in SEDD: only in compact-vocabulary models |
//
// SEDD/MDLM buffers `blocks.i.attn.rotary_emb.inv_freq` and `rotary_emb.*` are ignored (rope is recomputed).
// MDLM's published checkpoint has V = 50258 (GPT-2 + [MASK] at 50257). Its config.json is Hugging Face's MDLMConfig
// (configuration_mdlm.py): vocab_size, model_length, hidden_dim, cond_dim, n_blocks, n_heads, dropout,
// time_conditioning, and no gate key (its blocks are the 6-way adaLN ones). With `time_conditioning: false` (mdlm-owt)
// the backbone was trained on sigma = 0 (modeling_mdlm.py zeroes sigma before sigma_map), so conditioning() does too.
// LLaDA (LLaMA-style causal-free decoder) and Dream (Qwen2 decoder) checkpoints are rejected by name: they have no
// time conditioning, use RMSNorm + SwiGLU and grouped K/V, none of which this DiT implements.
//
// Compact vocabulary: a model trained on a small corpus may keep only the V tokens it saw (`vocab_ids` maps internal
// id -> GPT-2 id; the last one is [MASK]); ids are translated at the edges by `to_internal` / `to_external`.
#pragma once

#include "cache/io/enum_table.h"

#include "kernels/attention.h"
#include "kernels/onednn.h"
#include "text/params.h"

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace anchor {
class WeightMap;
}

namespace anchor::text {

constexpr int64_t kGpt2VocabSize = 50257;
constexpr int64_t kMdlmMaskId = 50257; // GPT-2 ids 0..50256, then [MASK]

enum class GateKind { TimeAnchor, AdaLN };
const char* gate_kind_name(GateKind g);
const EnumTable<GateKind>& gate_kind_table(); // "time_anchor", "adaln"

struct MdlmConfig {
    int64_t vocab_size = kGpt2VocabSize + 1; // rows of the embedding / head (== vocab_ids length when compact)
    int64_t mask_token_id = kMdlmMaskId;     // GPT-2-side id of [MASK]
    int64_t hidden_size = 768;
    int64_t n_heads = 12;
    int64_t n_blocks = 12;
    int64_t cond_dim = 128;
    int64_t mlp_ratio = 4;
    int64_t freq_embed_size = 256;
    int64_t max_seq_len = 1024;
    double rope_base = 10000.0;
    double norm_eps = 1e-5;
    double noise_eps = 1e-3; // log-linear schedule: sigma(t) = -log(1 - (1 - eps) t)
    GateKind gate = GateKind::TimeAnchor;
    bool tie_word_embeddings = false;
    bool compact_vocab = false; // `vocab_ids` buffer present
    // false: the model ignores t (fed sigma = 0, as mdlm-owt was trained; Sahoo et al. 2024 sec. 3.5.1 find time
    // conditioning unnecessary for masked diffusion).
    bool time_conditioning = true;

    int64_t head_dim() const { return hidden_size / n_heads; }
    void validate() const; // throws anchor::Error

    nlohmann::json to_json() const;
    // Our config.json, or Hugging Face's MDLMConfig layout (recognised by its `hidden_dim` key).
    static MdlmConfig from_json(const nlohmann::json& j, const std::string& source = "MDLM config");
    static MdlmConfig load(const std::string& path); // config.json
    // Shapes only; n_heads (not visible in shapes) comes from `n_heads_hint` or D / 64.
    static MdlmConfig detect_from_weights(const WeightMap& w, int64_t n_heads_hint = 0);
};

// LayerNorm with a weight and no bias (SEDD's `LayerNorm`).
struct NormNoBiasImpl : torch::nn::Module {
    NormNoBiasImpl(int64_t dim, double eps);
    torch::Tensor forward(const torch::Tensor& x);
    torch::Tensor weight;
    double eps;
};
TORCH_MODULE(NormNoBias);

// Per-step modulation of one block, from c. Every tensor is [B, 1, D] so it broadcasts over positions.
struct BlockModulation {
    torch::Tensor shift1, scale1, shift2, scale2;
    torch::Tensor gate_attn, gate_ffn;
};

// Everything a denoising step derives from t alone (batch 1 or [B]): the conditioning c, every block's modulation,
// the head's adaLN shift/scale and its bias with [MASK] at -inf. A sampler revisits the same t in every
// semi-autoregressive block (t runs 1 .. 1/S in each), so the cache keeps it per t (text/diffusion/mdlm_cache.h).
struct StepConditioning {
    torch::Tensor c;
    std::vector<BlockModulation> blocks;
    torch::Tensor head_shift, head_scale, head_bias;
};

// Rotary tables for given positions: cos/sin [n, head_dim] (rotate-half convention, as SEDD/MDLM).
struct Rope {
    torch::Tensor cos, sin;
    Rope select(const torch::Tensor& positions) const; // rows at `positions` (int64 [n])
};

// What a cross-step cached block forward reads and writes (text/diffusion/mdlm_cache.h keeps them in its latent store): for
// every position of the sequence (batch 1), K and V [H, L, d] and the attention and ungated FFN branch outputs Attn,
// Ffn [L, D].
enum class BlockLatent : int32_t { K = 0, V = 1, Attn = 2, Ffn = 3 };
class BlockLatents {
public:
    virtual ~BlockLatents() = default;
    // The tensor of every position (anchored rows are read from it), after the writes of this forward.
    virtual torch::Tensor read(BlockLatent which) = 0;
    // Rows `idx` (int64 [n]): K/V [H, n, d], Attn/Ffn [n, D].
    virtual void write(BlockLatent which, const torch::Tensor& idx, const torch::Tensor& rows) = 0;
};

struct MdlmBlockImpl : torch::nn::Module {
    MdlmBlockImpl(const MdlmConfig& cfg);

    BlockModulation modulation(const torch::Tensor& c) const;
    // h = norm1(x) (1 + scale1) + shift1, for x [B, n, D].
    torch::Tensor attn_input(const torch::Tensor& x, const BlockModulation& m);
    // q, k, v [B, H, n, d] for the modulated input h [B, n, D] at the positions described by `rope`.
    void qkv(const torch::Tensor& h, const Rope& rope, torch::Tensor& q, torch::Tensor& k, torch::Tensor& v);
    // Only v [B, H, n, d] (for the cache's V check).
    torch::Tensor value(const torch::Tensor& h);
    // softmax(q k^T / sqrt(d)) v, heads merged, then attn_out: [B, nq, D]. Bidirectional, no mask.
    torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v);
    // Ungated FFN branch mlp(norm2(x) (1 + scale2) + shift2).
    torch::Tensor ffn(const torch::Tensor& x, const BlockModulation& m);
    // Dense block: x + g_attn attn(...) then + g_ffn ffn(...).
    torch::Tensor forward(const torch::Tensor& x, const BlockModulation& m, const Rope& rope);
    // The block over cached latents (batch 1; the cache chooses the rows, text/diffusion/mdlm_cache.h): recomputes the positions
    // `active` (int64 [n]) of x [1, L, D] and takes every other position's K/V and branch outputs from `latents`:
    //   q, k, v = qkv(attn_input(x[active])) at the active positions;  K[active], V[active] = k, v
    //   Attn[active] = attend(q, K, V)   (the active queries over every key)
    //   y = x + g_attn Attn;  Ffn[active] = ffn(y[active]);  out = y + g_ffn Ffn
    // The gates are the current step's, which is exact for a cached branch because they depend on t only. With every
    // position active it computes what forward() computes.
    torch::Tensor forward_cached(const torch::Tensor& x, const BlockModulation& m, const Rope& rope,
                                 const torch::Tensor& active, BlockLatents& latents);
    // forward_cached's few-row path, also for a part of the sequence: the same steps on raw memory, one kernel each
    // (kernels/row_ops.h: the modulated norms and the few queries' attention over every cached key;
    // kernels::few_rows_linear: the products; rotary and the head split in one pass), where the ~60 LibTorch ops of
    // the general path cost more than their arithmetic. Float32 sums in another order: within 1e-5 of the general path
    // (tests/test_mdlm.cpp [rows]). x [1, u, D] holds the residual stream at the positions x_rows (int64 [u];
    // undefined: every position, u = L); `active` (positions) are recomputed, at rows active_in_x of x; every row of x
    // gets the branches (cached for the others). Nothing else of the sequence is read or written but the latents.
    // rows_path_applies: stream_few_rows and fuse_rows, n < L active rows, at most few_rows_limit(gemm), batch 1,
    // float32 CPU, no autograd.
    bool rows_path_applies(int64_t n, int64_t length, const torch::Tensor& x, const Rope& rope) const;
    torch::Tensor forward_rows(const torch::Tensor& x, const torch::Tensor& x_rows, const BlockModulation& m,
                               const Rope& rope, const torch::Tensor& active, const torch::Tensor& active_in_x,
                               BlockLatents& latents);

    MdlmConfig cfg;
    NormNoBias norm1{nullptr}, norm2{nullptr};
    torch::nn::Linear attn_qkv{nullptr}, attn_out{nullptr};
    torch::nn::Sequential mlp{nullptr};
    torch::nn::Linear adaLN_modulation{nullptr};
    torch::nn::Linear gate_attn{nullptr}, gate_ffn{nullptr}; // TimeAnchor only
    // attend()'s arithmetic (kernels/attention.h): Exact = SEDD's matmul-softmax-matmul; Fused/Flash the tiled
    // kernel (no L x L score buffer, within 2e-6 relative).
    kernels::AttentionKernel kernel = kernels::AttentionKernel::Exact;
    // The linear layers' library (kernels/onednn.h): Torch = SEDD's bits (LibTorch's BLAS); OneDnn (and Winograd,
    // which has no convolution to change here) = oneDNN's matmul, which reads the weight in place where OpenBLAS
    // packs it on every call, different in the last bits; Bf16 = its bfloat16 operands.
    kernels::GemmBackend gemm = kernels::GemmBackend::Torch;
    // A product over a few rows (a cached step's positions) streams the weight once instead (kernels::
    // few_rows_linear), on the float32 backends, at or under the row count where it stops beating that backend; the
    // full sequence keeps the backend's bits.
    bool stream_few_rows = true;
    // With stream_few_rows: forward_cached takes forward_rows where it applies (false: the general path's ops around
    // the same streamed products; tests compare the two).
    bool fuse_rows = true;
};
TORCH_MODULE(MdlmBlock);

struct TimestepEmbedderImpl : torch::nn::Module {
    TimestepEmbedderImpl(int64_t cond_dim, int64_t freq_size);
    torch::Tensor forward(const torch::Tensor& sigma); // [B] -> [B, C]
    torch::nn::Sequential mlp{nullptr};
    int64_t freq_size;
};
TORCH_MODULE(TimestepEmbedder);

struct EmbeddingImpl : torch::nn::Module {
    EmbeddingImpl(int64_t vocab, int64_t dim);
    torch::Tensor forward(const torch::Tensor& ids); // [...] -> [..., D]
    torch::Tensor embedding;
};
TORCH_MODULE(Embedding);

// Linear head whose weight may be tied to the embedding (then only the bias is a parameter here).
struct HeadLinearImpl : torch::nn::Module {
    HeadLinearImpl(int64_t in, int64_t out, bool tied);
    torch::Tensor weight, bias;
};
TORCH_MODULE(HeadLinear);

struct OutputLayerImpl : torch::nn::Module {
    OutputLayerImpl(const MdlmConfig& cfg);
    // Logits [..., V] for hidden rows h [B, n, D] given c [B, C]; `tied` is the embedding when weights are tied.
    torch::Tensor forward(const torch::Tensor& h, const torch::Tensor& c, const torch::Tensor& tied);
    // The same from the modulation's shift and scale [B, 1, D] and a bias [V].
    torch::Tensor forward(const torch::Tensor& h, const torch::Tensor& shift, const torch::Tensor& scale,
                          const torch::Tensor& tied, const torch::Tensor& bias);
    NormNoBias norm_final{nullptr};
    torch::nn::Linear adaLN_modulation{nullptr};
    HeadLinear linear{nullptr};
    kernels::GemmBackend gemm = kernels::GemmBackend::Torch; // the vocabulary projection's (MdlmBlockImpl::gemm)
    bool stream_few_rows = true;                             // MdlmBlockImpl::stream_few_rows
};
TORCH_MODULE(OutputLayer);

// The most rows a linear layer's product streams through kernels::few_rows_linear on backend g on this CPU (0: none;
// MdlmBlockImpl::stream_few_rows).
int64_t few_rows_limit(kernels::GemmBackend g);

class MdlmModelImpl : public torch::nn::Module {
public:
    explicit MdlmModelImpl(const MdlmConfig& cfg);

    // Conditioning: sigma(t) of the log-linear schedule (0 without time_conditioning), then
    // c = silu(sigma_map(sigma)). t: [B] in [0, 1].
    torch::Tensor sigma_of_t(const torch::Tensor& t) const;
    torch::Tensor conditioning(const torch::Tensor& t);
    Rope rope(int64_t length, const torch::TensorOptions& opts) const;

    // Token embedding of internal ids [B, L].
    torch::Tensor embed(const torch::Tensor& ids) { return vocab_embed->forward(ids.to(placement_.device)); }
    // Residual stream after all blocks, [B, L, D]. `per_layer` (optional) receives each block's output.
    torch::Tensor hidden(const torch::Tensor& ids, const torch::Tensor& c,
                         std::vector<torch::Tensor>* per_layer = nullptr);
    // Logits with [MASK] at -inf (MDLM's SUBS parameterisation) for hidden rows [B, n, D].
    torch::Tensor head(const torch::Tensor& h, const torch::Tensor& c);
    // c, every block's modulation and the head's, at times t [B]; head(h, s) equals head(h, s.c) bit for bit.
    StepConditioning step_conditioning(const torch::Tensor& t);
    torch::Tensor head(const torch::Tensor& h, const StepConditioning& s);
    // Full dense forward: logits [B, L, V] for internal ids [B, L] at times t [B].
    torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& t);

    // GPT-2-side ids <-> internal ids (identity unless compact). Unknown GPT-2 ids throw anchor::Error.
    torch::Tensor to_internal(const torch::Tensor& gpt2_ids) const;
    torch::Tensor to_external(const torch::Tensor& internal_ids) const;
    // True when every id is an ordinary token of this model (in the compact vocabulary, not [MASK]).
    bool in_vocabulary(const std::vector<int64_t>& gpt2_ids) const;
    int64_t internal_mask_id() const { return cfg_.compact_vocab ? cfg_.vocab_size - 1 : cfg_.mask_token_id; }
    // Sets the compact vocabulary (sorted GPT-2 ids, last = mask id); only for compact models.
    void set_vocab_ids(const torch::Tensor& ids);

    const MdlmConfig& config() const { return cfg_; }
    void set_attention_kernel(kernels::AttentionKernel k); // every block's (MdlmBlockImpl::kernel)
    // Every block's and the head's linear layers (MdlmBlockImpl::gemm). ParamError (field "gemm") where backend `g`
    // cannot run in this build on this CPU (kernels::gemm_backend_unavailable).
    void set_gemm_backend(kernels::GemmBackend g);
    kernels::GemmBackend gemm_backend() const { return output_layer->gemm; }
    // Every block's and the head's MdlmBlockImpl::stream_few_rows (false: every product on the backend's library).
    void set_stream_few_rows(bool on);
    // Every block's MdlmBlockImpl::fuse_rows.
    void set_fuse_rows(bool on);
    // Moves the weights to `p.device` in `p.dtype` (the compact vocabulary's id maps stay on the CPU, where the
    // samplers' ids are). Inputs (ids, t, positions) may come from the CPU; the denoiser's logits leave as float32 on
    // the CPU (text/diffusion/mdlm_cache.h). Off CPU float32 every product is LibTorch's: ParamError "gemm" for a oneDNN
    // backend, "dtype" for a Placement::validate failure.
    void place(const Placement& p);
    const Placement& placement() const { return placement_; }

    Embedding vocab_embed{nullptr};
    TimestepEmbedder sigma_map{nullptr};
    torch::nn::ModuleList blocks{nullptr};
    std::vector<MdlmBlock> block_list;
    OutputLayer output_layer{nullptr};
    torch::Tensor vocab_ids; // compact only

private:
    MdlmConfig cfg_;
    torch::Tensor ext_to_int_; // [mask_token_id + 1] int64, -1 for absent (compact only)
    torch::Tensor internal_or_minus_one(const torch::Tensor& ids) const; // ids in range; -1 where absent
    torch::Tensor mask_bias_;                                            // [V] 0 / -inf at the mask column
    Placement placement_;
};
TORCH_MODULE(MdlmModel);

// Random initialisation for training / benchmarks (normal(0, std) weights, SEDD-like zero adaLN, gates at 0.5).
void init_mdlm_weights(MdlmModel& model, uint64_t seed, double std = 0.02);
// Random weights with O(1) activations for speed benchmarks and tests (adaLN and gates non-zero).
void randomize_mdlm_weights(MdlmModel& model, uint64_t seed);

// Loads config.json (or detects it) + safetensors from a folder or a .safetensors file. `backbone.` prefixes
// (MDLM HF layout) are stripped; rotary buffers ignored. Weights are converted to float32. Another diffusion LM's
// layout (LLaDA, Dream) is an anchor::Error naming the architecture and what this loader lacks for it.
MdlmModel load_mdlm(const std::string& path, int64_t n_heads_hint = 0);
// What a run sets on a loaded model, in this order: the attention kernel, the placement (MdlmModelImpl::place), the
// linear layers' backend (a oneDNN one off CPU float32 is ParamError "gemm").
void configure_mdlm(MdlmModel& model, kernels::AttentionKernel attention, const Placement& placement,
                    kernels::GemmBackend gemm);
// Writes `dir/config.json` and `dir/model.safetensors` (atomically) in `dtype` (float32 or float16).
// The message for a config or tensor names of an unsupported diffusion-LM architecture ("" when it is not one).
std::string unsupported_diffusion_lm(const nlohmann::json& config, const std::vector<std::string>& tensor_names);
void save_mdlm(const MdlmModel& model, const std::string& dir, torch::ScalarType dtype = torch::kFloat32,
               bool overwrite = true);
// Named tensors with checkpoint names (for safetensors).
std::vector<std::pair<std::string, torch::Tensor>> mdlm_named_tensors(const MdlmModel& model);

} // namespace anchor::text
