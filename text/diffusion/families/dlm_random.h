// Random-weight LLaDA / Dream models of the published shapes, written as llama.cpp-layout GGUF files (gguf.h's
// GgufWriter) for benchmarks that need the real sizes without the published weights: LLaDA-8B and Dream-7B. The
// tensors are generated and written a slab of rows at a time, so an 8B model never exists in memory.
#pragma once

#include "kernels/qgemm.h"
#include "text/diffusion/families/dlm_model.h"

#include <string>
#include <vector>

namespace anchor::text {

// "llada-8b" (LLaDA-8B's config.json), "dream-7b" (Dream-v0-7B / Qwen2.5-7B), "llada-tiny", "dream-tiny" (test sizes).
const std::vector<std::string>& dlm_random_presets();
// anchor::Error listing the presets for an unknown name.
DlmConfig dlm_random_preset(const std::string& name);

// Writes `c` with N(0, 0.02) matrices (and biases), unit norms, a byte-fallback SentencePiece-style vocabulary
// ("<0xNN>" byte tokens, so any text tokenises) with the mask / end tokens marked as control tokens. Matrices are
// stored as `weights`; norms and biases as f32. Seeded: the same seed writes the same file.
void write_random_dlm_gguf(const std::string& path, const DlmConfig& c, kernels::QWeightType weights, uint64_t seed);

} // namespace anchor::text
