// Small string helpers shared by the loaders (file suffixes, tensor-name suffixes, sizes in messages).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace anchor {

inline bool ends_with(const std::string& s, const std::string& suffix) {
    return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// "WxH", an image size in messages.
inline std::string wxh(int w, int h) {
    return std::to_string(w) + "x" + std::to_string(h);
}

// The items of a list in an error message, one per indented line ("\n  a\n  b"); past `max_show`, a count of the rest
// (a LoRA file matching nothing can hold thousands of names).
inline std::string indented_list(const std::vector<std::string>& v, size_t max_show = static_cast<size_t>(-1)) {
    std::string out;
    for (size_t i = 0; i < v.size() && i < max_show; ++i) out += "\n  " + v[i];
    if (v.size() > max_show) out += "\n  ... and " + std::to_string(v.size() - max_show) + " more";
    return out;
}

} // namespace anchor
