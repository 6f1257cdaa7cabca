// `anchor-text diffusion generate|chat` on the published families (DiffuGPT, LLaDA, Dream; text/diffusion/families).
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace anchor::cli {

// The options `generate` shares with the MDLM path (filled by its own option table).
struct DlmSharedArgs {
    std::string model, prompt, prompt_ids, vocab, cache = "off";
    int64_t steps = 0, block_length = 0, top_k = 0, seed = 0;
    double temperature = 0, top_p = 1;
    bool print_ids = false;
    std::vector<std::string> compare; // --compare: cache modes run side by side (the first is the baseline)
};

// `diffusion bench` on a published family: its own figures (the MDLM bench's options it reads).
struct DlmBenchCliArgs {
    std::string model, baseline = "off", json_out;
    std::vector<std::string> caches; // empty: prefix,dual where the family has them
    std::vector<int64_t> steps;      // each a run of every mode
    int64_t prompt_len = 64, block_length = 0;
    int repeats = 3;
    uint64_t seed = 0;
    double temperature = 0;
    bool overwrite = false;
    // --prompts-from: windows of a token file as prompts (`repeats` of them, prompt_len ids), --score-with: their
    // answers' gen-PPL under a GPT-2 (text/bench/dlm_quality_bench.h) instead of the synthetic-prompt timing.
    std::string prompts_from, score_with;
};

// The families' own options.
struct DlmCliArgs {
    std::string family;     // --family (empty: detected from the folder)
    int64_t gen_length = 0; // --gen-length
    std::string remask;     // --remask (empty: the family's)
    int64_t mask_id = -1;   // --mask-id
    double eps = 1e-3;      // --eps (Dream)
    double alg_temp = 0;    // --alg-temp (Dream)
    std::string weights_dtype; // --weights-dtype (empty: float32 for a folder, as stored for a GGUF)
    std::string qgemm;         // --qgemm: f32 | bf16 | int8 (empty: --gemm's choice where given, else the default)
    bool no_chat = false, no_eos_stop = false, stream = false;
    CLI::App* app = nullptr; // to tell set options from defaults
};

// Ids separated by commas or spaces, each in [0, vocab); UsageError "<what>: 'x' is not <noun> (0..vocab-1)".
std::vector<int64_t> parse_token_ids(const std::string& s, const std::string& what, int64_t vocab,
                                     const std::string& noun);

void add_dlm_options(CLI::App* sub, DlmCliArgs& a);
// True when this run is for a published family: --family or --gen-length given, or -m names such a folder.
bool dlm_requested(const DlmCliArgs& a, const std::string& model);
int run_dlm_generate(const DlmCliArgs& a, const DlmSharedArgs& s);
int run_dlm_bench(const DlmCliArgs& a, const DlmBenchCliArgs& b);
// Adds `diffusion chat` (its own options and runner).
void add_dlm_chat_command(CLI::App* diffusion, std::vector<std::pair<CLI::App*, std::function<int()>>>& runners);
// Adds `diffusion random-model` (LLaDA-8B / Dream-7B shapes as GGUF, text/diffusion/families/dlm_random.h).
void add_dlm_random_model_command(CLI::App* diffusion,
                                  std::vector<std::pair<CLI::App*, std::function<int()>>>& runners);

} // namespace anchor::cli
