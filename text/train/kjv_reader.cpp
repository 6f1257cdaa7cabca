#include "text/train/kjv_reader.h"

#include "cache/io/error.h"
#include "cache/io/read_file.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace anchor::text {

namespace {

constexpr uint8_t kMagic1 = 0x1f, kMagic2 = 0x9d;
constexpr uint8_t kBitsMask = 0x1f, kBlockMode = 0x80, kReservedFlags = 0x60;
constexpr uint32_t kClear = 256;
constexpr int kInitBits = 9;

std::string hex_byte(uint8_t b) {
    static const char* d = "0123456789abcdef";
    return std::string("0x") + d[b >> 4] + d[b & 15];
}

// LZW code stream of compress(1) after its 3-byte header.
std::string decode_codes(const uint8_t* in, size_t n, int maxbits, bool block, size_t max_output) {
    const uint64_t total = uint64_t(n) * 8;
    const uint32_t maxmax = 1u << maxbits;
    std::vector<uint16_t> prefix(maxmax, 0);
    std::vector<uint8_t> suffix(maxmax, 0), stack;
    stack.reserve(maxmax + 1);
    for (uint32_t i = 0; i < 256; ++i) suffix[i] = static_cast<uint8_t>(i);

    std::string out;
    uint64_t pos = 0;      // bit position of the next code
    uint64_t group_at = 0; // where the current code width began (groups of 8 codes are counted from here)
    int nbits = kInitBits;
    // As compress(1): the width grows when the next free entry no longer fits; at maxbits it never grows again.
    uint32_t maxcode = (1u << nbits) - 1;
    uint32_t free_ent = block ? 257 : 256;
    int64_t old = -1; // previous code; -1 at the start and after CLEAR (the next code must be a literal)
    bool any = false; // a code was read (a CLEAR before the first literal is corrupt)
    uint8_t fin = 0;  // first byte of the previous string
    auto skip_group = [&]() {
        const uint64_t g = uint64_t(nbits) * 8, r = (pos - group_at) % g;
        if (r) pos += g - r;
        group_at = pos;
    };
    auto corrupt = [&](const std::string& why) {
        std::ostringstream os;
        os << "LZW stream is corrupt: " << why << " (code at bit " << pos - nbits << ", width " << nbits << ", "
           << out.size() << " bytes decoded)";
        return Error(os.str());
    };
    for (;;) {
        if (free_ent > maxcode) {
            skip_group();
            ++nbits;
            maxcode = nbits == maxbits ? maxmax : (1u << nbits) - 1;
        }
        if (pos + uint64_t(nbits) > total) break;
        const size_t byte = static_cast<size_t>(pos >> 3);
        uint32_t word = 0;
        for (size_t k = 0; k < 3 && byte + k < n; ++k) word |= uint32_t(in[byte + k]) << (8 * k);
        uint32_t code = (word >> (pos & 7)) & ((1u << nbits) - 1);
        pos += nbits;

        if (block && code == kClear && any) {
            skip_group();
            nbits = kInitBits;
            maxcode = (1u << nbits) - 1;
            free_ent = 257;
            old = -1;
            continue;
        }
        any = true;
        if (old < 0) {
            if (code >= 256)
                throw corrupt("first code after the start or CLEAR is " + std::to_string(code) +
                              ", not a literal byte");
            if (out.size() + 1 > max_output)
                throw Error("LZW stream decompresses to more than " + std::to_string(max_output) + " bytes");
            fin = static_cast<uint8_t>(code);
            out.push_back(static_cast<char>(fin));
            old = code;
            continue;
        }
        const uint32_t incode = code;
        stack.clear();
        if (code >= free_ent) {
            // The KwKwK case: the code being defined by this very step.
            if (code > free_ent)
                throw corrupt("code " + std::to_string(code) + " is beyond the next free entry " +
                              std::to_string(free_ent));
            stack.push_back(fin);
            code = static_cast<uint32_t>(old);
        }
        while (code >= 256) {
            stack.push_back(suffix[code]);
            code = prefix[code];
        }
        fin = suffix[code];
        stack.push_back(fin);
        if (out.size() + stack.size() > max_output)
            throw Error("LZW stream decompresses to more than " + std::to_string(max_output) + " bytes");
        out.append(stack.rbegin(), stack.rend());
        if (free_ent < maxmax) {
            prefix[free_ent] = static_cast<uint16_t>(old);
            suffix[free_ent] = fin;
            ++free_ent;
        }
        old = incode;
    }
    // A writer flushes the last code rounded up to a byte (or pads a group after CLEAR), so fewer than 8 bits remain.
    if (pos < total && total - pos >= 8)
        throw Error("LZW stream is truncated: " + std::to_string(total - pos) + " bits left at the end do not make a " +
                    std::to_string(nbits) + "-bit code (" + std::to_string(out.size()) + " bytes decoded)");
    return out;
}

uint32_t be32(const std::string& b, size_t at) {
    return (uint32_t(uint8_t(b[at])) << 24) | (uint32_t(uint8_t(b[at + 1])) << 16) |
           (uint32_t(uint8_t(b[at + 2])) << 8) | uint32_t(uint8_t(b[at + 3]));
}

const std::string kBrsMagic = "EC02Compressed Data File";
constexpr size_t kBrsWindowSizeAt = 0x54, kBrsWindowCountAt = 0x58, kBrsTableAt = 0x5c;

std::string lower(std::string s) {
    for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return s;
}

} // namespace

