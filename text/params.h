// Errors of the text library's parameter structs (the params of evaluate_ppl, StreamRunner, the benches, the
// samplers). Each names the field it is about, so a program can say which of its flags was wrong: the library never
// decides exit codes or knows flag names.
#pragma once

#include "cache/io/error.h"

#include <string>
#include <utility>
#include <vector>

namespace anchor::text {

// A bad parameter: an anchor::Error whose message starts with the struct field's name ("max_new_tokens must be >= 1,
// got 0"); field() is that name.
class ParamError : public Error {
public:
    ParamError(const std::string& field, const std::string& rest)
        : Error(field + " " + rest), field_(field), detail_(rest) {}
    const std::string& field() const { return field_; }
    const std::string& detail() const { return detail_; } // the message after the field name

private:
    std::string field_, detail_;
};

// `message` with every field name of `flags` (field -> flag, e.g. {"max_new_tokens", "--max-new"}) that stands as a
// whole word replaced by its flag: what a program prints for a ParamError (or a report line naming fields).
std::string with_flags(const std::string& message, const std::vector<std::pair<std::string, std::string>>& flags);
inline std::string with_flags(const ParamError& e, const std::vector<std::pair<std::string, std::string>>& flags) {
    return with_flags(std::string(e.what()), flags);
}

} // namespace anchor::text
