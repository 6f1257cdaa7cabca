#include "text/params.h"

#include <cctype>

namespace anchor::text {

std::string Placement::str() const {
    const char* d = dtype == c10::kHalf ? "f16" : dtype == c10::kBFloat16 ? "bf16" : dtype == c10::kFloat ? "f32" : "?";
    return device.str() + " " + d;
}

void Placement::validate() const {
    if (dtype != c10::kFloat && dtype != c10::kHalf && dtype != c10::kBFloat16)
        throw ParamError("dtype", std::string("must be f32, f16 or bf16, got ") + c10::toString(dtype));
    if (dtype == c10::kHalf && device.is_cpu())
        throw ParamError("dtype", "f16 is not available on the CPU (LibTorch has no float16 CPU matrix products); use "
                                  "f32 or bf16");
}

std::string with_flags(const std::string& s, const std::vector<std::pair<std::string, std::string>>& flags) {
    // One pass over the words of the message, so a flag written in is never rewritten by another field.
    auto word_char = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
    std::string out;
    for (size_t i = 0; i < s.size();) {
        // A quoted value ('bogus', 'anchor:steps=x') is what the user typed: copied as it is.
        if (s[i] == '\'' && (i == 0 || !word_char(s[i - 1]))) {
            size_t k = s.find('\'', i + 1);
            while (k != std::string::npos && k + 1 < s.size() && word_char(s[k + 1])) k = s.find('\'', k + 1);
            if (k != std::string::npos) {
                out += s.substr(i, k + 1 - i);
                i = k + 1;
                continue;
            }
        }
        if (!word_char(s[i])) {
            out += s[i++];
            continue;
        }
        size_t j = i;
        while (j < s.size() && word_char(s[j])) ++j;
        const std::string word = s.substr(i, j - i);
        std::string replaced = word;
        // A word already written as a flag (--cache) or as part of one (--max-new) stays.
        const bool flag_already = i >= 1 && s[i - 1] == '-';
        static const std::vector<std::pair<std::string, std::string>> none;
        for (const auto& [field, flag] : flag_already ? none : flags)
            if (field == word) {
                replaced = flag; // the first entry for a field wins
                break;
            }
        out += replaced;
        i = j;
    }
    return out;
}

} // namespace anchor::text
