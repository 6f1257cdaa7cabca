// Token sampling as a chain of composable steps, after llama.cpp's sampler interface (llama_sampler_i: apply, accept,
// reset, clone) and its sampler chain: each step transforms the candidates in order, and the last one selects.
//
// Steps: repetition penalty (CTRL, Keskar et al. 2019, sec. 4.1: a logit l of a recent token becomes l / penalty when
// positive, l * penalty otherwise), temperature (l / T), top-k (the k largest logits and every one tied with the k-th),
// top-p (nucleus, Holtzman et al. 2019: the smallest prefix of the candidates in descending order whose probability
// reaches p), min-p (Nguyen et al. 2024: the candidates with p_i >= min_p * p_max); then one that selects: greedy
// (argmax), dist (inverse-CDF draw from a seeded std::mt19937_64) or multinomial (torch::multinomial on a torch CPU
// generator).
//
// Candidates come in one of two layouts, each the arithmetic of a program whose outputs are kept bit for bit:
//   * Sorted (llama.cpp's token-data array): one row; steps that need an order sort it in descending order, cuts
//     narrow it, a cut after probabilities were computed leaves them unnormalised (dist draws from their sum). GPT-2
//     generation: temperature -> top-k -> top-p -> dist.
//   * Masked: n rows over the whole vocabulary (one per position the masked diffusion LM decodes), a removed candidate
//     is -inf. The MDLM samplers: top-k -> temperature -> multinomial (confidence = the chosen token's probability).
// The two layouts give the same distributions (tests/test_sampler_chain.cpp); only the order of their roundings
// differs.
#pragma once

#include <ATen/core/Generator.h>
#include <torch/torch.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace anchor::text {

enum class CandidateLayout { Sorted, Masked };

struct TokenCandidates {
    CandidateLayout layout = CandidateLayout::Masked;
    torch::Tensor logits; // [n, m]: float64 once a step did arithmetic (the input dtype before); -inf = removed
    torch::Tensor ids;    // int64 [n, m], the token of each column; undefined: column j is token j
    torch::Tensor probs;  // float64 [n, m] once a step computed them (softmax of logits; cuts keep them unnormalised)
    bool sorted = false;  // every row in descending logit order (ids defined)
    bool want_confidence = false;
    torch::Tensor selected;   // int64 [n], set by the selecting step
    torch::Tensor confidence; // float64 [n] with want_confidence: probability of the selected token

    // logits [V] or [n, V] of any floating dtype.
    static TokenCandidates from_logits(const torch::Tensor& logits, CandidateLayout layout);
    int64_t rows() const { return logits.size(0); }
    int64_t width() const { return logits.size(1); }
    void to_f64();                                             // logits as float64 (steps that compute call it first)
    void sort();                                               // descending per row; no-op when sorted
    torch::Tensor probabilities();                             // probs, computed (softmax over each row) when undefined
    torch::Tensor token_of(const torch::Tensor& column) const; // token ids of columns [n] (ids, or the column)
    // Keeps the first keep[r] candidates of each sorted row: narrows when every row keeps the same count, else masks.
    void keep_prefix(const std::vector<int64_t>& keep);
    void mask(const torch::Tensor& removed); // bool [n, m]: logits -inf, probs 0
};

class SamplerStep {
public:
    virtual ~SamplerStep() = default;
    virtual std::string name() const = 0;
    virtual void apply(TokenCandidates& c) = 0;
    virtual void accept(int64_t /*token*/) {} // a token the chain selected (or the prompt held)
    virtual void reset() {}                   // back to the state after construction
    virtual std::unique_ptr<SamplerStep> clone() const = 0;
    virtual bool selects() const { return false; }
};

std::unique_ptr<SamplerStep> repetition_penalty_step(double penalty, int64_t last_n);
std::unique_ptr<SamplerStep> temperature_step(double temperature); // temperature > 0
std::unique_ptr<SamplerStep> top_k_step(int64_t k);                // k >= 1; k >= the width keeps everything
std::unique_ptr<SamplerStep> top_p_step(double p);                 // 0 < p <= 1
std::unique_ptr<SamplerStep> min_p_step(double p);                 // 0 <= p <= 1
std::unique_ptr<SamplerStep> greedy_step();
std::unique_ptr<SamplerStep> dist_step(uint64_t seed);
// Draws with `gen` (shared: the caller's generator state advances, e.g. the MDLM sampler's unmasking draws).
std::unique_ptr<SamplerStep> multinomial_step(at::Generator gen);

class SamplerChain {
public:
    explicit SamplerChain(CandidateLayout layout = CandidateLayout::Sorted) : layout_(layout) {}
    SamplerChain(const SamplerChain& o);
    SamplerChain& operator=(const SamplerChain& o);
    SamplerChain(SamplerChain&&) = default;
    SamplerChain& operator=(SamplerChain&&) = default;

    SamplerChain& add(std::unique_ptr<SamplerStep> step);
    // Runs every step on logits [V] or [n, V]; the last step must select. `want_confidence`: fill .confidence.
    TokenCandidates apply(const torch::Tensor& logits, bool want_confidence = false);
    int64_t sample(const torch::Tensor& logits); // one row: its token
    void accept(int64_t token);
    void reset();
    std::string describe() const; // "temperature(0.8) -> top_k(40) -> dist(seed 1)"
    size_t size() const { return steps_.size(); }

private:
    CandidateLayout layout_;
    std::vector<std::unique_ptr<SamplerStep>> steps_;
};

// Sampling parameters of autoregressive generation (anchor-text gpt2 generate).
struct SamplingParams {
    double temperature = 0.0;    // 0: greedy (the other parameters do not apply)
    int64_t top_k = 0;           // 0: every token
    double top_p = 1.0;          // 1: off
    double min_p = 0.0;          // 0: off
    double repeat_penalty = 1.0; // 1: off
    int64_t repeat_last_n = 64;  // tokens the penalty looks back over
    uint64_t seed = 0;
    void validate() const; // ParamError naming the field
};

// Repetition penalty, temperature, top-k, top-p, min-p (the order of Hugging Face transformers' logits processors
// and warpers: the cuts see the tempered distribution), then dist(seed); at temperature 0 the repetition penalty and
// the argmax. Sorted layout. The steps that are off are left out.
SamplerChain make_sampler_chain(const SamplingParams& p);

} // namespace anchor::text
