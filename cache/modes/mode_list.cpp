#include "cache/modes/mode_list.h"

#include "cache/io/error.h"

#include <algorithm>
#include <cctype>

namespace anchor::cache::modes {

namespace {
std::vector<std::string> split_on(const std::string& s, char sep) {
    std::vector<std::string> out;
    size_t b = 0;
    while (b <= s.size()) {
        const size_t e = std::min(s.find(sep, b), s.size());
        out.push_back(s.substr(b, e - b));
        b = e + 1;
    }
    return out;
}
// "key=value" with a plain key (letters, digits, '_'): a key of the mode before it, not a mode of its own (a mode has
// no '=' before its ':', and a text mode's "+key=value" decode keys start with a mode name and a '+').
bool is_key_value(const std::string& item) {
    const auto eq = item.find('=');
    if (eq == std::string::npos || eq == 0 || item.find(':') != std::string::npos) return false;
    for (size_t i = 0; i < eq; ++i)
        if (!std::isalnum(static_cast<unsigned char>(item[i])) && item[i] != '_') return false;
    return true;
}
} // namespace

std::vector<std::string> split_mode_list(const std::string& list, const std::string& field) {
    if (list.empty()) throw ParamError(field, "expected at least one cache mode, got an empty list");
    std::vector<std::string> out;
    for (const auto& group : split_on(list, ';')) {
        bool first = true;
        for (const auto& item : split_on(group, ',')) {
            if (item.empty()) throw ParamError(field, "an empty cache mode in the list '" + list + "'");
            if (!first && is_key_value(item))
                out.back() += (out.back().find_first_of(":=") == std::string::npos ? ":" : ",") + item;
            else
                out.push_back(item);
            first = false;
        }
    }
    return out;
}

std::vector<std::string> split_mode_lists(const std::vector<std::string>& lists, const std::string& field) {
    if (lists.empty()) throw ParamError(field, "expected at least one cache mode, got none");
    std::vector<std::string> out;
    for (const auto& l : lists)
        for (auto& m : split_mode_list(l, field)) out.push_back(std::move(m));
    return out;
}

} // namespace anchor::cache::modes
