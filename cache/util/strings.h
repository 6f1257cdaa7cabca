// Small string helpers shared by the loaders (file suffixes, tensor-name suffixes, sizes in messages).
#pragma once

#include <string>

namespace anchor {

inline bool ends_with(const std::string& s, const std::string& suffix) {
    return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// "WxH", an image size in messages.
inline std::string wxh(int w, int h) {
    return std::to_string(w) + "x" + std::to_string(h);
}

} // namespace anchor
