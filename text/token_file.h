// Token files: raw uint16 little-endian GPT-2 ids, no header (like tests/golden/text/eval/kjv_tokens.bin and a
// training run's heldout_tokens.bin): prompts for calibration and benchmarks, corpora for training.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace anchor::text {

// Reads a token file: raw uint16 little-endian GPT-2 ids, no header (like tests/golden/text/eval/kjv_tokens.bin).
std::vector<int64_t> load_token_file(const std::string& path);
// `n` windows of `len` ids at evenly spaced offsets of a token file (prompts for calibration and benchmarks);
// throws anchor::Error when the file is shorter than `len`. With `accept` (e.g. MdlmModelImpl::in_vocabulary: held-out
// text may hold tokens a compact vocabulary lacks) each window slides forward to the first accepted one, without
// repeating an offset; throws when fewer than `n` are accepted.
std::vector<std::vector<int64_t>>
token_file_windows(const std::string& path, int64_t n, int64_t len,
                   const std::function<bool(const std::vector<int64_t>&)>& accept = nullptr);
// Writes ids in that format (atomically); throws when an id does not fit in uint16.
void write_token_file(const std::string& path, const std::vector<int64_t>& ids);

} // namespace anchor::text
