// CLIP byte-level BPE; the algorithm follows openai/CLIP simple_tokenizer.py (Radford et al. 2021) step by step so
// ids are identical to the reference (tests/golden/sd/clip_tiny/tokenizer).
#include "unet/model/clip_tokenizer.h"

#include "cache/bpe.h"

#include "cache/io/assets.h"
#include "cache/io/error.h"
#include "cache/io/read_file.h"
#include "cache/io/gzip_file.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <nlohmann/json.hpp>
#include <pcre2.h>

#include <algorithm>
#include <climits>
#include <clocale>
#include <cstdlib>
#include <cwctype>
#include <filesystem>
#include <fstream>
#include <limits>
#include <locale.h>
#include <queue>
#include <sstream>
#include <unistd.h>
#include <wctype.h>

namespace anchor::unet {

namespace fs = std::filesystem;

struct ClipTokenizer::Regex {
    pcre2_code* code = nullptr;
    ~Regex() {
        if (code) pcre2_code_free(code);
    }
};

namespace {

// The openai CLIP split pattern (applied case-insensitively, Unicode properties on).
const char* kPattern =
    "<\\|startoftext\\|>|<\\|endoftext\\|>|'s|'t|'re|'ve|'m|'ll|'d|[\\p{L}]+|[\\p{N}]|[^\\s\\p{L}\\p{N}]+";

void append_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
        out += char(cp);
    } else if (cp < 0x800) {
        out += char(0xC0 | (cp >> 6));
        out += char(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        out += char(0xE0 | (cp >> 12));
        out += char(0x80 | ((cp >> 6) & 0x3F));
        out += char(0x80 | (cp & 0x3F));
    } else {
        out += char(0xF0 | (cp >> 18));
        out += char(0x80 | ((cp >> 12) & 0x3F));
        out += char(0x80 | ((cp >> 6) & 0x3F));
        out += char(0x80 | (cp & 0x3F));
    }
}

// Decodes UTF-8 leniently (invalid bytes become U+FFFD) into code points.
std::vector<uint32_t> decode_utf8(const std::string& s) {
    std::vector<uint32_t> cps;
    size_t i = 0;
    while (i < s.size()) {
        unsigned char c = s[i];
        uint32_t cp;
        int n;
        if (c < 0x80) {
            cp = c, n = 1;
        } else if ((c >> 5) == 6) {
            cp = c & 0x1F, n = 2;
        } else if ((c >> 4) == 14) {
            cp = c & 0x0F, n = 3;
        } else if ((c >> 3) == 30) {
            cp = c & 0x07, n = 4;
        } else {
            cps.push_back(0xFFFD);
            ++i;
            continue;
        }
        if (i + n > s.size()) {
            cps.push_back(0xFFFD);
            break;
        }
        bool ok = true;
        for (int k = 1; k < n; ++k) {
            unsigned char d = s[i + k];
            if ((d >> 6) != 2) ok = false;
            cp = (cp << 6) | (d & 0x3F);
        }
        if (!ok) {
            cps.push_back(0xFFFD);
            ++i;
            continue;
        }
        // Surrogates and values past U+10FFFF are not characters: the cleaned text stays valid UTF-8, which lets
        // the regex skip its own validation (see encode).
        if ((cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) cp = 0xFFFD;
        cps.push_back(cp);
        i += n;
    }
    return cps;
}

// Python's str.isspace() set (what `\s` and str.strip() use in the reference).
bool is_space(uint32_t cp) {
    return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
           (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
           cp == 0x3000;
}

uint32_t to_lower(uint32_t cp) {
    if (cp < 0x80) return (cp >= 'A' && cp <= 'Z') ? cp + 32 : cp;
    static locale_t loc = newlocale(LC_CTYPE_MASK, "C.UTF-8", (locale_t)0);
    if (!loc) return cp;
    return uint32_t(towlower_l(wint_t(cp), loc));
}

// whitespace_clean(text).lower(): collapse whitespace runs to one space, strip, lower-case.
std::string clean_text(const std::string& text) {
    std::string out;
    bool pending_space = false;
    for (uint32_t cp : decode_utf8(text)) {
        if (is_space(cp)) {
            pending_space = !out.empty();
            continue;
        }
        if (pending_space) out += ' ';
        pending_space = false;
        append_utf8(out, to_lower(cp));
    }
    return out;
}

std::vector<std::string> split_symbols(const std::string& s) {
    std::vector<std::string> out;
    for (uint32_t cp : decode_utf8(s)) {
        std::string sym;
        append_utf8(sym, cp);
        out.push_back(std::move(sym));
    }
    return out;
}

std::vector<std::string> split_lines(const std::string& data) {
    std::vector<std::string> lines;
    size_t start = 0;
    while (start <= data.size()) {
        size_t e = data.find('\n', start);
        if (e == std::string::npos) e = data.size();
        std::string line = data.substr(start, e - start);
        if (!line.empty() && line.back() == '\r') line.pop_back();
        lines.push_back(std::move(line));
        start = e + 1;
    }
    return lines;
}

std::pair<std::string, std::string> parse_merge(const std::string& line, const std::string& path, size_t lineno) {
    auto sp = line.find(' ');
    if (sp == std::string::npos || sp == 0 || sp + 1 >= line.size() || line.find(' ', sp + 1) != std::string::npos)
        throw Error("BPE merges '" + path + "', line " + std::to_string(lineno + 1) + ": expected two symbols, got '" +
                    line + "'");
    return {line.substr(0, sp), line.substr(sp + 1)};
}

} // namespace

void bpe_merge_heap(std::vector<std::string>& word, const std::unordered_map<std::string, int>& ranks) {
    const size_t n = word.size();
    if (n < 2) return;
    std::vector<long> prev(n), next(n);
    for (size_t i = 0; i < n; ++i) prev[i] = long(i) - 1, next[i] = i + 1 < n ? long(i) + 1 : -1;
    std::vector<char> alive(n, 1);
    using Entry = std::pair<int, long>; // (rank, position of the pair's left symbol)
    std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
    std::string key;
    auto rank_at = [&](long i) -> int { // rank of the pair starting at i, INT_MAX when none
        if (i < 0 || next[size_t(i)] < 0) return INT_MAX;
        key.assign(word[size_t(i)]).append(" ").append(word[size_t(next[size_t(i)])]);
        const auto it = ranks.find(key);
        return it == ranks.end() ? INT_MAX : it->second;
    };
    auto push = [&](long i) {
        const int r = rank_at(i);
        if (r != INT_MAX) heap.push({r, i});
    };
    for (size_t i = 0; i + 1 < n; ++i) push(long(i));
    std::vector<long> batch, touched;
    while (!heap.empty()) {
        const int r = heap.top().first;
        // Every queued occurrence of this rank's pair, left to right (positions keep the symbols' order).
        batch.clear();
        while (!heap.empty() && heap.top().first == r) {
            batch.push_back(heap.top().second);
            heap.pop();
        }
        std::sort(batch.begin(), batch.end());
        batch.erase(std::unique(batch.begin(), batch.end()), batch.end());
        touched.clear();
        for (long i : batch) {
            // An entry is stale when its left symbol was merged away or its pair changed since it was queued.
            if (!alive[size_t(i)] || rank_at(i) != r) continue;
            const long j = next[size_t(i)];
            word[size_t(i)] += word[size_t(j)];
            alive[size_t(j)] = 0;
            next[size_t(i)] = next[size_t(j)];
            if (next[size_t(j)] >= 0) prev[size_t(next[size_t(j)])] = i;
            touched.push_back(i);
        }
        // The pairs the merges made are queued after the pass, as the reference loop looks at them only then.
        for (long i : touched) {
            if (!alive[size_t(i)]) continue;
            push(prev[size_t(i)]);
            push(i);
        }
    }
    std::vector<std::string> out;
    for (long i = 0; i >= 0; i = next[size_t(i)]) out.push_back(std::move(word[size_t(i)]));
    word.swap(out);
}

void ClipTokenizer::init_byte_encoder() {
    // GPT-2 / CLIP bytes_to_unicode(): printable Latin-1 bytes map to themselves, the rest to 256 + n.
    std::vector<int> bs;
    for (int b = '!'; b <= '~'; ++b) bs.push_back(b);
    for (int b = 0xA1; b <= 0xAC; ++b) bs.push_back(b);
    for (int b = 0xAE; b <= 0xFF; ++b) bs.push_back(b);
    std::vector<uint32_t> cs(256, 0);
    std::vector<bool> used(256, false);
    for (int b : bs) used[b] = true, cs[b] = uint32_t(b);
    uint32_t n = 0;
    for (int b = 0; b < 256; ++b)
        if (!used[b]) cs[b] = 256 + n++;
    for (int b = 0; b < 256; ++b) {
        byte_encoder_[b].clear();
        append_utf8(byte_encoder_[b], cs[b]);
    }
    int err = 0;
    PCRE2_SIZE off = 0;
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(kPattern), PCRE2_ZERO_TERMINATED,
                                     PCRE2_UTF | PCRE2_UCP | PCRE2_CASELESS, &err, &off, nullptr);
    if (!code) throw Error("internal error: CLIP regex does not compile");
    regex_ = std::make_shared<Regex>();
    regex_->code = code;
}

void ClipTokenizer::set_merges(const std::vector<std::pair<std::string, std::string>>& merges) {
    ranks_.clear();
    ranks_.reserve(merges.size() * 2);
    for (size_t i = 0; i < merges.size(); ++i) ranks_.emplace(merges[i].first + " " + merges[i].second, int(i));
}

ClipTokenizer ClipTokenizer::from_bpe_file(const std::string& path) {
    ClipTokenizer t;
    t.init_byte_encoder();
    auto lines = split_lines(read_gzip_or_plain(path, "BPE vocabulary"));
    // simple_tokenizer: merges = lines[1 : 49152 - 256 - 2 + 1]
    const size_t n_merges = 49152 - 256 - 2;
    if (lines.size() < n_merges + 1)
        throw Error("BPE vocabulary '" + path + "' has " + std::to_string(lines.size()) + " lines, expected at least " +
                    std::to_string(n_merges + 1));
    std::vector<std::pair<std::string, std::string>> merges;
    merges.reserve(n_merges);
    for (size_t i = 1; i <= n_merges; ++i) merges.push_back(parse_merge(lines[i], path, i));
    std::vector<std::string> vocab;
    // bytes_to_unicode().values() is in the order of `bs` (printable bytes first), not byte order.
    {
        std::vector<int> order;
        for (int b = '!'; b <= '~'; ++b) order.push_back(b);
        for (int b = 0xA1; b <= 0xAC; ++b) order.push_back(b);
        for (int b = 0xAE; b <= 0xFF; ++b) order.push_back(b);
        std::vector<bool> used(256, false);
        for (int b : order) used[b] = true;
        for (int b = 0; b < 256; ++b)
            if (!used[b]) order.push_back(b);
        for (int b : order) vocab.push_back(t.byte_encoder_[b]);
    }
    for (int i = 0; i < 256; ++i) vocab.push_back(vocab[i] + "</w>");
    for (const auto& m : merges) vocab.push_back(m.first + m.second);
    vocab.push_back("<|startoftext|>");
    vocab.push_back("<|endoftext|>");
    t.encoder_.reserve(vocab.size() * 2);
    for (size_t i = 0; i < vocab.size(); ++i) t.encoder_.emplace(vocab[i], int64_t(i));
    t.set_merges(merges);
    return t;
}

ClipTokenizer ClipTokenizer::from_folder(const std::string& dir) {
    fs::path d(dir);
    fs::path vocab_path = d / "vocab.json", merges_path = d / "merges.txt";
    if (!fs::exists(vocab_path) || !fs::exists(merges_path))
        throw Error("tokenizer folder '" + dir + "' needs vocab.json and merges.txt");
    ClipTokenizer t;
    t.init_byte_encoder();
    nlohmann::json vocab;
    try {
        std::ifstream f(vocab_path);
        vocab = nlohmann::json::parse(f);
    } catch (const std::exception& e) {
        throw Error("cannot parse '" + vocab_path.string() + "': " + e.what());
    }
    if (!vocab.is_object()) throw Error("'" + vocab_path.string() + "' is not a JSON object");
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
        if (!it.value().is_number_integer())
            throw Error("'" + vocab_path.string() + "': id of '" + it.key() + "' is not an integer");
        t.encoder_.emplace(it.key(), it.value().get<int64_t>());
    }
    auto lines = split_lines(read_file(merges_path.string(), "BPE merges"));
    std::vector<std::pair<std::string, std::string>> merges;
    for (size_t i = 0; i < lines.size(); ++i) {
        if (lines[i].empty() || (i == 0 && lines[i].rfind("#version", 0) == 0)) continue;
        merges.push_back(parse_merge(lines[i], merges_path.string(), i));
    }
    t.set_merges(merges);
    t.read_special_tokens(dir);
    return t;
}