std::string decompress_lzw(const std::string& bytes, size_t max_output) {
    if (bytes.size() < 3)
        throw Error("LZW (.Z) stream is truncated: " + std::to_string(bytes.size()) + " bytes, the header alone has 3");
    const auto* b = reinterpret_cast<const uint8_t*>(bytes.data());
    if (b[0] != kMagic1 || b[1] != kMagic2)
        throw Error("not an LZW (.Z) stream: magic " + hex_byte(b[0]) + " " + hex_byte(b[1]) + ", expected 0x1f 0x9d");
    if (b[2] & kReservedFlags) throw Error("LZW (.Z) stream: unknown flags " + hex_byte(b[2] & kReservedFlags));
    const int maxbits = b[2] & kBitsMask;
    if (maxbits < kInitBits || maxbits > 16)
        throw Error("LZW (.Z) stream: maximum code width " + std::to_string(maxbits) + " outside 9..16");
    return decode_codes(b + 3, bytes.size() - 3, maxbits, (b[2] & kBlockMode) != 0, max_output);
}

std::string decompress_bible_data(const std::string& bytes) {
    auto bad = [](const std::string& why) { return Error("Bible data file: " + why); };
    if (bytes.size() < kBrsTableAt || bytes.compare(0, kBrsMagic.size(), kBrsMagic) != 0)
        throw bad("no '" + kBrsMagic + "' header");
    const uint32_t window = be32(bytes, kBrsWindowSizeAt), count = be32(bytes, kBrsWindowCountAt);
    if (window == 0 || window > (1u << 24)) throw bad("implausible window size " + std::to_string(window));
    if (count == 0 || count > (1u << 20)) throw bad("implausible window count " + std::to_string(count));
    const size_t table_end = kBrsTableAt + 4 * (size_t(count) + 1);
    if (table_end + 3 > bytes.size())
        throw bad("truncated: the table of " + std::to_string(count + 1) + " offsets ends past the file (" +
                  std::to_string(bytes.size()) + " bytes)");
    std::vector<uint32_t> off(count + 1);
    for (size_t i = 0; i <= count; ++i) off[i] = be32(bytes, kBrsTableAt + 4 * i);
    // The .Z header (magic, flags) is stored once, right after the table; each window is a bare code stream.
    const std::string header = bytes.substr(table_end, 3);
    if (off[0] != table_end + 3)
        throw bad("first window at " + std::to_string(off[0]) + ", expected " + std::to_string(table_end + 3));
    for (size_t i = 0; i < count; ++i)
        if (off[i + 1] < off[i]) throw bad("window offsets decrease at window " + std::to_string(i));
    if (off[count] > bytes.size())
        throw bad("truncated: windows end at byte " + std::to_string(off[count]) + " but the file has " +
                  std::to_string(bytes.size()));
    std::string text;
    text.reserve(size_t(window) * count);
    for (size_t i = 0; i < count; ++i) {
        std::string part;
        try {
            part = decompress_lzw(header + bytes.substr(off[i], off[i + 1] - off[i]), window);
        } catch (const Error& e) {
            throw bad("window " + std::to_string(i) + ": " + e.what());
        }
        const bool last = i + 1 == count;
        if ((!last && part.size() != window) || part.empty())
            throw bad("window " + std::to_string(i) + " decompresses to " + std::to_string(part.size()) +
                      " bytes, expected " + (last ? std::string("1..") : std::string()) + std::to_string(window));
        text += part;
    }
    return text;
}

std::string kjv_text_from_bytes(const std::string& bytes) {
    if (bytes.compare(0, kBrsMagic.size(), kBrsMagic) == 0) return decompress_bible_data(bytes);
    if (bytes.size() >= 2 && uint8_t(bytes[0]) == kMagic1 && uint8_t(bytes[1]) == kMagic2) return decompress_lzw(bytes);
    return bytes;
}

