// GPT-2 (Radford et al. 2019) for inference: HF/OpenAI checkpoint layout, full forward, KV-cached incremental
// decoding and streaming with attention-sink rolling KV buffers (cache/sink_rolling_kv.h).
//
// Module names equal the checkpoint names (`wte`, `wpe`, `h.{i}.ln_1`, `h.{i}.attn.c_attn`, ..., `ln_f`), so loading
// is WeightMap::load_into. Conv1D weights are stored [in, out] in checkpoints (`y = x @ W + b`); they are transposed
// once at load into row-major [out, in] so batch-1 decoding is a matrix-vector product over contiguous rows; the
// registered parameter stays a [in, out] view of that storage (names and shapes keep matching the checkpoint).
#pragma once

#include "cache/io/enum_table.h"
#include "cache/sink_rolling_kv.h"
#include "kernels/cuda_graph.h"
#include "text/params.h"

#include <torch/torch.h>

#include <nlohmann/json_fwd.hpp>

#include <array>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace anchor {
class WeightMap;
}

namespace anchor::text {

// Batch-1 decode steps use kernels::gemv (AVX2 when available) for every linear layer and the LM head; off: the
// torch::addmv / torch::mv reference path. Process-wide (benchmarks compare both).
void set_fast_decode_kernel(bool on);
bool fast_decode_kernel();
// The matrix-vector kernel batch-1 steps run now: "AVX-512 gemv", "AVX2/FMA gemv", "portable gemv" or
// "torch::addmv/mv (reference)".
std::string decode_kernel();

// One-token stream steps on a CUDA device replay a captured CUDA graph (Gpt2DecodeGraph; `--cuda-graphs`), off by
// default. Process-wide, as set_fast_decode_kernel; it only applies where Gpt2DecodeGraph::applies.
void set_decode_cuda_graphs(bool on);
bool decode_cuda_graphs();

// The weights batch-1 steps read (`--decode-weights`): float32, a float16 copy, a q8_0 or a q4_0 copy (llama.cpp's
// block formats: 32 int8 values, or 32 4-bit codes, and one float16 scale per block, kernels/gemv.h).
enum class DecodeWeights { F32, F16, Q8_0, Q4_0 };

struct Gpt2Config {
    int64_t n_layer = 12;
    int64_t n_head = 12;
    int64_t n_embd = 768;
    int64_t n_positions = 1024;
    int64_t vocab_size = 50257;
    int64_t n_inner = 0; // 0: 4 * n_embd
    double layer_norm_epsilon = 1e-5;
    std::string activation = "gelu_new"; // gelu_new / gelu_pytorch_tanh / gelu_fast: tanh GELU; gelu: erf GELU

    int64_t head_dim() const { return n_embd / n_head; }
    int64_t inner() const { return n_inner > 0 ? n_inner : 4 * n_embd; }
    bool tanh_gelu() const;
    void validate() const; // throws anchor::Error on inconsistent values

    // HF config.json (model_type gpt2 / architectures GPT2*). Throws naming the file and field.
    static Gpt2Config from_json(const nlohmann::json& j, const std::string& source = "config.json");
    static Gpt2Config from_json_file(const std::string& path);
    // The HF config.json of this config (what from_json reads back, and what HF's GPT2LMHeadModel loads), its fields
    // through the binding from_json reads.
    nlohmann::json to_json() const;
    // Shapes only: layers from `h.{i}.` names, sizes from wte/wpe/c_fc. Shapes cannot tell the head count:
    // `n_head_hint` when > 0, else the GPT-2 family's head size of 64 (n_head = n_embd / 64).
    static Gpt2Config detect_from_weights(const WeightMap& w, int64_t n_head_hint = 0);
    std::string describe() const;
};

// The [out, in] float32 rows batch-1 steps multiply by one vector, with the reduced copy `--decode-weights` asks for
// (at most one of f16, q8, q4 is defined): every Conv1D's and the LM head's.
struct DecodeRows {
    torch::Tensor f32, f16, q8, q4;
    void set_copies(DecodeWeights dw); // copies of f32 on huge pages (kernels::huge_page_copy); F32 drops them
    int64_t bytes() const;             // of the rows a step reads
    bool on_cpu_f32() const;           // the rows the gemv kernels read (elsewhere: torch::addmv / mv)
    // y = W x + b (b may be null) through the copy in use (kernels::gemv_f32 / gemv_f16 / gemv_q8_0).
    void gemv(const float* x, const float* b, float* y) const;
    torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& bias = {}) const; // x [in] -> y [out]
};

