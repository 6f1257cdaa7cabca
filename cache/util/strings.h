// Small string helpers shared by the loaders (file suffixes, tensor-name suffixes).
#pragma once

#include <string>

namespace anchor {

inline bool ends_with(const std::string& s, const std::string& suffix) {
    return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

} // namespace anchor
