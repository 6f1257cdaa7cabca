// The byte-pair-encoding merge loop shared by the GPT-2 and CLIP tokenizers (Sennrich et al. 2016, as in OpenAI's
// encoder.py / simple_tokenizer.py): repeatedly take the adjacent pair with the lowest merge rank (the first one on
// ties, like Python's min()) and merge every non-overlapping occurrence of it, left to right.
#pragma once

#include <climits>
#include <string>
#include <vector>

namespace anchor {

// `ranks` maps "left right" (one space) to the merge rank; `word` holds the symbols and is merged in place.
template <class RankMap> void bpe_merge(std::vector<std::string>& word, const RankMap& ranks) {
    std::string key;
    while (word.size() > 1) {
        int best = INT_MAX;
        size_t best_i = 0;
        for (size_t i = 0; i + 1 < word.size(); ++i) {
            key.assign(word[i]).append(" ").append(word[i + 1]);
            auto it = ranks.find(key);
            if (it != ranks.end() && it->second < best) best = it->second, best_i = i;
        }
        if (best == INT_MAX) break;
        const std::string first = word[best_i], second = word[best_i + 1];
        std::vector<std::string> merged;
        merged.reserve(word.size());
        for (size_t i = 0; i < word.size();) {
            if (i + 1 < word.size() && word[i] == first && word[i + 1] == second) {
                merged.push_back(first + second);
                i += 2;
            } else {
                merged.push_back(std::move(word[i]));
                ++i;
            }
        }
        word.swap(merged);
    }
}

} // namespace anchor
