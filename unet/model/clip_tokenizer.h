// OpenAI CLIP byte-level BPE tokenizer (clip/simple_tokenizer.py) with Stable Diffusion's 77-token framing.
//
// Text is cleaned (whitespace runs -> one space, strip, lower-case), split with the CLIP regex, each piece is mapped
// byte -> printable unicode character (GPT-2 byte encoder), and merged with the BPE ranks; the last symbol of a word
// carries the `</w>` end-of-word marker. ftfy/html unescaping of the reference is not applied (identity for the
// ASCII prompts SD users type; see tests/golden/sd/README.md).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace anchor::unet {

struct TokenizedPrompt {
    std::vector<int64_t> ids; // exactly max_length ids: bos + bpe[:max_length-2] + eos + padding
    int num_bpe_tokens = 0;   // untruncated BPE count (so callers can warn)
    bool truncated = false;
};

// The BPE merge of cache/bpe.h (lowest-rank pair first, all its non-overlapping occurrences left to right) in
// O(n log n) for a word of n symbols instead of O(n^2): the pairs sit in a min-heap by (rank, position), the symbols
// in a linked list, and each rank's occurrences are merged as one left-to-right pass, so the result is the same as
// the reference loop for any merge table. Long words are what a hostile prompt is made of.
void bpe_merge_heap(std::vector<std::string>& word, const std::unordered_map<std::string, int>& ranks);

class ClipTokenizer {
public:
    static constexpr int64_t kBos = 49406;
    static constexpr int64_t kEos = 49407;

    // openai `bpe_simple_vocab_16e6.txt.gz` (gzip) or a plain-text merges file with the same layout.
    static ClipTokenizer from_bpe_file(const std::string& path);
    // Hugging Face / diffusers `tokenizer/` folder: vocab.json + merges.txt (+ tokenizer_config.json /
    // special_tokens_map.json for the pad token: "!" -> SD 2.x padding with id 0).
    static ClipTokenizer from_folder(const std::string& dir);
    // The pad token of a tokenizer folder's special_tokens_map.json / tokenizer_config.json, when they name one.
    void read_special_tokens(const std::string& dir);
    // The bundled openai vocabulary (assets/vocab/clip/bpe_simple_vocab_16e6.txt.gz), searched next to the executable,
    // in $ANCHOR_ASSETS and in the source tree. Throws when it cannot be found.
    static ClipTokenizer bundled();
    static std::string bundled_vocab_path();

    // BPE ids of `text` without framing.
    std::vector<int64_t> encode(const std::string& text) const;
    // SD framing: [bos] + bpe[:max_length-2] + [eos], right-padded with pad_id to max_length.
    TokenizedPrompt tokenize(const std::string& text, int max_length = 77) const;

    int64_t pad_id() const { return pad_id_; }
    void set_pad_id(int64_t id) { pad_id_ = id; }
    size_t vocab_size() const { return encoder_.size(); }
    int64_t token_id(const std::string& token) const; // -1 when absent

private:
    void init_byte_encoder();
    void set_merges(const std::vector<std::pair<std::string, std::string>>& merges);
    std::vector<std::string> bpe(const std::string& word) const;

    std::string byte_encoder_[256];
    std::unordered_map<std::string, int64_t> encoder_;
    std::unordered_map<std::string, int> ranks_; // "a b" -> merge rank
    int64_t pad_id_ = kEos;
    struct Regex;
    std::shared_ptr<Regex> regex_;
    mutable std::unordered_map<std::string, std::vector<std::string>> cache_;
    mutable std::shared_ptr<std::mutex> cache_mutex_ = std::make_shared<std::mutex>();
};

} // namespace anchor::unet
