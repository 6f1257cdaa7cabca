// Text diffusion runs (`anchor-text diffusion generate`, `--compare`): sampling with one cache mode, or two side by
// side with the same seed, each text's generative perplexity under a GPT-2 when asked.
#pragma once

#include "text/diffusion/mdlm_sampler.h"

#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <vector>

namespace anchor::text {

struct LoadedGpt2;

// One decoding mode: a cache and the sampler settings it runs with when they differ from the run's (parallel
// decoding needs its threshold, a block cache its blocks).
struct DecodeSpec {
    CacheSpec cache;
    std::optional<UnmaskRule> rule;
    std::optional<double> threshold, factor;
    std::optional<int64_t> block_length;
    // Denoising steps of this mode: fewer than the baseline's decodes several tokens per step (the schedule's count
    // per step), which is how parallel decoding is compared with one-token-per-step decoding.
    std::optional<int64_t> steps;
    // The model's linear layers for this mode (MdlmBlockImpl::gemm), e.g. `off,dual+gemm=bf16`: the cached mode on
    // bfloat16 operands beside the reference arithmetic. Unset: the run's (--gemm).
    std::optional<kernels::GemmBackend> gemm;
    // The mode as the user wrote it (parse_decode_spec); empty for a spec built in code.
    std::string label;
    void apply(SamplerOptions& o) const; // the overrides
    std::string to_string() const;       // resolved: "dual:refresh=0,...+threshold=0.9,block=32"
    std::string display() const { return label.empty() ? to_string() : label; } // how tables and grids name it
};
// "CACHE[+key=value,...]" with CACHE as parse_cache_spec reads it and keys unmask (a rule name), threshold, factor,
// block (block length), steps, gemm (a kernels::GemmBackend name). ParamError (field "cache") naming the bad key.
DecodeSpec parse_decode_spec(const std::string& s);
const std::vector<std::pair<std::string, std::string>>& decode_spec_keys(); // key -> help

// Unigram entropy (nats) of the tokens of `ids` from index `from`: the entropy of their empirical distribution
// (SEDD/MDLM report it beside gen-PPL to catch repetitive samples, which score a low perplexity).
double unigram_entropy(const std::vector<int64_t>& ids, int64_t from);

// While it lives, `model` runs its linear layers on `spec.gemm` (or `fallback` where the spec sets none); the
// backend it had is restored at the end of the scope (one mode's run of a comparison or benchmark).
class GemmScope {
public:
    GemmScope(MdlmModel model, const DecodeSpec& spec, kernels::GemmBackend fallback);
    ~GemmScope();
    GemmScope(const GemmScope&) = delete;
    GemmScope& operator=(const GemmScope&) = delete;

private:
    MdlmModel model_;
    kernels::GemmBackend before_;
};

struct DiffusionGenerateParams {
    std::string model;                               // MDLM folder or .safetensors (config.json next to it)
    int64_t n_heads = 0;                             // when the model has no config.json (0: D / 64)
    SamplerOptions sampler;                          // prompt: GPT-2 ids
    std::vector<DecodeSpec> caches = {DecodeSpec{}}; // one mode, or two run side by side with the same seed
    std::string score_with;                          // GPT-2 model scoring each text's generative perplexity ("": none)
    // The model's attention arithmetic when generate_diffusion loads it (kernels/attention.h; Exact: SEDD's).
    kernels::AttentionKernel attention = kernels::AttentionKernel::Exact;
    kernels::GemmBackend gemm = kernels::GemmBackend::Torch; // its linear layers' (MdlmBlockImpl::gemm)
    Placement placement; // --device / --dtype of the MDLM (the scoring GPT-2 stays the CPU float32 reference)
    void validate() const;                                   // ParamError naming the field
};

struct DiffusionRun {
    DecodeSpec cache;
    SampleResult result;
    double gen_ppl = -1; // under score_with, conditioned on the prompt (-1: not scored)
    int64_t prompt_tokens = 0;
    nlohmann::json to_json() const;
};

struct DiffusionReport {
    std::string model, score_with;
    int64_t prompt_tokens = 0;
    int threads = 0;
    std::vector<DiffusionRun> runs;
    double agreement() const; // of the second run's generated tokens with the first's (1 with one run)
    nlohmann::json to_json() const;
};

// Fraction of equal tokens of a and b from index `from` (1 when there are none).
double token_agreement(const std::vector<int64_t>& a, const std::vector<int64_t>& b, int64_t from);

// `on_step` (optional) sees every step of every run.
DiffusionReport generate_diffusion(const DiffusionGenerateParams& p, const StepCallback& on_step = {});
// The same with the model loaded once for many runs (a server, a prompts file): p.model is only recorded. `scorer`:
// the GPT-2 of p.score_with when the caller has it loaded (null: loaded here when score_with is set).
DiffusionReport generate_diffusion(const MdlmModel& model, const DiffusionGenerateParams& p,
                                   const StepCallback& on_step = {}, const LoadedGpt2* scorer = nullptr);

// Peak bytes one sampling run adds to the weights: the block activations and attention scores of a full forward
// over `length` positions, the logits, and the per-layer features a cache keeps.
int64_t estimate_sampling_bytes(const MdlmConfig& c, const SamplerOptions& o);
// ParamError("length") past the model's context (max_seq_len) or when estimate_sampling_bytes exceeds the memory
// available (cache/util/memory.h).
void check_sampling_memory(const MdlmConfig& c, const SamplerOptions& o);
// TokenOutsideVocabulary (text/params.h) for the first prompt token the model has no embedding for.
void check_prompt_vocabulary(const MdlmModelImpl& model, const std::vector<int64_t>& prompt);

} // namespace anchor::text
