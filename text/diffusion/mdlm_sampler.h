// Samplers for masked diffusion LMs: MDLM ancestral unmasking and LLaDA-style confidence unmasking, with
// semi-autoregressive blocks.
//
// Time grid: a block decoded in S steps uses t_j = 1 - j / S (j = 0..S-1) and s_j = t_j - 1 / S.
//   ancestral (MDLM, Sahoo et al. 2024, eq. 7 with the log-linear alpha_t = 1 - t): every masked position of the
//     current block is unmasked with probability (alpha_s - alpha_t) / (1 - alpha_t) = (t - s) / t (1 at the last
//     step, so everything is decoded), independently of the model, and only the unmasked ones draw
//     x0 ~ p_theta(. | x_t) (so only they need logits, and a step unmasking nothing skips the forward);
//   confidence (LLaDA, Nie et al. 2025, low-confidence remasking): every masked position of the block draws x0, and
//     the k_j with the highest p_theta(x0) are unmasked, k_j = LLaDA's even split of the block's masked count over S;
//   margin, entropy, random: the same with another score (llama.cpp's --diffusion-algorithm set; Kim et al. 2025's
//     top-two margin p1 - p2; the lowest entropy -sum p log p of the position's distribution first; uniform noise as
//     LLaDA's `random` remasking). The scores read the distribution after the token chain's cuts.
// Parallel decoding (Fast-dLLM, Wu et al. 2025, sec. 3.3), for every rule but ancestral:
//   threshold tau: a step unmasks every masked position of the block whose p_theta(x0) exceeds tau (Fast-dLLM's
//     confidence-aware parallel decoding), at least one and at least the schedule's k_j, chosen in the rule's order;
//     the schedule floor keeps a block within its S steps, so tau = 1 is the plain schedule bit for bit (and with
//     S = the block's length, one token per step);
//   factor f (Fast-dLLM's factor rule, Thm. 1): with the confidences c_1 >= c_2 >= ... of the masked positions, the
//     largest n with (n + 1)(1 - c_i) <= f for every i <= n (i.e. c_i >= 1 - f / (i + 1)), at least one.
// A block whose positions are all decoded before its last step skips the rest of its steps (no forward pass).
// Unmasked tokens are never changed again (MDLM's carry-over). Sampling (text/gpt2/sampler_chain.h): top-k (0 = all),
// temperature (0 = argmax), top-p, min-p, torch CPU generator seeded with `seed`; all draws of a step come from it in
// a fixed order.
#pragma once

#include "cache/io/enum_table.h"
#include "text/diffusion/mdlm_cache.h"
#include "text/gpt2/sampler_chain.h"

#include <functional>
#include <string>
#include <vector>

namespace anchor::text {

enum class UnmaskRule { Ancestral, Confidence, Margin, Entropy, Random };
const EnumTable<UnmaskRule>& unmask_rule_table(); // "ancestral", "confidence", "margin", "entropy", "random"
std::string unmask_rule_name(UnmaskRule r);

struct SamplerOptions {
    int64_t length = 128;        // total sequence length, prompt included
    int64_t steps = 64;          // total denoising steps over all blocks
    std::vector<int64_t> prompt; // GPT-2-side ids of the fixed prefix
    UnmaskRule rule = UnmaskRule::Ancestral;
    double temperature = 1.0;
    int64_t top_k = 0;
    double top_p = 1.0; // nucleus cut after the temperature (1 = off)
    double min_p = 0.0; // min-p cut after the temperature (0 = off)
    uint64_t seed = 0;
    int64_t block_length = 0; // 0 = one block (all generated positions)
    double threshold = 0.0;   // Fast-dLLM confidence threshold in (0, 1] (0 = off)
    double factor = 0.0;      // Fast-dLLM factor rule f > 0 (0 = off)
    void validate() const;    // text::ParamError naming the field of an impossible value or combination
};

struct StepInfo {
    int64_t step = 0, block = 0, local_step = 0;
    double t = 1.0, s = 0.0;
    int64_t unmasked = 0;               // tokens unmasked in this step
    const std::vector<int64_t>* tokens; // GPT-2-side ids after this step; [MASK] = kMdlmMaskId
};
using StepCallback = std::function<void(const StepInfo&)>;

struct SampleResult {
    std::vector<int64_t> tokens; // GPT-2-side ids, prompt included
    std::vector<int64_t> unmasked_per_step;
    cache::CacheStats cache;    // the denoiser's latent store and decisions over this sample (cache/latent_cache.h)
    int64_t forward_passes = 0; // denoiser calls (ancestral steps that unmask nothing need none)
    double seconds = 0.0;
};

// LLaDA's `get_num_transfer_tokens`: n split over `steps`, the remainder going to the first steps.
std::vector<int64_t> confidence_schedule(int64_t n, int64_t steps);
// How many positions a parallel step unmasks given the confidences (any order) of the block's masked positions
// (>= 1 when there is one): those above `threshold`, or the factor rule's n; 0 when both are off.
int64_t parallel_count(const torch::Tensor& confidence, double threshold, double factor);
// The rule's score of each decoded row (higher = unmasked first), from the chain's result; random draws from `gen`.
torch::Tensor selection_score(UnmaskRule rule, TokenCandidates& drawn, at::Generator& gen);

SampleResult sample(MdlmDenoiser& denoiser, const SamplerOptions& opt, const StepCallback& on_step = {});

} // namespace anchor::text