void ClipTokenizer::read_special_tokens(const std::string& dir) {
    const fs::path d(dir);
    // Pad token: SD 1.x pads with <|endoftext|>, SD 2.x and SDXL's second tokenizer with "!" (id 0).
    auto pad_from = [&](const fs::path& p) -> std::string {
        if (!fs::exists(p)) return "";
        try {
            std::ifstream f(p);
            auto j = nlohmann::json::parse(f);
            if (!j.contains("pad_token")) return "";
            const auto& v = j["pad_token"];
            if (v.is_string()) return v.get<std::string>();
            if (v.is_object() && v.contains("content") && v["content"].is_string())
                return v["content"].get<std::string>();
        } catch (const std::exception& e) {
            throw Error("cannot parse '" + p.string() + "': " + e.what());
        }
        return "";
    };
    std::string pad = pad_from(d / "special_tokens_map.json");
    if (pad.empty()) pad = pad_from(d / "tokenizer_config.json");
    if (!pad.empty()) {
        auto id = token_id(pad);
        if (id < 0) throw Error("tokenizer '" + dir + "': pad token '" + pad + "' is not in the vocabulary");
        pad_id_ = id;
    }
}

std::string ClipTokenizer::bundled_vocab_path() {
    return find_asset("vocab/clip/bpe_simple_vocab_16e6.txt.gz", "CLIP BPE vocabulary");
}