const std::vector<std::pair<std::string, std::string>>& kjv_books() {
    static const std::vector<std::pair<std::string, std::string>> books = {
        {"Ge", "Genesis"},          {"Exo", "Exodus"},
        {"Lev", "Leviticus"},       {"Num", "Numbers"},
        {"Deu", "Deuteronomy"},     {"Josh", "Joshua"},
        {"Jdgs", "Judges"},         {"Ruth", "Ruth"},
        {"1Sm", "1 Samuel"},        {"2Sm", "2 Samuel"},
        {"1Ki", "1 Kings"},         {"2Ki", "2 Kings"},
        {"1Chr", "1 Chronicles"},   {"2Chr", "2 Chronicles"},
        {"Ezra", "Ezra"},           {"Neh", "Nehemiah"},
        {"Est", "Esther"},          {"Job", "Job"},
        {"Psa", "Psalms"},          {"Prv", "Proverbs"},
        {"Eccl", "Ecclesiastes"},   {"SSol", "Song of Solomon"},
        {"Isa", "Isaiah"},          {"Jer", "Jeremiah"},
        {"Lam", "Lamentations"},    {"Eze", "Ezekiel"},
        {"Dan", "Daniel"},          {"Hos", "Hosea"},
        {"Joel", "Joel"},           {"Amos", "Amos"},
        {"Obad", "Obadiah"},        {"Jonah", "Jonah"},
        {"Mic", "Micah"},           {"Nahum", "Nahum"},
        {"Hab", "Habakkuk"},        {"Zep", "Zephaniah"},
        {"Hag", "Haggai"},          {"Zec", "Zechariah"},
        {"Mal", "Malachi"},         {"Mat", "Matthew"},
        {"Mark", "Mark"},           {"Luke", "Luke"},
        {"John", "John"},           {"Acts", "Acts"},
        {"Rom", "Romans"},          {"1Cor", "1 Corinthians"},
        {"2Cor", "2 Corinthians"},  {"Gal", "Galatians"},
        {"Eph", "Ephesians"},       {"Phi", "Philippians"},
        {"Col", "Colossians"},      {"1Th", "1 Thessalonians"},
        {"2Th", "2 Thessalonians"}, {"1Tim", "1 Timothy"},
        {"2Tim", "2 Timothy"},      {"Titus", "Titus"},
        {"Phmn", "Philemon"},       {"Heb", "Hebrews"},
        {"Jas", "James"},           {"1Pet", "1 Peter"},
        {"2Pet", "2 Peter"},        {"1Jn", "1 John"},
        {"2Jn", "2 John"},          {"3Jn", "3 John"},
        {"Jude", "Jude"},           {"Rev", "Revelation"},
    };
    return books;
}

int kjv_book_index(const std::string& tag_or_name) {
    const auto& books = kjv_books();
    const std::string want = lower(tag_or_name);
    for (size_t i = 0; i < books.size(); ++i)
        if (lower(books[i].first) == want || lower(books[i].second) == want) return static_cast<int>(i);
    return -1;
}

std::vector<KjvVerse> parse_kjv_verses(const std::string& text) {
    std::vector<KjvVerse> verses;
    size_t at = 0, line_no = 0;
    while (at < text.size()) {
        size_t end = text.find('\n', at);
        if (end == std::string::npos) end = text.size();
        std::string line = text.substr(at, end - at);
        at = end + 1;
        ++line_no;
        if (!line.empty() && line.back() == '\r') line.pop_back();
        // Tag: optional digit 1..3, letters (book), digits ':' digits, one space.
        size_t i = 0;
        if (i < line.size() && line[i] >= '1' && line[i] <= '3') ++i;
        const size_t letters = i;
        while (i < line.size() && std::isalpha(static_cast<unsigned char>(line[i]))) ++i;
        const size_t book_end = i;
        auto digits = [&](size_t& k) {
            const size_t s = k;
            while (k < line.size() && k - s < 4 && std::isdigit(static_cast<unsigned char>(line[k]))) ++k;
            return k > s;
        };
        size_t ch_begin = i;
        bool tagged = book_end > letters && digits(i);
        size_t ch_end = i;
        tagged = tagged && i < line.size() && line[i] == ':';
        size_t vs_begin = i + 1;
        if (tagged) ++i;
        tagged = tagged && digits(i) && i < line.size() && line[i] == ' ';
        if (tagged) {
            KjvVerse v;
            v.book = line.substr(0, book_end);
            if (kjv_book_index(v.book) < 0)
                throw Error("KJV text line " + std::to_string(line_no) + ": unknown book tag '" + v.book + "'");
            v.chapter = std::stoi(line.substr(ch_begin, ch_end - ch_begin));
            v.verse = std::stoi(line.substr(vs_begin, i - vs_begin));
            v.text = line.substr(i + 1);
            verses.push_back(std::move(v));
        } else if (!verses.empty() && line.find_first_not_of(" \t") != std::string::npos) {
            verses.back().text += " " + line;
        }
    }
    if (verses.empty()) throw Error("no KJV verse tags (such as 'Ge1:1 ') found in the text");
    return verses;
}

std::string find_kjv_data() {
    for (const char* p : {"/usr/lib/bible.data", "/usr/share/bible-kjv/bible.data"})
        if (std::filesystem::is_regular_file(p)) return p;
    return "";
}

std::vector<KjvVerse> read_kjv(const std::string& path_in) {
    const std::string path = path_in.empty() ? find_kjv_data() : path_in;
    if (path.empty())
        throw Error("the KJV data file was not found (/usr/lib/bible.data); install it with "
                    "`apt-get install bible-kjv-text` or pass its path");
    const std::string bytes = read_file(path, "KJV file");
    try {
        return parse_kjv_verses(kjv_text_from_bytes(bytes));
    } catch (const Error& e) {
        throw Error("'" + path + "': " + e.what());
    }
}

} // namespace anchor::text