// HF Conv1D: weight [in, out], y = x @ W + b. After finalize(), `w_rows()` is the [out, in] row-major copy.
class Conv1DImpl : public torch::nn::Module {
public:
    Conv1DImpl(int64_t in, int64_t out);
    torch::Tensor forward(const torch::Tensor& x);
    void finalize(); // re-lays the loaded weight out as [out, in] rows (once, after loading)
    void relayout(); // the same from the weight as it is now (after Gpt2ModelImpl::place moved it), no huge pages
    // Batch-1 steps read a float16 or q8_0 copy of the rows (half / ~0.27 of the bytes) when asked; batched forwards
    // keep float32.
    void set_decode_weights(DecodeWeights dw);
    const torch::Tensor& w_rows() const { return rows_.f32; }
    int64_t decode_bytes() const; // bytes of the rows one batch-1 step reads
    // y[out] = W x[in] + b through the decode copy in use (kernels::gemv_*); after finalize().
    void decode_row(const float* x, float* y) const;
    torch::Tensor weight, bias;

private:
    DecodeRows rows_;
};
TORCH_MODULE(Conv1D);

class Gpt2AttentionImpl : public torch::nn::Module {
public:
    explicit Gpt2AttentionImpl(const Gpt2Config& c);
    // x [B, T, C]. Without `kv`: causal self-attention over the T tokens. With `kv`: the T new tokens are appended
    // (with `pos_ids`) and attend over the cache's slots; T > 1 only while the tokens fit without eviction.
    torch::Tensor forward(const torch::Tensor& x, cache::SinkRollingKV* kv = nullptr,
                          const std::vector<int64_t>& pos_ids = {});
    Conv1D c_attn{nullptr}, c_proj{nullptr};

private:
    int64_t n_head_, n_embd_;
};
TORCH_MODULE(Gpt2Attention);

class Gpt2MlpImpl : public torch::nn::Module {
public:
    explicit Gpt2MlpImpl(const Gpt2Config& c);
    torch::Tensor forward(const torch::Tensor& x);
    Conv1D c_fc{nullptr}, c_proj{nullptr};

private:
    bool tanh_;
};
TORCH_MODULE(Gpt2Mlp);

class Gpt2BlockImpl : public torch::nn::Module {
public:
    explicit Gpt2BlockImpl(const Gpt2Config& c);
    torch::Tensor forward(const torch::Tensor& x, cache::SinkRollingKV* kv = nullptr,
                          const std::vector<int64_t>& pos_ids = {});
    torch::nn::LayerNorm ln_1{nullptr}, ln_2{nullptr};
    Gpt2Attention attn{nullptr};
    Gpt2Mlp mlp{nullptr};
    // The block's four Conv1D layers (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj): re-layout, decode copies and
    // byte counts all walk this one list.
    std::array<Conv1DImpl*, 4> conv1ds() const;
};
TORCH_MODULE(Gpt2Block);

struct Gpt2Output {
    torch::Tensor logits;              // [B, T, V] (or [B, 1, V] with last_only)
    std::vector<torch::Tensor> hidden; // when asked: embed, after block 0..L-1 (before ln_f), ln_f(last)
};

class Gpt2DecodeGraph;

class Gpt2ModelImpl : public torch::nn::Module {
public:
    explicit Gpt2ModelImpl(const Gpt2Config& c);

    // Full causal forward of ids [B, T] (or [T]) at positions 0..T-1 (or `positions` [T]).
    Gpt2Output forward(const torch::Tensor& ids, bool want_hidden = false, bool last_only = false,
                       const torch::Tensor& positions = {});
    // Incremental step: ids [B, T] at `pos_ids` (one per token), K/V appended to `caches` (one per layer).
    // Returns logits [B, T, V] (or [B, 1, V] with last_only).
    torch::Tensor step(const torch::Tensor& ids, const std::vector<int64_t>& pos_ids,
                       std::vector<cache::SinkRollingKV>& caches, bool last_only = false);
    // One cache per layer with S sinks and a W-slot ring (or full mode when !evict).
    std::vector<cache::SinkRollingKV> make_caches(int64_t sinks, int64_t window, bool evict, int64_t batch = 1) const;

