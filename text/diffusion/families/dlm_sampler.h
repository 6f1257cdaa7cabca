// Samplers of the published masked-diffusion LMs (dlm_model.h), each as its reference code decodes:
//
// - DiffuGPT (HKUNLP/DiffuLLaMA model.py generate_samples): every non-prompt position starts as [MASK]; each step
//   proposes x0 from softmax(top_p(logits / T)) at every position, shifted right by one (the logits at i - 1 predict
//   token i), and at step t = T-1 .. 1 each still-masked position takes its proposal with probability 1 / (t + 1);
//   the last proposal is the sample.
// - LLaDA (ML-GSAI/LLaDA generate.py, Nie et al. 2025 sec. 2.4 and app. B.3): semi-autoregressive blocks of
//   block_length; steps / blocks steps per block, each committing the precomputed count of the block's masks with
//   the highest confidence (the probability of the Gumbel-max token: low-confidence remasking; or a uniform draw).
// - Dream (Ye et al. 2025; DreamGenerationMixin._sample in Dream-org/Dream-v0-Instruct-7B generation_utils.py): the
//   whole answer masked at once, logits shifted right by one; step i of a linspace(1, eps) grid commits
//   int(masks * (1 - s/t)) positions by confidence (maskgit_plus: probability of the sampled token; topk_margin:
//   top1 - top2; entropy: sum p log p), the top ones or, with alg_temp > 0, drawn without replacement from
//   softmax(confidence / alg_temp); or each mask with probability 1 - s/t (origin).
//
// Categorical draws are Gumbel-max over uniforms (the same distribution as torch.distributions.Categorical; Dream's
// draws are torch.multinomial's argmax(p / q), q = -log u); every uniform comes from a DlmDraws source in a fixed
// order, so a golden case can replay the reference's draws.
#pragma once

#include "cache/io/enum_table.h"
#include "text/diffusion/families/dlm_model.h"

#include <torch/torch.h>

#include <functional>
#include <optional>
#include <vector>

namespace anchor::text {

// Uniforms in (0, 1) of a shape and dtype (float32 or float64), one call per draw of the reference sampler.
using DlmDraws = std::function<torch::Tensor(const std::vector<int64_t>& shape, torch::ScalarType dtype)>;
// From a CPU generator: float64 uniforms cast to the dtype, kept within [its smallest normal, its largest value
// below 1] (no log(0), no -log u = 0).
DlmDraws dlm_seeded_draws(uint64_t seed);

// Commit rules (the names of the reference samplers' options).
enum class DlmRemask { LowConfidence, Random, MaskgitPlus, TopkMargin, Entropy, Origin };
const EnumTable<DlmRemask>& dlm_remask_table(); // low_confidence, random, maskgit_plus, topk_margin, entropy, origin

// Which K/V a step recomputes (Fast-dLLM, Wu et al. 2025): Off every position; Prefix the positions from the
// current block on (the prompt and committed blocks keep the K/V of the block's first step); Dual only the block
// (the masked suffix is cached too). Cached modes apply to block-wise decoding (LLaDA, block-wise DiffuGPT).
enum class DlmCache { Off, Prefix, Dual };
const EnumTable<DlmCache>& dlm_cache_table(); // off, prefix, dual

struct DlmSampleOptions {
    int64_t gen_length = 128;
    int64_t block_length = 0; // LLaDA's semi-autoregressive blocks (0: one block of gen_length)
    int64_t steps = 128;
    std::optional<double> temperature;      // unset: the family's (DiffuGPT 0.95, LLaDA 0, Dream 0.2)
    std::optional<double> top_p;            // unset: DiffuGPT 0.9, Dream 0.95, LLaDA none
    std::optional<int64_t> top_k;           // Dream
    std::optional<DlmRemask> remask;        // unset: LLaDA low_confidence, Dream entropy
    double eps = 1e-3;                      // Dream's last time point
    bool stop_at_eos = false;               // stop after the block that holds an EOS; cut the answer there
    DlmCache cache = DlmCache::Off;
    std::optional<double> alg_temp; // Dream: > 0 draws the committed positions from softmax(confidence / alg_temp)
    // ParamError naming the field (what a family cannot do with these settings).
    void validate(const DlmConfig& c) const;
    // DiffuGPT decodes block-wise (LLaDA's blocks and remasking with the shift, where the prefix and dual caches
    // apply) when a block length, a cache or a remask rule is given; otherwise its reference sampler runs.
    bool diffugpt_blockwise(const DlmConfig& c) const {
        return c.family == DlmFamily::DiffuGpt && (block_length > 0 || cache != DlmCache::Off || remask.has_value());
    }
    double temperature_for(DlmFamily f) const;
    std::optional<double> top_p_for(DlmFamily f) const;
    DlmRemask remask_for(DlmFamily f) const;
};

struct DlmSampleResult {
    std::vector<int64_t> sequence;  // the final sequence in the reference's layout (prompt + answer)
    std::vector<int64_t> generated; // the answer (cut at the first EOS with stop_at_eos)
    int64_t prompt_tokens = 0;
    int64_t steps_run = 0;
    int64_t positions_computed = 0; // sum over steps of the positions a forward recomputed
};

// Called with the answer's tokens committed so far whenever a block is complete (streaming).
using DlmBlockCallback = std::function<void(const std::vector<int64_t>& committed)>;

// The family's sampler on `prompt` (token ids).
DlmSampleResult dlm_generate(DlmModel& model, const std::vector<int64_t>& prompt, const DlmSampleOptions& o,
                             const DlmDraws& draws, const DlmBlockCallback& on_block = {});

// The reference samplers on tensors, as the goldens replay them.
// DiffuGPT: x [1, L] with the source positions set (src_mask [1, L] bool true there); returns the last x0 [1, L].
torch::Tensor diffugpt_sample(DlmModel& model, const torch::Tensor& x, const torch::Tensor& src_mask, int64_t steps,
                              double temperature, double top_p, const DlmDraws& draws);
// LLaDA: returns [1, P + gen_length]. With the model's shift (block-wise DiffuGPT) position j reads the logits of
// row j - 1 (a cached step recomputes from the position before the block); `top_p` filters the logits the tokens are
// drawn from (DiffuGPT's nucleus), the confidences stay the unfiltered softmax's.
torch::Tensor llada_sample(DlmModel& model, const torch::Tensor& prompt, int64_t steps, int64_t gen_length,
                           int64_t block_length, double temperature, DlmRemask remask, const DlmDraws& draws,
                           DlmCache cache = DlmCache::Off, bool stop_at_eos = false, const DlmBlockCallback& on_block = {},
                           int64_t* positions_computed = nullptr, std::optional<double> top_p = std::nullopt);
// Dream: returns [1, P + gen_length].
torch::Tensor dream_sample(DlmModel& model, const torch::Tensor& prompt, int64_t gen_length, int64_t steps, double eps,
                           double temperature, std::optional<double> top_p, std::optional<int64_t> top_k,
                           DlmRemask alg, const DlmDraws& draws, std::optional<double> alg_temp = std::nullopt);

// The nucleus filter of DiffuGPT's / Dream's top_p_logits: outside the smallest prefix of the sorted vocabulary whose
// probability exceeds p (the first token always kept), logits become float32's lowest value.
torch::Tensor dlm_top_p(const torch::Tensor& logits, double p);
torch::Tensor dlm_top_k(const torch::Tensor& logits, int64_t k);

} // namespace anchor::text
