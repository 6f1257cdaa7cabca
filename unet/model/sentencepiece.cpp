// SentencePiece unigram model without libsentencepiece (unet/model/sentencepiece.h). The steps and their tie-breaks
// are SentencePiece's own (normalizer.cc Normalize / NormalizePrefix, unigram_model.cc EncodeOptimized), so the ids
// equal SentencePieceProcessor's and Hugging Face's T5 tokenizers' on the same model.
#include "unet/model/sentencepiece.h"

#include "cache/io/error.h"
#include "cache/io/read_file.h"

#include <algorithm>
#include <cstring>

namespace anchor::unet {

namespace {

// ---- protobuf wire format (the fields of sentencepiece_model.proto that encoding reads) ----
struct SpmWire {
    const std::string& buf;
    size_t pos, end;
    const std::string& source;

    [[noreturn]] void broken(const std::string& why) const {
        throw Error("'" + source + "': not a SentencePiece model (" + why + " at byte " + std::to_string(pos) + ")");
    }
    uint64_t varint() {
        uint64_t v = 0;
        for (int shift = 0; shift < 64; shift += 7) {
            if (pos >= end) broken("truncated varint");
            const auto b = uint8_t(buf[pos++]);
            v |= uint64_t(b & 0x7f) << shift;
            if (!(b & 0x80)) return v;
        }
        broken("overlong varint");
    }
    bool next(int& field, int& wire) {
        if (pos >= end) return false;
        const uint64_t key = varint();
        field = int(key >> 3);
        wire = int(key & 7);
        return true;
    }
    std::pair<size_t, size_t> bytes() { // [begin, end) of a length-delimited field
        const uint64_t n = varint();
        if (n > end - pos) broken("length past the end");
        const size_t b = pos;
        pos += size_t(n);
        return {b, pos};
    }
    float fixed32_float() {
        if (end - pos < 4) broken("truncated fixed32");
        uint32_t u = 0;
        for (int i = 0; i < 4; ++i) u |= uint32_t(uint8_t(buf[pos + size_t(i)])) << (8 * i);
        pos += 4;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
    void skip(int wire) {
        if (wire == 0)
            varint();
        else if (wire == 1)
            pos + 8 <= end ? void(pos += 8) : broken("truncated fixed64");
        else if (wire == 2)
            bytes();
        else if (wire == 5)
            pos + 4 <= end ? void(pos += 4) : broken("truncated fixed32");
        else
            broken("wire type " + std::to_string(wire));
    }
    SpmWire sub(std::pair<size_t, size_t> r) const { return SpmWire{buf, r.first, r.second, source}; }
};

// SentencePiece's OneCharLen: the UTF-8 length its lead byte announces (a stray continuation byte counts as 1).
int spm_one_char_len(const char* s) {
    static const int kLen[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    return kLen[uint8_t(*s) >> 4];
}

// The length of the valid UTF-8 character at s (at most n bytes), or 0 when it is malformed.
size_t spm_valid_utf8_len(const char* s, size_t n) {
    const auto c = uint8_t(s[0]);
    if (c < 0x80) return 1;
    size_t len;
    uint32_t cp, min;
    if ((c & 0xe0) == 0xc0) len = 2, cp = c & 0x1f, min = 0x80;
    else if ((c & 0xf0) == 0xe0) len = 3, cp = c & 0x0f, min = 0x800;
    else if ((c & 0xf8) == 0xf0) len = 4, cp = c & 0x07, min = 0x10000;
    else return 0;
    if (len > n) return 0;
    for (size_t i = 1; i < len; ++i) {
        const auto b = uint8_t(s[i]);
        if ((b & 0xc0) != 0x80) return 0;
        cp = (cp << 6) | (b & 0x3f);
    }
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
    return len;
}

constexpr const char* kSpmSpace = "\xe2\x96\x81"; // U+2581, SentencePiece's escaped space
constexpr float kSpmUnkPenalty = 10.0f;
constexpr size_t kSpmMaxTrieResults = 32; // the normaliser keeps the first 32 prefix matches (normalizer.h)

} // namespace

SentencePieceModel SentencePieceModel::load(const std::string& path) {
    return parse(read_file(path, "SentencePiece model"), path);
}

SentencePieceModel SentencePieceModel::parse(const std::string& bytes, const std::string& source) {
    SentencePieceModel m;
    m.source_ = source;
    SpmWire top{bytes, 0, bytes.size(), source};
    int field, wire;
    std::string charsmap;
    int model_type = 1;
    bool byte_fallback = false, whitespace_suffix = false;
    while (top.next(field, wire)) {
        if (field == 1 && wire == 2) { // ModelProto.pieces
            auto p = top.sub(top.bytes());
            Piece piece;
            while (p.next(field, wire)) {
                if (field == 1 && wire == 2) {
                    const auto r = p.bytes();
                    piece.piece = bytes.substr(r.first, r.second - r.first);
                } else if (field == 2 && wire == 5) {
                    piece.score = p.fixed32_float();
                } else if (field == 3 && wire == 0) {
                    const auto t = p.varint();
                    if (t < 1 || t > 6) p.broken("piece type " + std::to_string(t));
                    piece.type = PieceType(t);
                } else {
                    p.skip(wire);
                }
            }
            m.pieces_.push_back(std::move(piece));
        } else if (field == 2 && wire == 2) { // trainer_spec
            auto t = top.sub(top.bytes());
            while (t.next(field, wire)) {
                if (wire != 0) {
                    t.skip(wire);
                    continue;
                }
                const auto v = int64_t(t.varint());
                if (field == 3) model_type = int(v);
                else if (field == 35) byte_fallback = v != 0;
                else if (field == 24) whitespace_suffix = v != 0;
                else if (field == 42) m.eos_id_ = int(int32_t(v));
                else if (field == 43) m.pad_id_ = int(int32_t(v));
            }
        } else if (field == 3 && wire == 2) { // normalizer_spec
            auto n = top.sub(top.bytes());
            while (n.next(field, wire)) {
                if (field == 2 && wire == 2) {
                    const auto r = n.bytes();
                    charsmap = bytes.substr(r.first, r.second - r.first);
                } else if (field >= 3 && field <= 5 && wire == 0) {
                    const bool v = n.varint() != 0;
                    (field == 3 ? m.add_dummy_prefix_ : field == 4 ? m.remove_extra_whitespaces_ : m.escape_whitespaces_) =
                        v;
                } else {
                    n.skip(wire);
                }
            }
        } else {
            top.skip(wire);
        }
    }
    if (m.pieces_.empty()) throw Error("'" + source + "': the SentencePiece model has no pieces");
    if (model_type != 1)
        throw Error("'" + source + "': SentencePiece model type " + std::to_string(model_type) +
                    " is not supported (only unigram, T5's)");
    if (byte_fallback) throw Error("'" + source + "': SentencePiece byte fallback is not supported");
    if (whitespace_suffix)
        throw Error("'" + source + "': SentencePiece treat_whitespace_as_suffix is not supported");
    m.min_score_ = 3.4e38f;
    m.max_score_ = 1.17549435e-38f; // FLT_MIN, as SentencePiece starts it
    for (size_t i = 0; i < m.pieces_.size(); ++i) {
        const auto& p = m.pieces_[i];
        if (p.piece.empty()) throw Error("'" + source + "': piece " + std::to_string(i) + " is empty");
        if (p.type == PieceType::Normal || p.type == PieceType::UserDefined || p.type == PieceType::Unused) {
            if (!m.matchable_.emplace(p.piece, int(i)).second)
                throw Error("'" + source + "': piece '" + p.piece + "' is defined twice");
            m.max_piece_bytes_ = std::max(m.max_piece_bytes_, p.piece.size());
        }
        if (p.type == PieceType::UserDefined) m.user_defined_.push_back(p.piece);
        if (p.type == PieceType::Unknown) m.unk_id_ = int(i);
        if (p.type == PieceType::Normal) {
            m.min_score_ = std::min(m.min_score_, p.score);
            m.max_score_ = std::max(m.max_score_, p.score);
        }
    }
    if (m.unk_id_ < 0) throw Error("'" + source + "': the SentencePiece model has no <unk> piece");
    if (!charsmap.empty()) {
        // precompiled_charsmap: uint32 (little-endian) trie size in bytes, the trie's units, then the replacements.
        if (charsmap.size() <= 4) throw Error("'" + source + "': precompiled_charsmap is truncated");
        uint32_t trie_bytes = 0;
        for (int i = 0; i < 4; ++i) trie_bytes |= uint32_t(uint8_t(charsmap[size_t(i)])) << (8 * i);
        if (trie_bytes >= charsmap.size() - 4 || trie_bytes % 4 != 0)
            throw Error("'" + source + "': precompiled_charsmap's trie size " + std::to_string(trie_bytes) +
                        " does not fit its " + std::to_string(charsmap.size()) + " bytes");
        m.trie_.resize(trie_bytes / 4);
        for (size_t u = 0; u < m.trie_.size(); ++u)
            for (int i = 0; i < 4; ++i) m.trie_[u] |= uint32_t(uint8_t(charsmap[4 + 4 * u + size_t(i)])) << (8 * i);
        m.replacements_ = charsmap.substr(4 + trie_bytes);
        m.replacements_.push_back('\0');
    }
    return m;
}

std::pair<size_t, uint32_t> SentencePieceModel::charsmap_prefix(const char* s, size_t n) const {
    // darts-clone's commonPrefixSearch over the unit array: a unit holds has_leaf (bit 8), its label (the low byte,
    // bit 31 for leaves), and the offset to its children (bits 10.., scaled by 2^8 when bit 9 is set).
    auto offset = [](uint32_t u) { return size_t(u >> 10) << ((u & (1u << 9)) >> 6); };
    size_t longest = 0, found = 0;
    uint32_t value = 0;
    if (trie_.empty()) return {0, 0};
    size_t node = offset(trie_[0]);
    for (size_t i = 0; i < n; ++i) {
        const auto c = uint8_t(s[i]);
        node ^= c;
        if (node >= trie_.size()) break;
        const uint32_t unit = trie_[node];
        if ((unit & ((1u << 31) | 0xff)) != c) break;
        node ^= offset(unit);
        if ((unit >> 8) & 1) {
            if (node >= trie_.size()) break;
            if (found++ < kSpmMaxTrieResults) longest = i + 1, value = trie_[node] & ((1u << 31) - 1);
        }
    }
    return {longest, value};
}

std::string SentencePieceModel::normalize(const std::string& text) const {
    // One normalised unit of the input: (replacement, bytes consumed), normalizer.cc NormalizePrefix.
    auto prefix = [&](size_t at) -> std::pair<std::string, size_t> {
        const char* s = text.data() + at;
        const size_t n = text.size() - at;
        size_t ud = 0;
        for (const auto& u : user_defined_)
            if (u.size() > ud && u.size() <= n && text.compare(at, u.size(), u) == 0) ud = u.size();
        if (ud) return {text.substr(at, ud), ud};
        const auto [len, off] = charsmap_prefix(s, n);
        if (len) {
            if (off >= replacements_.size())
                throw Error("'" + source_ + "': precompiled_charsmap points past its replacements");
            return {std::string(replacements_.c_str() + off), len};
        }
        const size_t clen = spm_valid_utf8_len(s, n);
        if (clen == 0) return {"\xef\xbf\xbd", 1}; // a malformed byte: U+FFFD, one byte consumed
        return {std::string(s, clen), clen};
    };
    std::string out;
    size_t at = 0;
    if (remove_extra_whitespaces_)
        while (at < text.size()) {
            const auto p = prefix(at);
            if (p.first != " ") break;
            at += p.second;
        }
    if (at >= text.size()) return out;
    const std::string space = escape_whitespaces_ ? kSpmSpace : " ";
    if (add_dummy_prefix_) out += space;
    bool prev_space = remove_extra_whitespaces_;
    while (at < text.size()) {
        const auto p = prefix(at);
        std::string_view sp = p.first;
        while (prev_space && !sp.empty() && sp.front() == ' ') sp.remove_prefix(1);
        if (!sp.empty()) {
            for (char c : sp) {
                if (escape_whitespaces_ && c == ' ')
                    out += kSpmSpace;
                else
                    out += c;
            }
            prev_space = sp.back() == ' ';
        }
        at += p.second;
        if (!remove_extra_whitespaces_) prev_space = false;
    }
    if (remove_extra_whitespaces_)
        while (out.size() >= space.size() && out.compare(out.size() - space.size(), space.size(), space) == 0)
            out.resize(out.size() - space.size());
    return out;
}

std::vector<int> SentencePieceModel::encode(const std::string& text) const {
    const std::string s = normalize(text);
    if (s.empty()) return {};
    // unigram_model.cc EncodeOptimized: the best path ending at each byte, candidates in order of start, then of
    // length; a later candidate replaces an earlier only with a strictly higher score (float arithmetic).
    struct Best {
        int id = -1;
        float score = 0;
        int starts_at = -1;
    };
    const int size = int(s.size());
    const float unk_score = min_score_ - kSpmUnkPenalty;
    std::vector<Best> best(size_t(size) + 1);
    std::string key;
    for (int start = 0; start < size;) {
        const float till_here = best[size_t(start)].score;
        const int mblen = std::min(spm_one_char_len(s.data() + start), size - start);
        bool has_single = false;
        for (int len = 1; len <= std::min<int>(int(max_piece_bytes_), size - start); ++len) {
            key.assign(s, size_t(start), size_t(len));
            const auto it = matchable_.find(key);
            if (it == matchable_.end()) continue;
            const auto& piece = pieces_[size_t(it->second)];
            if (piece.type == PieceType::Unused) continue;
            auto& target = best[size_t(start + len)];
            // A user-defined symbol's bonus is computed in double, as SentencePiece's `length * max_score_ - 0.1`.
            const double candidate = piece.type == PieceType::UserDefined
                                         ? double(float(len) * max_score_) - 0.1 + double(till_here)
                                         : double(piece.score + till_here);
            if (target.starts_at == -1 || candidate > double(target.score)) {
                target.score = float(candidate);
                target.starts_at = start;
                target.id = it->second;
            }
            if (!has_single && len == mblen) has_single = true;
        }
        if (!has_single) {
            auto& target = best[size_t(start + mblen)];
            const float candidate = unk_score + till_here;
            if (target.starts_at == -1 || candidate > target.score) {
                target.score = candidate;
                target.starts_at = start;
                target.id = unk_id_;
            }
        }
        start += mblen;
    }
    std::vector<int> ids;
    for (int end = size; end > 0; end = best[size_t(end)].starts_at) ids.push_back(best[size_t(end)].id);
    std::reverse(ids.begin(), ids.end());
    // SentencePieceProcessor merges a run of unknown pieces into one.
    std::vector<int> merged;
    for (int id : ids)
        if (!(id == unk_id_ && !merged.empty() && merged.back() == unk_id_)) merged.push_back(id);
    return merged;
}

} // namespace anchor::unet
