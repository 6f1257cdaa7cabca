// GPT-2 byte-level BPE tokenizer; semantics in tests/golden/text/README.md sec. 1 (OpenAI encoder.py).
#define PCRE2_CODE_UNIT_WIDTH 8
#include "text/gpt2/gpt2_tokenizer.h"

#include "cache/io/assets.h"

#include "cache/bpe.h"

#include "cache/io/error.h"
#include "cache/io/read_file.h"

#include <nlohmann/json.hpp>
#include <pcre2.h>

#include <algorithm>
#include <climits>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>

namespace fs = std::filesystem;

namespace anchor::text {

namespace {

void append_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
        out += static_cast<char>(cp);
    } else if (cp < 0x800) {
        out += static_cast<char>(0xC0 | (cp >> 6));
        out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        out += static_cast<char>(0xE0 | (cp >> 12));
        out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
        out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
        out += static_cast<char>(0xF0 | (cp >> 18));
        out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
        out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
        out += static_cast<char>(0x80 | (cp & 0x3F));
    }
}

// Valid range of the second byte and number of continuation bytes for a lead byte (Unicode 15, table 3-7);
// returns false for bytes that cannot start a sequence.
bool lead_info(unsigned char b, int* need, unsigned char* lo, unsigned char* hi) {
    *lo = 0x80;
    *hi = 0xBF;
    if (b >= 0xC2 && b <= 0xDF)
        *need = 1;
    else if (b == 0xE0)
        *need = 2, *lo = 0xA0;
    else if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF)
        *need = 2;
    else if (b == 0xED)
        *need = 2, *hi = 0x9F;
    else if (b == 0xF0)
        *need = 3, *lo = 0x90;
    else if (b >= 0xF1 && b <= 0xF3)
        *need = 3;
    else if (b == 0xF4)
        *need = 3, *hi = 0x8F;
    else
        return false;
    return true;
}

// Length of the valid sequence at s[i] (> 0), or -(number of bytes forming the maximal invalid subpart).
// `truncated` is set when the sequence is a valid but incomplete prefix cut by the end of the input.
int scan_one(const std::string& s, size_t i, bool* truncated = nullptr) {
    if (truncated) *truncated = false;
    const auto b = static_cast<unsigned char>(s[i]);
    if (b < 0x80) return 1;
    int need;
    unsigned char lo, hi;
    if (!lead_info(b, &need, &lo, &hi)) return -1;
    int k = 0; // continuation bytes that fit
    for (; k < need; ++k) {
        if (i + 1 + k >= s.size()) {
            if (truncated) *truncated = true;
            return -(1 + k);
        }
        const auto c = static_cast<unsigned char>(s[i + 1 + k]);
        const unsigned char l = k == 0 ? lo : 0x80, h = k == 0 ? hi : 0xBF;
        if (c < l || c > h) return -(1 + k);
    }
    return 1 + need;
}

// GPT-2's bytes_to_unicode(): printable bytes map to themselves, the other 68 to U+0100.. in byte order.
std::vector<uint32_t> bytes_to_unicode() {
    std::vector<uint32_t> table(256, 0);
    std::vector<bool> printable(256, false);
    for (int b = '!'; b <= '~'; ++b) printable[b] = true;
    for (int b = 0xA1; b <= 0xAC; ++b) printable[b] = true;
    for (int b = 0xAE; b <= 0xFF; ++b) printable[b] = true;
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) table[b] = printable[b] ? static_cast<uint32_t>(b) : next++;
    return table;
}

