// Adapting an autoregressive GPT-2 into a DiffuGPT-style masked diffusion LM (Gong et al. 2024, "Scaling Diffusion
// Language Models via Adaptation from Autoregressive Models", sec. 3.2), on the King James Version:
//
// - initialisation from the AR model's weights, with [MASK] appended to the vocabulary (its embedding row starts as
//   the mean of the trained rows, as resizing an embedding table does);
// - attention-mask annealing: the causal mask is relaxed towards full attention over the first `anneal_steps`
//   optimizer steps. At step s every query may attend to the keys at or before it and, independently, to each later
//   key with probability r(s) = min(1, (s + 1) / anneal_steps) (one Bernoulli draw per (query, key) pair and step,
//   shared by the batch and the heads, as DiffuLLaMA's get_anneal_attn_mask); from then on attention is full;
// - the shift: the hidden state at position i predicts the token at i + 1, so the AR model's head is reused as is;
// - the masked-diffusion loss with the 1/t weight (absorbing state, linear schedule: each token is [MASK] with
//   probability t): L = sum_b (1 / t_b) * sum_{i >= 1, x_t[b, i] = [MASK]} -log p(x0[b, i] | logits[b, i - 1]),
//   divided by the number of masked positions of the batch (the normalisation of the reference's training loop).
//
// The exported folder is what load_dlm's DiffuGPT path reads: GPT-2's config.json (vocab_size + 1, mask_token_id) and
// DiffuGPT's tensor names (embed_tokens.weight, denoise_model.{wpe, h.N.*, ln_f}.*; tied head).
//
// Compact softmax as in gpt2_train.h: when the AR model has the pinned logit-bias coordinate (ln_f.weight[0] = 0,
// ln_f.bias[0] = 1: kjv-gpt2), training runs over the KJV's tokens plus [MASK] and the export expands the table to
// every GPT-2 id (unseen tokens as the row (unseen_logit, 0, ..., 0)), exactly as the AR model's export did.
#pragma once

#include "text/gpt2/gpt2_model.h"
#include "text/train/gpt2_train.h"

#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

