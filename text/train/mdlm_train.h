// Training the masked diffusion LM with the MDLM objective (the anchor_text_train library: text/train/).
#pragma once

#include "cache/io/enum_table.h"
#include "text/diffusion/mdlm_model.h"
#include "text/train/gpt2_train.h"

#include <functional>
#include <string>
#include <vector>

namespace anchor::text {

// MDLM continuous-time objective with the log-linear schedule (Sahoo et al. 2024, eq. 10-11):
//   t_b low-discrepancy in [eps, 1], mask each token with probability 1 - alpha_t = (1 - eps) t,
//   L = sum over masked tokens of (1 / t_b) * -log p_theta(x0 | x_t)  /  (B * L),
// the weight -alpha'_t / (1 - alpha_t) = 1 / t. `ids`: internal ids [B, L] (clean); `gen` draws t and the masks.
//
// kMaskedMean replaces the 1 / t weight by 1 / (number of tokens masked in that sequence): the same expectation up to
// the masked-count noise, but a sequence drawn at t ~ eps no longer puts weight ~1/eps on its one or two masked tokens.
// With batches of 8 that weight dominates the gradient (one token at t = 1e-3 outweighs a whole sequence at t = 0.5)
// and training stalls at the unigram loss; at MDLM's batch 512 it averages out. This is the per-sequence normalisation
// of the masked cross-entropy used by MaskGIT-style trainers; evaluation still reports the NELBO.
enum class MdlmLossWeight { kNelbo, kMaskedMean };
const EnumTable<MdlmLossWeight>& mdlm_loss_weight_table();
torch::Tensor mdlm_loss(MdlmModel& model, const torch::Tensor& ids, at::Generator& gen,
                        MdlmLossWeight weight = MdlmLossWeight::kNelbo);

struct TrainOptions {
    // Corpus: a token file, or (use_kjv) the King James Version tokenized with the GPT-2 tokenizer, split by
    // `holdout`; the held-out documents are written to out_dir/heldout.txt and heldout_tokens.bin for evaluation.
    std::string tokens_path;
    bool use_kjv = false;
    std::string kjv_path;  // "" = the installed bible-kjv-text
    std::string vocab_dir; // GPT-2 tokenizer ("" = default)
    HoldoutSpec holdout;
    // config.json, model.safetensors (float32), train_state.safetensors, train_log.txt; with use_kjv also
    // train_tokens.bin, heldout_tokens.bin and heldout.txt
    std::string out_dir;
    MdlmConfig config;         // used when starting fresh
    bool compact_vocab = true; // keep only the corpus' tokens (+ [MASK]) in the embedding/head
    int64_t steps = 1000;      // total optimizer steps (resume continues up to this)
    int64_t batch = 16;
    int64_t seq_len = 128;
    double lr = 1e-3, weight_decay = 0.01, beta1 = 0.9, beta2 = 0.999, adam_eps = 1e-8, grad_clip = 1.0;
    int64_t warmup = 100;
    MdlmLossWeight loss_weight = MdlmLossWeight::kNelbo;
    int64_t checkpoint_every = 100;
    int64_t log_every = 10;
    uint64_t seed = 0;
    bool resume = true;
    int64_t stop_after = 0; // > 0: stop after this many steps in this invocation (the schedule still spans `steps`)
    // Where the model, the optimiser state and the batches live: "cpu", "cuda" or "cuda:N". The masks, times and
    // batch offsets are drawn on the CPU from the per-step generator either way, so a run draws the same batches and
    // masks on every device. On CUDA, float32 matmuls may use TF32 (10-bit mantissa inputs, float32 accumulation).
    std::string device = "cpu";
    // > 0: the schedule's total step count is chosen from the rate measured over the first steps of this invocation
    // so that training ends within this many seconds (at most `steps`, at least warmup + 1); the warm-up-cosine
    // schedule then spans that count. 0: `steps` as given.
    double time_budget_s = 0;
    std::string export_dir; // when set: final weights in `export_dtype` there
    torch::ScalarType export_dtype = torch::kFloat16;
    std::function<void(const std::string&)> log; // progress lines
    void validate() const;                       // text::ParamError naming the field
};

struct TrainResult {
    int64_t start_step = 0, end_step = 0;
    std::vector<double> losses; // per step run here
};

TrainResult train_mdlm(const TrainOptions& opt);

} // namespace anchor::text
