// A SentencePiece unigram model (Kudo 2018, "Subword Regularization"; Kudo & Richardson 2018) read from its .model
// file (the ModelProto protobuf, parsed here) and applied as libsentencepiece does, without it: the normaliser (the
// precompiled character map, a darts-clone double-array trie of rules such as nmt_nfkc, longest match first; heading,
// trailing and repeated whitespace removed; the dummy "▁" prefix; spaces escaped to U+2581), then the Viterbi best
// segmentation over the pieces' log-probabilities with unknown characters as <unk> at (lowest score - 10), runs of
// <unk> merged into one. BPE / word / char models, byte fallback and whitespace-as-suffix models are refused.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace anchor::unet {

class SentencePieceModel {
public:
    // Throws anchor::Error naming the file and what is wrong.
    static SentencePieceModel load(const std::string& path);
    static SentencePieceModel parse(const std::string& bytes, const std::string& source);

    // The normalised text the pieces are matched against ("▁Hello▁world").
    std::string normalize(const std::string& text) const;
    // Piece ids of `text` (no </s>): SentencePieceProcessor::EncodeAsIds.
    std::vector<int> encode(const std::string& text) const;

    int piece_size() const { return int(pieces_.size()); }
    const std::string& id_to_piece(int id) const { return pieces_.at(size_t(id)).piece; }
    int unk_id() const { return unk_id_; }
    int pad_id() const { return pad_id_; } // trainer_spec's (-1 when the model has none)
    int eos_id() const { return eos_id_; }

    enum class PieceType { Normal = 1, Unknown = 2, Control = 3, UserDefined = 4, Unused = 5, Byte = 6 };
    struct Piece {
        std::string piece;
        float score = 0;
        PieceType type = PieceType::Normal;
    };

private:
    // The (length, replacement offset) of the longest rule of the character map matching a prefix of s, or length 0.
    std::pair<size_t, uint32_t> charsmap_prefix(const char* s, size_t n) const;

    std::vector<Piece> pieces_;
    std::map<std::string, int> matchable_; // Normal, UserDefined, Unused pieces -> id (what the trie holds)
    size_t max_piece_bytes_ = 0;
    std::vector<std::string> user_defined_; // matched whole, before the character map
    float min_score_ = 0, max_score_ = 0;   // over Normal pieces
    int unk_id_ = -1, pad_id_ = -1, eos_id_ = 2;
    bool add_dummy_prefix_ = true, remove_extra_whitespaces_ = true, escape_whitespaces_ = true;
    std::vector<uint32_t> trie_;   // the character map's double-array units
    std::string replacements_;     // NUL-terminated replacement strings the trie's values point into
    std::string source_;
};

} // namespace anchor::unet
