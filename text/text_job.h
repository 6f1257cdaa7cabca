// anchor-text's batch jobs: the prompts of a prompts file, one output text file (and its sidecar record) per prompt,
// sharded over the processes of an MPI job, resumed from the outputs that exist, with rank 0's manifest
// (cache/util/batch_job.h). Prompt k runs with seed + k, so N processes write the files one process writes.
#pragma once

#include "cache/util/batch_job.h"
#include "text/gpt2/gpt2_generate.h"
#include "text/diffusion/mdlm_run.h"

#include <functional>
#include <string>
#include <vector>

namespace anchor::text {

// GPT-2 streaming generation of every prompt (the model and tokenizer loaded once): the output is the prompt and
// its continuation; the record the generation report (tokens, seconds, kv, positions, sampler, finish reason).
batch::ItemJobResult run_gpt2_prompts(const GenerateParams& p, const batch::ItemJob& job,
                                      const std::function<void(const nlohmann::json&)>& done = {});

// Text diffusion of every prompt (GPT-2 BPE, the MDLM and the scoring GPT-2 loaded once): the output is the prompt
// and the generated text; the record the run (cache mode, tokens, seconds, forward passes, reuse, gen-PPL). One
// cache mode per job.
batch::ItemJobResult run_diffusion_prompts(const DiffusionGenerateParams& p, const Gpt2Tokenizer& tok,
                                           const batch::ItemJob& job,
                                           const std::function<void(const nlohmann::json&)>& done = {});

// The text of the tokens of a diffusion sample from `from` (the prompt's end), [MASK] positions left out.
std::string generated_text(const std::vector<int64_t>& tokens, int64_t from, const Gpt2Tokenizer& tok);

} // namespace anchor::text
