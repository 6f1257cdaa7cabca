// Published masked-diffusion language models (docs/text-diffusion.md "Published families"):
//
// - DiffuGPT (Gong et al. 2024, "Scaling Diffusion Language Models via Adaptation from Autoregressive Models"): a
//   GPT-2 whose causal mask is removed (HKUNLP/DiffuLLaMA model.py fills `attn.bias` with True), [MASK] appended to
//   GPT-2's vocabulary, and the shift: the logits at position i predict the token at i + 1, as in the autoregressive
//   model it was adapted from. Checkpoint names: `embed_tokens.weight`, `denoise_model.{wpe,h.N.*,ln_f}.*`,
//   `lm_head.weight` (plain or `transformer.`-prefixed GPT-2 names load too).
// - LLaDA (Nie et al. 2025): LLaMA blocks (RMSNorm, SwiGLU, rotary positions, grouped K/V) with bidirectional
//   attention and no shift; names `model.transformer.{wte, blocks.N.{attn_norm, q_proj, k_proj, v_proj, attn_out,
//   ff_norm, ff_proj (gate), up_proj, ff_out (down)}, ln_f, ff_out}`; config keys d_model, n_heads, n_kv_heads, ...
// - Dream (Ye et al. 2025): Qwen2.5 blocks (q/k/v biases) with full attention and the shift; Qwen2's names
//   (`model.layers.N.self_attn.q_proj`, ...).
//
// Every family runs through one interface: the logits of a range of positions, with K/V of the others taken from a
// cache (Fast-dLLM's prefix and dual caches) or computed now.
#pragma once

#include "cache/io/enum_table.h"
#include "kernels/qgemm.h"
#include "kernels/qgemm_arith.h"
#include "text/gpt2/gpt2_model.h"

#include <torch/torch.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace anchor::text {

enum class DlmFamily { DiffuGpt, Llada, Dream };
const EnumTable<DlmFamily>& dlm_family_table(); // "diffugpt", "llada", "dream"

struct DlmConfig {
    DlmFamily family = DlmFamily::Llada;
    int64_t vocab_size = 0;        // rows of the embedding / head
    int64_t hidden_size = 0;
    int64_t n_layers = 0;
    int64_t n_heads = 0;
    int64_t n_kv_heads = 0;        // grouped K/V (== n_heads for DiffuGPT)
    int64_t intermediate_size = 0; // SwiGLU width (LLaDA/Dream)
    int64_t max_positions = 0;     // learned positions (DiffuGPT) or the trained context
    double rope_theta = 10000.0;
    double norm_eps = 1e-5;
    bool qkv_bias = false;       // Dream
    bool tie_embeddings = false; // the head reads the embedding table
    int64_t mask_token_id = -1;
    std::vector<int64_t> eos_token_ids; // generation stops at the first (LLaDA: <|eot_id|> and <|endoftext|>)
    // Logits at position i predict the token at i + 1 (DiffuGPT, Dream): samplers read position i - 1's row for i.
    bool shift = false;
    Gpt2Config gpt2; // DiffuGPT's GPT-2 configuration

    int64_t head_dim() const { return hidden_size / n_heads; }
    void validate() const; // anchor::Error naming the field
    std::string describe() const;
};

// K and V of every position of one sequence, per layer: [1, n_kv_heads, L, head_dim].
struct DlmKvCache {
    std::vector<torch::Tensor> k, v;
    int64_t length() const { return k.empty() ? 0 : k.front().size(2); }
};

class DlmModel {
public:
    virtual ~DlmModel() = default;
    const DlmConfig& config() const { return cfg_; }
    // Logits [1, hi - lo, V] (float32, unshifted) of positions [lo, hi) of ids [1, L] (int64). With `kv`: the K/V of
    // [lo, hi) are written into it (allocated for L positions on first use) and the queries attend over every
    // position's K/V in it, the others as they were cached; without it, lo = 0 and hi = L (the plain forward).
    virtual torch::Tensor forward(const torch::Tensor& ids, int64_t lo, int64_t hi, DlmKvCache* kv) = 0;
    torch::Tensor logits(const torch::Tensor& ids); // forward over every position, no cache
    virtual int64_t weight_bytes() const = 0;
    // The arithmetic of the products with q8_0 / q4_0 (and f16 / bf16) weights (kernels/qgemm_arith.h); float32
    // weights (DiffuGPT, a folder loaded without --weights-dtype) always multiply in float32. ParamError (field
    // "gemm") where `a` cannot run on this CPU.
    void set_qgemm(kernels::QGemmArithmetic a);
    kernels::QGemmArithmetic qgemm() const { return qgemm_; }

protected:
    explicit DlmModel(DlmConfig c) : cfg_(std::move(c)) {}
    DlmConfig cfg_;
    kernels::QGemmArithmetic qgemm_ = kernels::default_qgemm_arithmetic();
};

struct LoadedDlm {
    std::shared_ptr<DlmModel> model;
    std::string folder; // for the tokenizer / chat template next to the weights
    std::string config_path;
};

// The family of a model folder/file from its config.json (architectures / model_type) and tensor names; nullopt
// when it is none of the three.
std::optional<DlmFamily> detect_dlm_family(const std::string& path);

// Loads a Hugging Face folder (config.json + safetensors, sharded or not) or a GGUF file. `family` overrides
// detection; `mask_token_id` >= 0 overrides the config's / tokenizer files' [MASK] id. Every missing, unexpected or
// wrong-shape tensor is reported in one anchor::Error.
// `weights`: the storage of LLaDA's / Dream's linear layers and embedding (kernels/qgemm.h). Unset: a folder's
// tensors become float32 and a GGUF's stay as stored (q8_0 / q4_0 / f16 / bf16 blocks read from the map, f32 as is);
// set: every such weight is converted to it (a GGUF weight of another type is dequantised and requantised). Norms
// and biases stay float32. DiffuGPT (124M / 355M parameters) keeps float32 and refuses any other type.
LoadedDlm load_dlm(const std::string& path, std::optional<DlmFamily> family = {}, int64_t mask_token_id = -1,
                   std::optional<kernels::QWeightType> weights = {});

} // namespace anchor::text