    // After load: Conv1D re-layout, LM head = explicit lm_head.weight or tied wte.weight.
    void finalize(const torch::Tensor& explicit_lm_head = {});
    const torch::Tensor& lm_head() const { return lm_.f32; }
    bool lm_head_tied() const { return tied_; }
    // Decode weights (`--decode-weights f16|q8_0|q4_0`): batch-1 steps are bound by the bytes of weights read per token,
    // so a float16 copy of every Conv1D and the LM head (F16C-widened in kernels::gemv) halves that traffic, as
    // llama.cpp's f16 models do, a q8_0 copy (34 bytes per 32 weights; the activations quantised per block as
    // llama.cpp does) brings it to 0.27 and a q4_0 copy (18 bytes per 32) to 0.14. Costs a second copy of those
    // weights; prompts and batched forwards stay float32. Logits move by the rounding of the weights (f16: relative
    // ~1e-3; q8_0: ~1e-2; q4_0: its 16 levels per block, ~1e-1). Only with the fast decode kernel.
    void set_decode_weights(DecodeWeights dw); // F32 (default) drops the copies; others only on CPU float32
    // Moves the weights to `p.device` in `p.dtype` (after finalize); caches made afterwards live there too, and
    // step()/forward() take ids from the CPU and give float32 logits on the device. Off CPU float32 every product is
    // LibTorch's (the gemv kernels read CPU float32 rows). ParamError "dtype" (Placement::validate) or
    // "decode_weights" (f16/q8_0/q4_0 copies are CPU float32 only).
    void place(const Placement& p);
    const Placement& placement() const { return placement_; }
    DecodeWeights decode_weights() const { return decode_dtype_; }
    int64_t decode_weight_bytes() const; // bytes one batch-1 step streams: every Conv1D weight and the LM head
    const Gpt2Config& config() const { return cfg_; }

    torch::nn::Embedding wte{nullptr}, wpe{nullptr};
    torch::nn::ModuleList h{nullptr};
    torch::nn::LayerNorm ln_f{nullptr};

private:
    friend class Gpt2DecodeGraph;
    torch::Tensor logits_of(const torch::Tensor& x); // ln_f already applied
    // One token of one sequence on raw rows (kernels/decode_ops.h, kernels::gemv_*): the same arithmetic as the
    // module forwards without their ~40 LibTorch ops per layer. Used by step() with the fast decode kernel; the
    // module forwards stay the reference (set_fast_decode_kernel(false)).
    torch::Tensor step_one(int64_t id, int64_t pos, std::vector<cache::SinkRollingKV>& caches);
    bool step_one_applies(const torch::Tensor& ids, const std::vector<cache::SinkRollingKV>& caches) const;
    Gpt2Config cfg_;
    std::vector<Gpt2Block> blocks_;
    DecodeRows lm_; // the LM head (wte's table when tied)
    DecodeWeights decode_dtype_ = DecodeWeights::F32;
    Placement placement_;
    bool tied_ = true;
};
TORCH_MODULE(Gpt2Model);

struct LoadedGpt2 {
    Gpt2Config config;
    Gpt2Model model{nullptr};
    std::vector<std::string> weight_files; // the safetensors files read
    std::string config_path;               // "" when detected from shapes
    std::string folder;                    // folder of the model (for a tokenizer next to it)
};

// Loads config (config.json next to the weights, else detect_from_weights) and weights: with or without the
// `transformer.` prefix, tied or explicit `lm_head.weight`, `h.{i}.attn.bias`/`masked_bias` buffers ignored,
// F32/F16/BF16 converted to float32. Every missing/unexpected/wrong-shape tensor is reported in one error.
LoadedGpt2 load_gpt2(const std::string& path, int64_t n_head_hint = 0);

// The one-token step of a stream as a CUDA graph (kernels/cuda_graph.h), captured at its first step: static shapes,
// the KV ring attended at its full capacity with an additive mask over the slots not yet filled (the same attention
// set as the eager step: the filled slots [0, filled), StreamingLLM's A(i) u {i}), the token, its position and its
// ring slot read from device buffers written before each replay (SinkRollingKV::advance keeps the bookkeeping on the
// host). Batch 1, the model on a CUDA device, LibTorch >= 2. The eager step stays the reference (tests/
// test_text_device.cpp [cuda] compares them).
class Gpt2DecodeGraph {
public:
    static bool applies(const Gpt2ModelImpl& model, const std::vector<cache::SinkRollingKV>& caches);
    Gpt2DecodeGraph(Gpt2Model model, const std::vector<cache::SinkRollingKV>& caches);
    ~Gpt2DecodeGraph();
    // Appends token `id` at position `pos` to `caches` (the ones of the constructor) and returns its logits [1, 1, V]
    // float32 on the device (the graph's output tensor: read it before the next step).
    torch::Tensor step(int64_t id, int64_t pos, std::vector<cache::SinkRollingKV>& caches);

private:
    std::vector<torch::Tensor> body();
    Gpt2Model model_;
    std::vector<torch::Tensor> k_, v_; // the rings' storage, [1, H, capacity, D] per layer
    torch::Tensor id_, pos_, slot_;    // int64 [1] on the device
    torch::Tensor mask_;               // [1, 1, 1, capacity]: 0 for a filled slot, -inf for an empty one
    int64_t live_ = 0;                 // slots the mask has at 0
    torch::Tensor out_;
    std::unique_ptr<kernels::CudaGraph> graph_;
};

// ---- streaming ---------------------------------------------------------------------------------------------------