namespace anchor::text {

// r(s) = min(1, (s + 1) / anneal_steps) for step s (0-based); 1 when anneal_steps is 0 (full attention at once).
double diffugpt_anneal_ratio(int64_t step, int64_t anneal_steps);

// Which keys each query may attend to, [T, T] bool (row = query): key j <= i always, a later key with probability
// `ratio` (ratio 0: the causal mask; ratio >= 1: all true, no draw).
torch::Tensor diffugpt_anneal_mask(int64_t T, double ratio, at::Generator& gen);

// Differentiable forward of ids [B, T] at positions 0..T-1 to the final layer norm's output [B, T, C] with attention
// limited to `allowed` ([T, T] bool, query rows; undefined: full attention).
torch::Tensor diffugpt_train_hidden(Gpt2Model& model, const torch::Tensor& ids, const torch::Tensor& allowed);

struct DiffuGptLoss {
    torch::Tensor weighted;   // sum of (1 / t_b) * CE over the masked positions / their count (what is minimised)
    torch::Tensor unweighted; // sum of CE over the masked positions / their count
    int64_t masked = 0;       // positions in the loss (x_t = [MASK] at i >= 1)
};

// The shifted masked-diffusion loss: logits [B, T, V] (row i predicts token i + 1), clean ids x0 [B, T], noised ids xt
// [B, T] (`mask_id` where masked), t [B] in (0, 1]. Position 0 has no row predicting it; the last row predicts
// nothing. No masked position: both losses are 0 (still differentiable).
DiffuGptLoss diffugpt_shift_loss(const torch::Tensor& logits, const torch::Tensor& x0, const torch::Tensor& xt,
                                 int64_t mask_id, const torch::Tensor& t);

// The forward process: each token of x0 [B, T] becomes `mask_id` with probability t_b (u < t_b, u uniform).
torch::Tensor diffugpt_noise(const torch::Tensor& x0, const torch::Tensor& t, int64_t mask_id, at::Generator& gen);

// Times of a batch: MDLM's low-discrepancy draw (Sahoo et al. 2024, sec. 3.5) t_b = eps + (1 - eps) frac(u + b / B),
// one uniform u per batch, so every batch spans (eps, 1].
torch::Tensor diffugpt_times(int64_t B, double eps, at::Generator& gen);

struct DiffuGptTrainOptions {
    std::string init_from; // the autoregressive GPT-2 folder (load_gpt2)
    std::string kjv_path;  // "" = find_kjv_data()
    std::string vocab_dir; // GPT-2 tokenizer ("" = default)
    HoldoutSpec holdout;
    // Run folder: train_log.txt, metrics.csv (step,train_loss,lr,val_loss,tokens,elapsed_s; train_loss the weighted
    // loss, val_loss the held-out NELBO per token), heldout.txt and heldout_tokens.bin (the held-out text and its ids).
    std::string out_dir;
    std::string export_dir; // the DiffuGPT folder (config.json + model.safetensors)
    bool overwrite_export = false;
    torch::ScalarType export_dtype = torch::kFloat16;
    int64_t seq_len = 0; // 0: the AR model's n_positions
    int64_t batch = 8;
    int64_t steps = 1000; // the schedule's length (a time budget may shorten it)
    int64_t warmup = 50;
    int64_t anneal_steps = 200;
    double lr = 5e-4, min_lr_ratio = 0.1, weight_decay = 0.0, beta1 = 0.9, beta2 = 0.99, adam_eps = 1e-8;
    double grad_clip = 1.0;
    double sampling_eps = 1e-3; // t in [eps, 1]
    double unseen_logit = -30.0;
    // > 0: after the first 10 steps, and every 50 steps after, the schedule is resized from the measured step rate to
    // end within this many seconds (at most `steps`, at least warmup + 1), and training stops when they have passed.
    double time_budget_s = 0;
    int64_t eval_every = 100, log_every = 10;
    int64_t eval_windows = 48; // held-out windows of seq_len scored by evaluation (fewer when the text is shorter)
    uint64_t seed = 0;
    std::function<void(const std::string&)> log;
    void validate() const; // text::ParamError naming the field
};

struct DiffuGptTrainResult {
    int64_t steps_run = 0, planned_steps = 0;
    int64_t vocab_rows = 0; // rows trained (the KJV's tokens + [MASK], or every AR row + [MASK])
    int64_t mask_id = 0;    // [MASK]'s id in the exported model
    double train_loss = 0;  // weighted loss, mean over the last log interval
    double val_nelbo_start = 0, val_nelbo = 0; // held-out NELBO per token (nats) of the initial and final weights
    double export_val_nelbo = -1;              // of the exported file read back through load_dlm
    double wall_s = 0;
    std::vector<Gpt2TrainMetric> metrics;
};

DiffuGptTrainResult train_diffugpt(const DiffuGptTrainOptions& opt);

// Held-out NELBO per predicted token (nats): consecutive windows of seq_len ids of `stream` (at most `windows`), each
// noised at a time of the fixed grid t_w = eps + (1 - eps) (w + 0.5) / W with masks drawn from `seed`, the
// 1/t-weighted shifted loss summed over windows and divided by the positions that could be predicted (seq_len - 1 per
// window). `logits_of` maps noised ids [B, seq_len] (the ids `stream` is in) to logits [B, seq_len, V] under full
// attention. The masks depend only on the seed and the shapes, so two models' figures are paired.
double diffugpt_heldout_nelbo(const std::vector<int64_t>& stream, int64_t seq_len, int64_t windows, int64_t mask_id,
                              double eps, uint64_t seed,
                              const std::function<torch::Tensor(const torch::Tensor&)>& logits_of);

} // namespace anchor::text
