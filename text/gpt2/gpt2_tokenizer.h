// GPT-2 byte-level BPE tokenizer (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners", sec.
// 2.2), exact to OpenAI's `encoder.py`: regex pre-tokenisation, bytes -> printable unicode map, lowest-rank merges.
//
// Vocabulary files: OpenAI `encoder.json` + `vocab.bpe`, or the identical HF `vocab.json` + `merges.txt`.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace anchor::text {

class Gpt2Tokenizer {
public:
    static constexpr int64_t kEndOfText = 50256; // `<|endoftext|>` in the GPT-2 vocabulary

    // `dir` holds encoder.json + vocab.bpe or vocab.json + merges.txt. Throws anchor::Error naming the missing file.
    static Gpt2Tokenizer from_dir(const std::string& dir);
    static Gpt2Tokenizer from_files(const std::string& encoder_json, const std::string& merges);
    // An explicit path (file pair folder) when non-empty, else `<repo>/assets/vocab/gpt2`.
    static Gpt2Tokenizer load_default(const std::string& explicit_dir = "");
    // The folder load_default uses when no path is given.
    static std::string default_dir();
    // True when `dir` holds one of the two file pairs.
    static bool dir_has_vocab(const std::string& dir);

    Gpt2Tokenizer(Gpt2Tokenizer&&) noexcept;
    Gpt2Tokenizer& operator=(Gpt2Tokenizer&&) noexcept;
    ~Gpt2Tokenizer();

    // UTF-8 text -> ids. Invalid UTF-8 throws anchor::Error with the byte offset. With `allow_special`, each literal
    // `<|endoftext|>` becomes id 50256; otherwise it is ordinary text (as in encoder.py).
    std::vector<int64_t> encode(const std::string& text, bool allow_special = false) const;
    // The first `n` ids of encode(text) without encoding the whole text (pre-tokens are decided left to right, so
    // every pre-token but the one cut by a prefix's end is final): for scoring the start of a long file.
    std::vector<int64_t> encode_first(const std::string& text, size_t n) const;
    // The regex pre-tokens (UTF-8 strings) BPE is applied to.
    std::vector<std::string> pretokenize(const std::string& text) const;
    // ids -> UTF-8 text; invalid byte sequences become U+FFFD, one per maximal invalid subsequence (Python
    // errors='replace'). Unknown ids throw anchor::Error.
    std::string decode(const std::vector<int64_t>& ids) const;
    // The raw bytes of one token (may be an incomplete UTF-8 sequence; used for streaming output).
    const std::string& token_bytes(int64_t id) const;

    size_t vocab_size() const;
    size_t n_merges() const;

private:
    Gpt2Tokenizer();
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

// Python `bytes.decode('utf-8', errors='replace')`: each maximal invalid subsequence -> one U+FFFD.
std::string utf8_decode_replace(const std::string& bytes);
// Offset of the first invalid UTF-8 byte, or -1 when `s` is valid (surrogates and overlongs are invalid).
int64_t utf8_first_invalid(const std::string& s);

// Incremental decoder for printing tokens as they are produced: returns the complete characters so far and keeps an
// incomplete trailing sequence for the next call.
class Utf8StreamDecoder {
public:
    std::string push(const std::string& bytes);
    std::string flush(); // whatever is left, with replacement characters
private:
    std::string pending_;
};

} // namespace anchor::text
