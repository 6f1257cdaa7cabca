// Errors of the text library's parameter structs (the params of evaluate_ppl, StreamRunner, the benches, the
// samplers). Each names the field it is about, so a program can say which of its flags was wrong: the library never
// decides exit codes or knows flag names.
#pragma once

#include "cache/io/error.h"

#include <string>
#include <utility>
#include <vector>

namespace anchor::text {

// A bad parameter is anchor::ParamError (cache/io/error.h): field() names the params struct's field.
using anchor::ParamError;

// `message` with every field name of `flags` (field -> flag, e.g. {"max_new_tokens", "--max-new"}) that stands as a
// whole word replaced by its flag: what a program prints for a ParamError (or a report line naming fields).
std::string with_flags(const std::string& message, const std::vector<std::pair<std::string, std::string>>& flags);
inline std::string with_flags(const ParamError& e, const std::vector<std::pair<std::string, std::string>>& flags) {
    return with_flags(std::string(e.what()), flags);
}

} // namespace anchor::text
