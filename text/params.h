// Errors of the text library's parameter structs (the params of evaluate_ppl, StreamRunner, the benches, the
// samplers). Each names the field it is about, so a program can say which of its flags was wrong: the library never
// decides exit codes or knows flag names.
#pragma once

#include "cache/io/error.h"

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace anchor::text {

// A bad parameter is anchor::ParamError (cache/io/error.h): field() names the params struct's field.
using anchor::ParamError;

// Where a text model runs and the dtype of its weights and activations (`--device`, `--dtype`): the programs resolve
// the options (cli::parse_dtype, batch::select_device) and the libraries only read these fields. CPU float32 is the
// reference arithmetic and the only placement the CPU kernels (kernels::gemv, the few-row paths) take; any other runs
// LibTorch's own operators. Logits leave a model as float32 on the CPU whatever the placement, so samplers, their
// CPU generator (the same seed gives the same draws on every device) and the reports stay host code.
struct Placement {
    c10::Device device = c10::kCPU;
    c10::ScalarType dtype = c10::kFloat;
    bool reference() const { return device.is_cpu() && dtype == c10::kFloat; }
    std::string str() const; // "cpu f32", "cuda:0 f16"
    // ParamError: "dtype" for a dtype other than f32, f16, bf16; f16 on the CPU (LibTorch 1.13 has no float16 CPU
    // matrix products).
    void validate() const;
};

// `message` with every field name of `flags` (field -> flag, e.g. {"max_new_tokens", "--max-new"}) that stands as a
// whole word replaced by its flag: what a program prints for a ParamError (or a report line naming fields).
std::string with_flags(const std::string& message, const std::vector<std::pair<std::string, std::string>>& flags);
inline std::string with_flags(const ParamError& e, const std::vector<std::pair<std::string, std::string>>& flags) {
    return with_flags(std::string(e.what()), flags);
}

// A prompt token the model cannot read (a compact vocabulary without it), field "prompt": its place in the prompt
// and its id, so a program can name the text piece it came from (the library has the ids, not the text).
class TokenOutsideVocabulary : public ParamError {
public:
    TokenOutsideVocabulary(size_t index, int64_t id, int64_t vocab_size)
        : ParamError("prompt", "token " + std::to_string(index) + " (id " + std::to_string(id) +
                                   ") is not in this model's vocabulary of " + std::to_string(vocab_size) + " tokens"),
          index_(index), id_(id) {}
    size_t index() const { return index_; }
    int64_t id() const { return id_; }
    // The message in the user's terms, given the text the token decodes to: "the text piece 'é' (token 1, id 2634) is
    // not in this model's vocabulary".
    std::string describe(const std::string& piece) const {
        return "the text piece '" + piece + "' (token " + std::to_string(index_) + ", id " + std::to_string(id_) +
               ") is not in this model's vocabulary";
    }

private:
    size_t index_;
    int64_t id_;
};

} // namespace anchor::text
