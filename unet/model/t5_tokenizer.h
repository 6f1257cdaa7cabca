// T5's tokenizer (SD 3's tokenizer_3): the SentencePiece unigram model of spiece.model (unet/model/sentencepiece.h,
// no library needed) with what Hugging Face's T5TokenizerFast / T5Tokenizer (legacy) add around it: the special
// tokens written in the text (<pad>, </s>, <unk>, <extra_id_N>) matched first, each stretch between them encoded on
// its own, </s> appended, truncation to max_length - 1 pieces before it, padding with <pad>.
#pragma once

#include "unet/model/sentencepiece.h"

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace anchor::unet {

class T5Tokenizer {
public:
    // A tokenizer folder: spiece.model and, when present, tokenizer_config.json's added_tokens_decoder (else the
    // model's <pad>/</s>/<unk> and `extra_ids` sentinels <extra_id_i> = pieces + extra_ids - 1 - i, HF's order).
    // Throws anchor::Error naming the folder and what is missing (a folder with only tokenizer.json is refused).
    static T5Tokenizer from_folder(const std::string& dir);

    // The ids HF gives for `text` with add_special_tokens: pieces then </s>, unpadded, untruncated.
    std::vector<int64_t> encode(const std::string& text) const;
    // SD 3's call: padding="max_length", truncation=True: at most max_length - 1 pieces, </s>, then <pad>s.
    std::vector<int64_t> tokenize(const std::string& text, int max_length) const;
    int64_t pad_id() const { return pad_id_; }
    int64_t eos_id() const { return eos_id_; }
    bool loaded() const { return sp_ != nullptr; }

private:
    std::shared_ptr<const SentencePieceModel> sp_;
    std::map<std::string, int64_t> specials_; // text -> id, matched in the text before SentencePiece
    int64_t pad_id_ = 0, eos_id_ = 1;
};

} // namespace anchor::unet