// Decodes valid UTF-8 into code points (used only on vocabulary strings, which are valid).
std::vector<uint32_t> code_points(const std::string& s) {
    std::vector<uint32_t> out;
    for (size_t i = 0; i < s.size();) {
        int n = scan_one(s, i);
        if (n < 0) throw Error("tokenizer vocabulary entry is not valid UTF-8");
        auto b = static_cast<unsigned char>(s[i]);
        uint32_t cp = n == 1 ? b : n == 2 ? (b & 0x1F) : n == 3 ? (b & 0x0F) : (b & 0x07);
        for (int k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
        out.push_back(cp);
        i += n;
    }
    return out;
}

// Pre-tokenisation pattern of encoder.py. Two deliberate deviations from PCRE2's defaults keep it equal to the
// Python `regex` module (Unicode 15.0):
//  * `\s` is written out as the Unicode White_Space set (PCRE2's UCP `\s` omits U+0085; `regex` includes it and
//    excludes U+001C..U+001F, U+180E, U+200B, U+FEFF, as this set does);
//  * PCRE2 10.42 has Unicode 14 tables, so the letters and digits new in Unicode 15.0 are added explicitly.
const char* kWs = "\\x{9}-\\x{D}\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}"
                  "\\x{205F}\\x{3000}";
const char* kL15 = "\\x{1123F}\\x{11240}\\x{11F02}\\x{11F04}-\\x{11F10}\\x{11F12}-\\x{11F33}\\x{1342F}"
                   "\\x{13441}-\\x{13446}\\x{1B132}\\x{1B155}\\x{1DF25}-\\x{1DF2A}\\x{1E030}-\\x{1E06D}"
                   "\\x{1E4D0}-\\x{1E4EB}\\x{31350}-\\x{323AF}";
const char* kN15 = "\\x{11F50}-\\x{11F59}\\x{1D2C0}-\\x{1D2D3}\\x{1E4F0}-\\x{1E4F9}";

std::string pretoken_pattern() {
    const std::string ws = kWs, l = std::string("\\p{L}") + kL15, n = std::string("\\p{N}") + kN15;
    return "'s|'t|'re|'ve|'m|'ll|'d| ?[" + l + "]+| ?[" + n + "]+| ?[^" + ws + l + n + "]+|[" + ws + "]+(?![^" + ws +
           "])|[" + ws + "]+";
}

class Regex {
public:
    Regex() {
        const std::string pat = pretoken_pattern();
        int err = 0;
        PCRE2_SIZE off = 0;
        code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pat.c_str()), pat.size(), PCRE2_UTF | PCRE2_UCP, &err, &off,
                              nullptr);
        if (!code_) {
            PCRE2_UCHAR buf[256];
            pcre2_get_error_message(err, buf, sizeof(buf));
            throw Error(std::string("GPT-2 pre-tokeniser regex failed to compile: ") + reinterpret_cast<char*>(buf));
        }
        jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
    }
    ~Regex() {
        if (code_) pcre2_code_free(code_);
    }
    Regex(const Regex&) = delete;
    Regex& operator=(const Regex&) = delete;

    // re.findall on valid UTF-8 `s`.
    template <class F> void find_all(const std::string& s, F&& emit) const {
        pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_, nullptr);
        PCRE2_SIZE pos = 0;
        const auto subject = reinterpret_cast<PCRE2_SPTR>(s.data());
        while (pos < s.size()) {
            int rc = jit_ ? pcre2_jit_match(code_, subject, s.size(), pos, PCRE2_NO_UTF_CHECK, md, nullptr)
                          : pcre2_match(code_, subject, s.size(), pos, PCRE2_NO_UTF_CHECK, md, nullptr);
            if (rc < 0) break; // every character matches one alternative, so this is only the end of input
            PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
            if (ov[1] == ov[0]) { // cannot happen (no alternative matches empty); guard against looping
                ++pos;
                continue;
            }
            emit(ov[0], ov[1]);
            pos = ov[1];
        }
        pcre2_match_data_free(md);
    }

private:
    pcre2_code* code_ = nullptr;
    bool jit_ = false;
};

} // namespace

int64_t utf8_first_invalid(const std::string& s) {
    for (size_t i = 0; i < s.size();) {
        int n = scan_one(s, i);
        if (n < 0) return static_cast<int64_t>(i);
        i += n;
    }
    return -1;
}

std::string utf8_decode_replace(const std::string& bytes) {
    std::string out;
    out.reserve(bytes.size());
    for (size_t i = 0; i < bytes.size();) {
        int n = scan_one(bytes, i);
        if (n > 0) {
            out.append(bytes, i, n);
            i += n;
        } else {
            out += "\xEF\xBF\xBD";
            i += -n;
        }
    }
    return out;
}

std::string Utf8StreamDecoder::push(const std::string& bytes) {
    pending_ += bytes;
    // Keep a trailing valid-but-incomplete sequence; everything before it is final.
    size_t keep_from = pending_.size();
    for (size_t back = 1; back <= 3 && back <= pending_.size(); ++back) {
        size_t i = pending_.size() - back;
        auto b = static_cast<unsigned char>(pending_[i]);
        if ((b & 0xC0) == 0x80) continue;
        bool truncated = false;
        scan_one(pending_, i, &truncated);
        if (truncated) keep_from = i;
        break;
    }
    std::string done = utf8_decode_replace(pending_.substr(0, keep_from));
    pending_.erase(0, keep_from);
    return done;
}

std::string Utf8StreamDecoder::flush() {
    std::string out = utf8_decode_replace(pending_);
    pending_.clear();
    return out;
}

struct Gpt2Tokenizer::Impl {
    std::unordered_map<std::string, int64_t> encoder; // byte-level unicode string (UTF-8) -> id
    std::vector<std::string> id_bytes;                // id -> raw bytes
    std::unordered_map<std::string, int> ranks;       // "a b" -> merge rank
    std::vector<std::string> byte_sym;                // byte -> its unicode symbol as UTF-8
    Regex regex;
    mutable std::mutex cache_mu;
    mutable std::unordered_map<std::string, std::vector<int64_t>> cache; // raw pre-token bytes -> ids

