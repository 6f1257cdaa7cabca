// Error types shared by every part of AnchorCache.
//
// Errors are thrown inside with context (file, tensor, expected vs actual) and caught at the program edge, where
// `UsageError` (the program's own option checks) and `ParamError` (a library parameter, named by its field) exit 2
// and every other error exits 1 (see cli/common.h).
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace anchor {

// A runtime failure: bad file, numerical blow-up, I/O error. Programs exit 1.
class Error : public std::runtime_error {
public:
    explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// A mistake in how the program was called (bad flag value, contradictory options). Programs exit 2.
class UsageError : public Error {
public:
    explicit UsageError(const std::string& what) : Error(what) {}
};

// A parameter of a library call is out of range or contradicts another. It names the params struct's field; the
// library never decides an exit code: a program maps the field to its option and exits 2 (cli/common.h).
class ParamError : public Error {
public:
    ParamError(std::string field, const std::string& detail)
        : Error(field + ": " + detail), field_(std::move(field)), detail_(detail) {}
    const std::string& field() const { return field_; }
    const std::string& detail() const { return detail_; }

private:
    std::string field_, detail_;
};

// Formats a shape as "[a, b, c]" for error messages.
inline std::string shape_str(const std::vector<int64_t>& shape) {
    std::ostringstream os;
    os << "[";
    for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
    os << "]";
    return os.str();
}

} // namespace anchor
