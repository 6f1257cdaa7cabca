// Finding the files shipped in assets/ (vocabularies, demo models) without flags: $ANCHOR_ASSETS, next to the
// executable (<exe>/assets, <exe>/../assets, <exe>/../share/anchorcache/assets) and the source tree.
#pragma once

#include <string>
#include <vector>

namespace anchor {

// Candidate locations of assets/<rel>, in search order.
std::vector<std::string> asset_candidates(const std::string& rel);
// The first existing candidate; throws anchor::Error naming `what` and every place searched.
std::string find_asset(const std::string& rel, const std::string& what);
// The first existing candidate, or "" when none exists.
std::string find_asset_or_empty(const std::string& rel);

} // namespace anchor