    std::vector<int64_t> bpe(const std::string& token) const {
        {
            std::lock_guard<std::mutex> lk(cache_mu);
            auto it = cache.find(token);
            if (it != cache.end()) return it->second;
        }
        std::vector<std::string> word;
        word.reserve(token.size());
        for (unsigned char b : token) word.push_back(byte_sym[b]);
        bpe_merge(word, ranks);
        std::vector<int64_t> ids;
        ids.reserve(word.size());
        for (const auto& w : word) {
            auto it = encoder.find(w);
            if (it == encoder.end()) throw Error("BPE symbol '" + w + "' is not in the vocabulary (corrupt files?)");
            ids.push_back(it->second);
        }
        std::lock_guard<std::mutex> lk(cache_mu);
        if (cache.size() > 200000) cache.clear(); // bound memory on huge inputs
        cache.emplace(token, ids);
        return ids;
    }
};

Gpt2Tokenizer::Gpt2Tokenizer() : impl_(std::make_unique<Impl>()) {}
Gpt2Tokenizer::Gpt2Tokenizer(Gpt2Tokenizer&&) noexcept = default;
Gpt2Tokenizer& Gpt2Tokenizer::operator=(Gpt2Tokenizer&&) noexcept = default;
Gpt2Tokenizer::~Gpt2Tokenizer() = default;

Gpt2Tokenizer Gpt2Tokenizer::from_files(const std::string& encoder_json, const std::string& merges) {
    Gpt2Tokenizer tok;
    Impl& im = *tok.impl_;
    const auto table = bytes_to_unicode();
    std::unordered_map<uint32_t, unsigned char> decoder_map;
    im.byte_sym.resize(256);
    for (int b = 0; b < 256; ++b) {
        append_utf8(im.byte_sym[b], table[b]);
        decoder_map[table[b]] = static_cast<unsigned char>(b);
    }

    nlohmann::json enc;
    try {
        enc = nlohmann::json::parse(read_file(encoder_json, "tokenizer file"));
    } catch (const nlohmann::json::exception& e) {
        throw Error("tokenizer vocabulary '" + encoder_json + "' is not valid JSON: " + e.what());
    }
    if (!enc.is_object() || enc.empty()) throw Error("tokenizer vocabulary '" + encoder_json + "' is not an object");
    int64_t max_id = -1;
    for (auto it = enc.begin(); it != enc.end(); ++it) {
        if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0)
            throw Error("tokenizer vocabulary '" + encoder_json + "': id of '" + it.key() + "' is not an integer >= 0");
        max_id = std::max(max_id, it.value().get<int64_t>());
    }
    im.id_bytes.assign(max_id + 1, std::string());
    std::vector<bool> seen(max_id + 1, false);
    for (auto it = enc.begin(); it != enc.end(); ++it) {
        const int64_t id = it.value().get<int64_t>();
        std::string bytes;
        for (uint32_t cp : code_points(it.key())) {
            auto d = decoder_map.find(cp);
            if (d == decoder_map.end())
                throw Error("tokenizer vocabulary '" + encoder_json + "': entry '" + it.key() +
                            "' has a character outside the byte-level alphabet");
            bytes += static_cast<char>(d->second);
        }
        im.encoder[it.key()] = id;
        im.id_bytes[id] = bytes;
        seen[id] = true;
    }
    for (int64_t i = 0; i <= max_id; ++i)
        if (!seen[i]) throw Error("tokenizer vocabulary '" + encoder_json + "': id " + std::to_string(i) + " missing");

    std::istringstream ms(read_file(merges, "tokenizer file"));
    std::string line;
    int rank = 0, line_no = 0;
    while (std::getline(ms, line)) {
        ++line_no;
        if (!line.empty() && line.back() == '\r') line.pop_back();
        if (line.empty() || line.rfind("#version", 0) == 0) continue;
        auto sp = line.find(' ');
        if (sp == std::string::npos || sp == 0 || sp + 1 == line.size() || line.find(' ', sp + 1) != std::string::npos)
            throw Error("merges file '" + merges + "' line " + std::to_string(line_no) + ": expected 'a b'");
        im.ranks.emplace(line, rank++);
    }
    if (rank == 0) throw Error("merges file '" + merges + "' holds no merges");
    return tok;
}

bool Gpt2Tokenizer::dir_has_vocab(const std::string& dir) {
    std::error_code ec;
    return (fs::exists(fs::path(dir) / "encoder.json", ec) && fs::exists(fs::path(dir) / "vocab.bpe", ec)) ||
           (fs::exists(fs::path(dir) / "vocab.json", ec) && fs::exists(fs::path(dir) / "merges.txt", ec));
}