ClipTokenizer ClipTokenizer::bundled() {
    return from_bpe_file(bundled_vocab_path());
}

int64_t ClipTokenizer::token_id(const std::string& token) const {
    auto it = encoder_.find(token);
    return it == encoder_.end() ? -1 : it->second;
}

std::vector<std::string> ClipTokenizer::bpe(const std::string& token) const {
    {
        std::lock_guard<std::mutex> lk(*cache_mutex_);
        auto it = cache_.find(token);
        if (it != cache_.end()) return it->second;
    }
    std::vector<std::string> word = split_symbols(token);
    if (word.empty()) return {};
    word.back() += "</w>";
    // The reference loop on ordinary words (the golden ids pin it); the heap on long ones, where the loop is
    // quadratic.
    if (word.size() > 32)
        bpe_merge_heap(word, ranks_);
    else
        bpe_merge(word, ranks_);
    std::lock_guard<std::mutex> lk(*cache_mutex_);
    if (cache_.size() > 100000) cache_.clear();
    cache_.emplace(token, word);
    return word;
}

std::vector<int64_t> ClipTokenizer::encode(const std::string& text) const {
    std::string clean = clean_text(text);
    std::vector<int64_t> ids;
    pcre2_match_data* md = pcre2_match_data_create_from_pattern(regex_->code, nullptr);
    PCRE2_SIZE offset = 0;
    auto subject = reinterpret_cast<PCRE2_SPTR>(clean.data());
    while (offset < clean.size()) {
        // PCRE2 checks the whole subject's UTF-8 on every call unless told not to, which made tokenizing quadratic
        // in the prompt's length; clean_text only writes valid UTF-8.
        int rc = pcre2_match(regex_->code, subject, clean.size(), offset, PCRE2_NO_UTF_CHECK, md, nullptr);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            pcre2_match_data_free(md);
            throw Error("internal error: the CLIP split regex failed (" + std::to_string(rc) + ")");
        }
        PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
        PCRE2_SIZE b = ov[0], e = ov[1];
        if (e <= b) { // cannot happen with this pattern; avoid looping forever
            offset = b + 1;
            continue;
        }
        std::string piece = clean.substr(b, e - b);
        offset = e;
        if (piece == "<|startoftext|>" || piece == "<|endoftext|>") {
            ids.push_back(encoder_.at(piece));
            continue;
        }
        std::string encoded;
        for (unsigned char c : piece) encoded += byte_encoder_[c];
        for (const auto& sym : bpe(encoded)) {
            auto it = encoder_.find(sym);
            if (it == encoder_.end()) {
                pcre2_match_data_free(md);
                throw Error("BPE symbol '" + sym + "' is not in the tokenizer vocabulary");
            }
            ids.push_back(it->second);
        }
    }
    pcre2_match_data_free(md);
    return ids;
}

TokenizedPrompt ClipTokenizer::tokenize(const std::string& text, int max_length) const {
    TokenizedPrompt out;
    auto bpe_ids = encode(text);
    out.num_bpe_tokens = int(bpe_ids.size());
    const size_t keep = size_t(std::max(0, max_length - 2));
    out.truncated = bpe_ids.size() > keep;
    out.ids.reserve(size_t(max_length));
    out.ids.push_back(kBos);
    for (size_t i = 0; i < std::min(keep, bpe_ids.size()); ++i) out.ids.push_back(bpe_ids[i]);
    out.ids.push_back(kEos);
    while (out.ids.size() < size_t(max_length)) out.ids.push_back(pad_id_);
    return out;
}

} // namespace anchor::unet
