#include "text/params.h"

#include <cctype>

namespace anchor::text {

std::string with_flags(const std::string& s, const std::vector<std::pair<std::string, std::string>>& flags) {
    // One pass over the words of the message, so a flag written in is never rewritten by another field.
    auto word_char = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
    std::string out;
    for (size_t i = 0; i < s.size();) {
        if (!word_char(s[i])) {
            out += s[i++];
            continue;
        }
        size_t j = i;
        while (j < s.size() && word_char(s[j])) ++j;
        const std::string word = s.substr(i, j - i);
        std::string replaced = word;
        for (const auto& [field, flag] : flags)
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