// KV-cache modes of a token stream (StreamingLLM's comparison, Xiao et al. 2023, fig. 3/table 1).
enum class KvMode {
    Full,      // every token kept; cannot go past n_positions
    Window,    // rolling window of W tokens, no sinks (window attention)
    Sink,      // S attention sinks + W most recent tokens
    Recompute, // sliding window with re-computation: fresh forward over the last W tokens at positions 0..W-1
};
const std::vector<std::pair<KvMode, std::string>>& kv_mode_names(); // "full", "window", "sink", "recompute"

struct KvSpec {
    KvMode mode = KvMode::Full;
    int64_t sinks = 0;
    int64_t window = 0; // 0 with Full: n_positions
    // "full" | "window:W" | "sink:S,W" | "recompute:W"; throws text::ParamError (field "kv") on anything else.
    static KvSpec parse(const std::string& s);
    static std::string syntax_help(); // for --help, generated from kv_mode_names()
    std::string str() const;
};

// Position ids of a stream past the model's context: the buffer's own policies (cache::PositionPolicy), or
// Reencode, which the stream executes: it keeps its KV in order with positions 0, 1, ...; when the S + W buffer is
// full, the S sink tokens and the most recent floor(W/2) tokens are encoded again at positions 0 .. S + floor(W/2) - 1
// (one batched forward) and the stream continues after them. Every token is seen in order at positions the model was
// trained on, for a batched re-encode of S + W/2 tokens per ceil(W/2) tokens. (Learned absolute positions cannot be
// shifted inside a rolling cache the way RoPE keys can; this is the exact alternative.)
enum class PositionMode { Wrap, Cache, Absolute, Reencode };
const EnumTable<PositionMode>& position_mode_table(); // "wrap", "cache", "absolute", "reencode"
// The buffer policy of a mode; nullopt for Reencode.
std::optional<cache::PositionPolicy> buffer_policy(PositionMode mode);

// One stream through the model with a KV policy: feed tokens one at a time (or a prompt), get next-token logits.
class Gpt2Stream {
public:
    // text::ParamError (field "kv") when the model cannot take the mode with these positions.
    Gpt2Stream(Gpt2Model model, KvSpec spec, PositionMode positions);
    // Feeds one token (stream index count()) and returns its logits [V].
    torch::Tensor feed(int64_t token);
    // Feeds several tokens (batched while they fit without eviction) and returns the logits of the last [V].
    torch::Tensor feed(const std::vector<int64_t>& tokens);
    int64_t count() const { return count_; }
    // Tokens the model can still take (-1: unlimited).
    int64_t remaining() const;
    int64_t kv_bytes() const; // preallocated cache bytes (recompute: the token window only, ~0)
    const KvSpec& spec() const { return spec_; }
    int64_t position_of(int64_t i) const; // position id stream token i gets

private:
    Gpt2Model model_;
    KvSpec spec_;
    PositionMode policy_;
    int64_t capacity_ = 0;
    int64_t count_ = 0;
    std::vector<cache::SinkRollingKV> caches_;
    std::deque<int64_t> recent_; // recompute mode; reencode: the non-sink tokens of the buffer, oldest first
    // --positions reencode (window/sink modes): an in-order buffer of S + W slots, re-encoded when full.
    std::vector<int64_t> sink_ids_;
    int64_t cached_ = 0; // tokens in the buffer
    torch::Tensor feed_reencode(const std::vector<int64_t>& tokens);
    std::shared_ptr<Gpt2DecodeGraph> graph_; // decode_cuda_graphs(): made at the first one-token step that can
    torch::Tensor one_token_step(int64_t id, int64_t pos);
};

// StreamingLLM evaluation protocol: one token per step, score the next one.
struct StreamEval {
    torch::Tensor logprob_next;              // [N-1] float32: log_softmax(logits_i)[ids[i+1]]
    torch::Tensor argmax;                    // [N] int64
    torch::Tensor top2_gap;                  // [N] float32
    std::vector<torch::Tensor> probe_logits; // logits [V] at `probe_steps`
    double mean_nll = 0.0;                   // mean of -logprob_next (float64 sum)
    int64_t tokens = 0;                      // steps run
};
// Runs `ids` through a fresh Gpt2Stream; `on_step(i)` (optional) is called after each step (progress).
StreamEval evaluate_stream(Gpt2Model model, const std::vector<int64_t>& ids, const KvSpec& spec, PositionMode positions,
                           const std::vector<int64_t>& probe_steps = {},
                           const std::function<void(int64_t)>& on_step = {});

// Generative perplexity, the figure MDLM/SEDD report for samples (Sahoo et al. 2024, sec. 4.1): exp of the mean NLL
// under `model` of ids[from, N), each token conditioned on all tokens before it — on at least n_positions / 2 of them
// when the sequence is longer than the model's context (overlapping windows). `from` >= 1; ids are GPT-2 ids.
double generative_ppl(Gpt2Model model, const std::vector<int64_t>& ids, int64_t from);

} // namespace anchor::text
