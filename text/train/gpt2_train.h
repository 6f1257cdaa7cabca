// Training a small GPT-2 on the King James Version (text/train/kjv_reader.h) with the real GPT-2 tokenizer.
//
// The result is an ordinary HF GPT-2 checkpoint (config.json + model.safetensors, the names of text/gpt2/gpt2_model.h,
// tied LM head, 50257 rows) that load_gpt2 reads and that produces real GPT-2 token ids.
//
// Compact softmax: the KJV uses only ~13k of the 50257 GPT-2 tokens, and the output layer dominates a small model's
// cost. By default the model is trained over the tokens that occur in the KJV (the whole text, held-out books
// included: a closed vocabulary, as in word-level LM benchmarks) and expanded to 50257 rows on export. To make the
// expansion exact, coordinate 0 of the final layer norm's output is pinned to the constant 1 (ln_f.weight[0] = 0,
// ln_f.bias[0] = 1), so column 0 of the tied embedding is a per-token logit bias; every token absent from the KJV is
// exported as the row (unseen_logit, 0, ..., 0) and gets logit `unseen_logit` (-30) in every context, i.e. a total
// probability below 1e-8. `full_vocab` trains all 50257 rows instead (several times slower at 128 dims: the output layer dominates).
#pragma once

#include "text/gpt2/gpt2_model.h"
#include "text/train/kjv_reader.h"

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace anchor::text {

class Gpt2Tokenizer;

// ---- data --------------------------------------------------------------------------------------------------------

// Which verses are held out for validation.
enum class HoldoutKind {
    Books, // whole books (no verse of them is trained on)
    Tail,  // the last P% of verses in canonical order (the end of the New Testament)
};
const std::vector<std::pair<HoldoutKind, std::string>>& holdout_kind_names(); // "books", "tail"

struct HoldoutSpec {
    HoldoutKind kind = HoldoutKind::Books;
    std::vector<std::string> books = {"Ruth", "Eccl", "Jonah", "Titus"}; // tags (kjv_books())
    double tail_percent = 5.0;
    // "books:Ruth,Eccl,Jonah,Titus" (tags or English names) | "tail:P" (0 < P < 100); throws text::ParamError
    // (field "holdout").
    static HoldoutSpec parse(const std::string& s);
    static std::string syntax_help();
    std::string str() const;
};

struct KjvSplit {
    std::vector<KjvVerse> train, val;
};
KjvSplit split_kjv(const std::vector<KjvVerse>& verses, const HoldoutSpec& spec);

// Documents as the model sees them: the verses of each book (consecutive run of one book), one verse per line
// without the tags, every line ending in '\n'.
std::vector<std::string> kjv_documents(const std::vector<KjvVerse>& verses);

// Writes the documents as one plain text file (documents joined by '\n'), atomically: the held-out split as
// `heldout.txt` of a training run, for `anchor-text gpt2 ppl --file`.
void write_kjv_text(const std::string& path, const std::vector<KjvVerse>& verses);

// GPT-2 ids of the documents, each followed by <|endoftext|> (50256).
std::vector<int64_t> kjv_token_stream(const std::vector<KjvVerse>& verses, const Gpt2Tokenizer& tok);

// ---- model -------------------------------------------------------------------------------------------------------

// Differentiable full causal forward of ids [B, T] at positions 0..T-1 to the final layer norm's output [B, T, C]
// (Gpt2Model::forward is inference-only: it runs without autograd). The logits are `hidden @ wte.weight^T`.
torch::Tensor gpt2_train_hidden(Gpt2Model& model, const torch::Tensor& ids);

// GPT-2 initialisation (Radford et al. 2019, sec. 2.3): N(0, 0.02) weights, residual projections (attn.c_proj,
// mlp.c_proj) scaled by 1/sqrt(2 n_layer), zero biases, unit layer-norm gains.
void init_gpt2_weights(Gpt2Model& model, uint64_t seed);

// Mean next-token NLL (nats) of `stream` cut into consecutive windows of `seq_len` + 1 tokens (each window is scored
// from its own start; the last partial window too), `batch` windows per forward. `stream` holds the model's ids.
double gpt2_mean_nll(Gpt2Model& model, const std::vector<int64_t>& stream, int64_t seq_len, int64_t batch,
                     int64_t* scored = nullptr);

// ---- training ----------------------------------------------------------------------------------------------------

struct Gpt2TrainOptions {
    std::string kjv_path;  // "" = find_kjv_data()
    std::string vocab_dir; // GPT-2 tokenizer ("" = Gpt2Tokenizer::default_dir())
    // Run folder: checkpoint.safetensors (weights, EMA, AdamW moments, vocab ids, step), train_log.txt, metrics.csv,
    // heldout.txt (the held-out documents as plain text, for `gpt2 ppl`).
    std::string out_dir;
    std::string export_dir; // final model (fp16 by default): config.json + model.safetensors
    bool overwrite_export = false;
    torch::ScalarType export_dtype = torch::kFloat16;
    Gpt2Config config; // n_layer, n_head, n_embd, n_positions (vocab_size is decided here); used when starting fresh
    HoldoutSpec holdout;
    bool full_vocab = false;
    double unseen_logit = -30.0;
    int64_t seq_len = 0; // 0: n_positions
    int64_t batch = 8;
    int64_t steps = 2000; // total optimizer steps (the schedule spans them; resume continues up to this)
    double lr = 2e-3, min_lr_ratio = 0.1, weight_decay = 0.1, beta1 = 0.9, beta2 = 0.99, adam_eps = 1e-8;
    double grad_clip = 1.0;
    int64_t warmup = 100;
    double ema = 0.0; // > 0: exponential moving average of the weights with this decay (exported and evaluated)
    int64_t eval_every = 200, log_every = 10, checkpoint_every = 100;
    int64_t eval_batch = 8;
    uint64_t seed = 0;
    bool resume = true;
    int64_t stop_after = 0; // > 0: stop after this many steps in this invocation (the schedule still spans `steps`)
    double max_minutes = 0; // > 0: stop (checkpoint, evaluate, export) once this much wall time has passed
    std::function<void(const std::string&)> log;
    void validate() const; // text::ParamError naming the field
};

struct Gpt2TrainMetric {
    int64_t step = 0;
    double train_loss = 0, lr = 0, val_loss = -1; // val_loss < 0: not evaluated at this step
    int64_t tokens = 0;                           // training tokens seen up to this step
    double elapsed_s = 0;                         // wall time of the run up to this step (all invocations)
};

struct Gpt2TrainResult {
    int64_t start_step = 0, end_step = 0;
    int64_t vocab_used = 0; // rows trained (the KJV's distinct tokens, or 50257)
    int64_t train_tokens = 0, val_tokens = 0;
    int64_t tokens_seen = 0;              // training tokens processed up to end_step (all invocations)
    double wall_s = 0;                    // training wall time up to end_step (all invocations)
    double train_loss = 0;                // mean over the last log interval
    double val_loss = 0;                  // of the trained (EMA if enabled) weights, compact softmax, at end_step
    double export_val_loss = -1;          // the exported file through load_gpt2 (full 50257-way softmax), when exported
    std::vector<Gpt2TrainMetric> metrics; // the whole run (metrics.csv)
};

Gpt2TrainResult train_gpt2(const Gpt2TrainOptions& opt);

// metrics.csv of a run folder (step,train_loss,lr,val_loss,tokens,elapsed_s).
std::vector<Gpt2TrainMetric> read_train_metrics(const std::string& csv_path);

} // namespace anchor::text