Gpt2Tokenizer Gpt2Tokenizer::from_dir(const std::string& dir) {
    const fs::path d(dir);
    std::error_code ec;
    if (fs::exists(d / "encoder.json", ec) && fs::exists(d / "vocab.bpe", ec))
        return from_files((d / "encoder.json").string(), (d / "vocab.bpe").string());
    if (fs::exists(d / "vocab.json", ec) && fs::exists(d / "merges.txt", ec))
        return from_files((d / "vocab.json").string(), (d / "merges.txt").string());
    throw Error("tokenizer folder '" + dir + "' holds neither encoder.json + vocab.bpe nor vocab.json + merges.txt");
}

std::string Gpt2Tokenizer::default_dir() {
    return find_asset("vocab/gpt2", "GPT-2 vocabulary (encoder.json, vocab.bpe)");
}

Gpt2Tokenizer Gpt2Tokenizer::load_default(const std::string& explicit_dir) {
    return from_dir(explicit_dir.empty() ? default_dir() : explicit_dir);
}

std::vector<std::string> Gpt2Tokenizer::pretokenize(const std::string& text) const {
    int64_t bad = utf8_first_invalid(text);
    if (bad >= 0)
        throw Error("input text is not valid UTF-8 (first invalid byte at offset " + std::to_string(bad) + ")");
    std::vector<std::string> out;
    impl_->regex.find_all(text, [&](size_t b, size_t e) { out.push_back(text.substr(b, e - b)); });
    return out;
}

std::vector<int64_t> Gpt2Tokenizer::encode(const std::string& text, bool allow_special) const {
    int64_t bad = utf8_first_invalid(text);
    if (bad >= 0)
        throw Error("input text is not valid UTF-8 (first invalid byte at offset " + std::to_string(bad) + ")");
    std::vector<int64_t> ids;
    auto encode_plain = [&](const std::string& part) {
        impl_->regex.find_all(part, [&](size_t b, size_t e) {
            auto t = impl_->bpe(part.substr(b, e - b));
            ids.insert(ids.end(), t.begin(), t.end());
        });
    };
    if (!allow_special) {
        encode_plain(text);
        return ids;
    }
    static const std::string eot = "<|endoftext|>";
    size_t pos = 0;
    while (true) {
        size_t hit = text.find(eot, pos);
        encode_plain(text.substr(pos, hit == std::string::npos ? std::string::npos : hit - pos));
        if (hit == std::string::npos) break;
        ids.push_back(kEndOfText);
        pos = hit + eot.size();
    }
    return ids;
}

std::vector<int64_t> Gpt2Tokenizer::encode_first(const std::string& text, size_t n) const {
    size_t len = std::max<size_t>(4096, 8 * n);
    while (true) {
        if (len >= text.size()) {
            auto ids = encode(text);
            if (ids.size() > n) ids.resize(n);
            return ids;
        }
        // Cut at a character boundary, drop the last (possibly cut) pre-token and encode the rest.
        size_t cut = len;
        while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
        const std::string prefix = text.substr(0, cut);
        if (utf8_first_invalid(prefix) >= 0) return encode(text); // reports the invalid byte
        std::vector<std::pair<size_t, size_t>> spans;
        impl_->regex.find_all(prefix, [&](size_t b, size_t e) { spans.emplace_back(b, e); });
        std::vector<int64_t> ids;
        for (size_t k = 0; k + 1 < spans.size() && ids.size() < n; ++k) {
            auto t = impl_->bpe(prefix.substr(spans[k].first, spans[k].second - spans[k].first));
            ids.insert(ids.end(), t.begin(), t.end());
        }
        if (ids.size() >= n) {
            ids.resize(n);
            return ids;
        }
        len *= 2;
    }
}

const std::string& Gpt2Tokenizer::token_bytes(int64_t id) const {
    if (id < 0 || id >= static_cast<int64_t>(impl_->id_bytes.size()))
        throw Error("token id " + std::to_string(id) + " is outside the vocabulary (size " +
                    std::to_string(impl_->id_bytes.size()) + ")");
    return impl_->id_bytes[id];
}

std::string Gpt2Tokenizer::decode(const std::vector<int64_t>& ids) const {
    std::string bytes;
    for (int64_t id : ids) bytes += token_bytes(id);
    return utf8_decode_replace(bytes);
}

size_t Gpt2Tokenizer::vocab_size() const {
    return impl_->id_bytes.size();
}
size_t Gpt2Tokenizer::n_merges() const {
    return impl_->ranks.size();
}

} // namespace anchor::text
