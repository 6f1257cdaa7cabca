// KJV reader: the compress(1) LZW decoder against a reference encoder written here, its errors, and the text of
// Debian's bible-kjv-text when it is installed.
#include "cache/io/error.h"
#include "text/train/kjv_reader.h"

#include <catch2/catch.hpp>

#include <random>
#include <unordered_map>

using namespace anchor;
using namespace anchor::text;

namespace {

// A minimal compress(1)-compatible encoder: LSB-first codes, 9..maxbits wide, and the decoder's bit-group rule
// (when the width changes the writer pads to the end of the current group of 8 codes). `clear_every` > 0 emits a
// CLEAR after that many codes (block mode), so the reset path and its padding are exercised on small inputs.
// `pad_groups` = false writes the codes back to back (the bug the group rule exists to catch).
class LzwWriter {
public:
    explicit LzwWriter(bool pad_groups) : pad_(pad_groups) {}
    void put(uint32_t code) {
        for (int b = 0; b < nbits; ++b, ++pos_) {
            if ((pos_ >> 3) >= bytes_.size()) bytes_.push_back(0);
            if ((code >> b) & 1u) bytes_[pos_ >> 3] = static_cast<char>(bytes_[pos_ >> 3] | (1 << (pos_ & 7)));
        }
    }
    void skip_group() {
        if (!pad_) return;
        const uint64_t g = uint64_t(nbits) * 8, r = (pos_ - group_at_) % g;
        if (r) pos_ += g - r;
        group_at_ = pos_;
        bytes_.resize((pos_ + 7) >> 3, '\0');
    }
    std::string finish() { return bytes_; }
    int nbits = 9;

private:
    bool pad_;
    uint64_t pos_ = 0, group_at_ = 0;
    std::string bytes_;
};

std::string lzw_compress(const std::string& data, int maxbits = 16, bool block = true, int clear_every = 0,
                         bool pad_groups = true) {
    std::string out = {'\x1f', '\x9d', static_cast<char>(maxbits | (block ? 0x80 : 0))};
    if (data.empty()) return out;
    const uint32_t maxmax = 1u << maxbits;
    LzwWriter w(pad_groups);
    std::unordered_map<uint32_t, uint32_t> dict; // (prefix code << 8 | byte) -> code
    uint32_t free_enc = block ? 257 : 256;
    // The decoder's view, one entry behind the encoder: it grows the width when its next free entry passes maxcode.
    uint32_t free_dec = free_enc, maxcode = 511;
    bool first = true;
    int since_clear = 0;
    uint32_t ent = static_cast<uint8_t>(data[0]);
    auto emit = [&](uint32_t code) {
        w.put(code);
        if (!first && free_dec < maxmax) ++free_dec;
        first = false;
        if (free_dec > maxcode) {
            w.skip_group();
            ++w.nbits;
            maxcode = w.nbits == maxbits ? maxmax : (1u << w.nbits) - 1;
        }
    };
    for (size_t i = 1; i < data.size(); ++i) {
        const uint8_t c = static_cast<uint8_t>(data[i]);
        const uint32_t key = (ent << 8) | c;
        auto it = dict.find(key);
        if (it != dict.end()) {
            ent = it->second;
            continue;
        }
        emit(ent);
        if (free_enc < maxmax) dict[key] = free_enc++;
        if (block && clear_every > 0 && ++since_clear == clear_every) {
            w.put(256);
            w.skip_group();
            w.nbits = 9;
            maxcode = 511;
            free_enc = free_dec = 257;
            first = true;
            since_clear = 0;
            dict.clear();
        }
        ent = c;
    }
    emit(ent);
    return out + w.finish();
}

std::string sample_text(size_t n, uint32_t seed) {
    // Repetitive English-like text (long matches, so codes grow past 9 bits quickly) mixed with random bytes.
    static const char* words[] = {"the ",    "LORD ",    "and ",           "said ", "unto ",
                                  "Moses, ", "in ",      "the beginning ", "God ",  "created ",
                                  "heaven ", "earth.\n", "Ge1:1 ",         "\x00",  "\xff"};
    std::mt19937 rng(seed);
    std::string s;
    while (s.size() < n) {
        const auto k = rng() % 16;
        if (k < 15)
            s += words[k];
        else
            s.push_back(static_cast<char>(rng() & 0xff));
    }
    s.resize(n);
    return s;
}

} // namespace

TEST_CASE("LZW decoder round-trips compress(1) streams of every width", "[kjv][lzw]") {
    CHECK(decompress_lzw(lzw_compress("")).empty());
    CHECK(decompress_lzw(lzw_compress("a")) == "a");
    CHECK(decompress_lzw(lzw_compress("abababababababab")) == "abababababababab"); // the KwKwK case
    for (int maxbits : {9, 10, 12, 16}) {
        for (bool block : {true, false}) {
            for (size_t n : {size_t(1000), size_t(70000)}) {
                const auto text = sample_text(n, static_cast<uint32_t>(maxbits * 7 + n));
                INFO("maxbits " << maxbits << " block " << block << " n " << n);
                const auto z = lzw_compress(text, maxbits, block);
                CHECK(decompress_lzw(z) == text);
            }
        }
    }
    // 200 kB of varied text fills the 16-bit table (entries up to 65535, widths 9..16).
    const auto big = sample_text(200000, 99) + sample_text(200000, 100);
    CHECK(decompress_lzw(lzw_compress(big, 16, true)) == big);
}

TEST_CASE("LZW decoder: CLEAR resets the table and skips to the end of the code group", "[kjv][lzw]") {
    const auto text = sample_text(30000, 5);
    for (int every : {1, 7, 8, 300, 1000}) {
        INFO("CLEAR every " << every << " codes");
        CHECK(decompress_lzw(lzw_compress(text, 16, true, every)) == text);
    }
    // The group rule matters after CLEAR: the same codes written back to back do not decode to the text (they fail
    // or decode to something else). Growing widths need no padding in practice: 256 * 2^k codes are read at each
    // width after a reset, a whole number of groups.
    CHECK(lzw_compress(text, 16, true, 0, false) == lzw_compress(text, 16, true, 0, true));
    for (int every : {5, 300}) { // (7 codes + CLEAR would fill a group exactly)
        const auto unpadded = lzw_compress(text, 16, true, every, false);
        std::string out;
        try {
            out = decompress_lzw(unpadded);
        } catch (const Error&) {
        }
        CHECK(out != text);
    }
}

TEST_CASE("LZW decoder: bad magic, flags, truncation and corrupt codes are clear errors", "[kjv][lzw]") {
    const auto text = sample_text(5000, 11);
    const auto z = lzw_compress(text, 16, true);
    CHECK_THROWS_WITH(decompress_lzw(""), Catch::Contains("truncated"));
    CHECK_THROWS_WITH(decompress_lzw(z.substr(0, 2)), Catch::Contains("truncated"));
    CHECK_THROWS_WITH(decompress_lzw("PK\x03\x04"), Catch::Contains("magic"));
    auto flags = z;
    flags[2] = static_cast<char>(0x80 | 17);
    CHECK_THROWS_WITH(decompress_lzw(flags), Catch::Contains("9..16"));
    flags[2] = static_cast<char>(0x80 | 0x20 | 16);
    CHECK_THROWS_WITH(decompress_lzw(flags), Catch::Contains("flags"));

    // Every cut either decodes to a prefix of the text (a cut on a code boundary cannot be detected: the format has
    // no length) or is reported; a cut inside a code leaving >= 8 bits is always reported.
    int reported = 0;
    for (size_t cut = 3; cut < z.size(); ++cut) {
        try {
            const auto part = decompress_lzw(z.substr(0, cut));
            REQUIRE(part.size() <= text.size());
            REQUIRE(text.compare(0, part.size(), part) == 0);
        } catch (const Error& e) {
            REQUIRE(std::string(e.what()).find("truncated") != std::string::npos);
            ++reported;
        }
    }
    CHECK(reported > 0);

    // A code beyond the next free entry, and a first code that is not a literal.
    std::string bad = {'\x1f', '\x9d', '\x90'};
    bad += std::string("\x41\x00\x03", 3); // 9-bit codes: 'A' (0x41), then 0x180 = 384 > 257
    CHECK_THROWS_WITH(decompress_lzw(bad), Catch::Contains("corrupt"));
    std::string first = {'\x1f', '\x9d', '\x90', '\x01', '\x03'}; // first code 0x301 & 0x1ff = 257
    CHECK_THROWS_WITH(decompress_lzw(first), Catch::Contains("corrupt"));
    CHECK_THROWS_WITH(decompress_lzw(lzw_compress(text), 100), Catch::Contains("more than 100 bytes"));

    // Random damage never crashes: it decodes to something or throws anchor::Error.
    std::mt19937 rng(3);
    for (int k = 0; k < 300; ++k) {
        auto d = z;
        for (int f = 0; f < 3; ++f) d[3 + rng() % (d.size() - 3)] = static_cast<char>(rng() & 0xff);
        try {
            (void)decompress_lzw(d);
        } catch (const Error&) {
        }
    }
}

TEST_CASE("KJV verse parser: tags, title line, continuation lines, unknown books", "[kjv]") {
    const auto v = parse_kjv_verses("Holy Bible, title line.\nGe1:1 In the beginning.\nGe1:2 And the earth\nwas "
                                    "void.\n\n1Sm3:10 And the LORD came.\nRev22:21 Amen.\n");
    REQUIRE(v.size() == 4);
    CHECK(v[0].book == "Ge");
    CHECK(v[0].chapter == 1);
    CHECK(v[0].verse == 1);
    CHECK(v[0].text == "In the beginning.");
    CHECK(v[1].text == "And the earth was void.");
    CHECK(v[2].book == "1Sm");
    CHECK(v[2].chapter == 3);
    CHECK(v[2].verse == 10);
    CHECK(v[3].book == "Rev");
    CHECK_THROWS_WITH(parse_kjv_verses("no tags here\n"), Catch::Contains("no KJV verse"));
    CHECK_THROWS_WITH(parse_kjv_verses("Foo1:1 x\n"), Catch::Contains("unknown book"));
    CHECK(kjv_books().size() == 66);
    CHECK(kjv_book_index("Ecclesiastes") == kjv_book_index("Eccl"));
    CHECK(kjv_book_index("rev") == 65);
    CHECK(kjv_book_index("Tobit") == -1);
    // A .Z file of the text parses the same (kjv_text_from_bytes detects the magic).
    const std::string t = "Ge1:1 In the beginning God created the heaven and the earth.\n";
    CHECK(parse_kjv_verses(kjv_text_from_bytes(lzw_compress(t)))[0].text ==
          "In the beginning God created the heaven and the earth.");
}

TEST_CASE("Bible data container: errors name the problem", "[kjv]") {
    CHECK_THROWS_WITH(decompress_bible_data("EC02"), Catch::Contains("header"));
    // A one-window container around a stream made here.
    const std::string text = "Ge1:1 In the beginning God created the heaven and the earth.\n";
    const auto z = lzw_compress(text);
    std::string f = "EC02Compressed Data File";
    f.resize(0x54, '\0');
    auto be = [&](uint32_t x) {
        for (int s = 24; s >= 0; s -= 8) f.push_back(static_cast<char>((x >> s) & 0xff));
    };
    be(65536);
    be(1);
    const uint32_t first = 0x5c + 8 + 3;
    be(first);
    be(first + static_cast<uint32_t>(z.size() - 3));
    f += z;
    CHECK(decompress_bible_data(f) == text);
    CHECK_THROWS_WITH(decompress_bible_data(f.substr(0, f.size() - 4)), Catch::Contains("truncated"));
    auto bad = f;
    bad[0x5c + 3] = 0x10; // first window offset wrong
    CHECK_THROWS_WITH(decompress_bible_data(bad), Catch::Contains("first window"));
}

TEST_CASE("Debian bible-kjv-text: the first verse is Genesis 1:1", "[kjv][data]") {
    const auto path = find_kjv_data();
    if (path.empty()) {
        WARN("bible-kjv-text is not installed (/usr/lib/bible.data): skipping the check on the real file");
        return;
    }
    const auto verses = read_kjv(path);
    REQUIRE(!verses.empty());
    CHECK(verses.front().book == "Ge");
    CHECK(verses.front().chapter == 1);
    CHECK(verses.front().verse == 1);
    CHECK(verses.front().text == "In the beginning God created the heaven and the earth.");
    CHECK(verses.size() == 31102);
    CHECK(verses.back().book == "Rev");
    CHECK(verses.back().chapter == 22);
    CHECK(verses.back().verse == 21);
    // Every book appears, in canonical order.
    std::vector<std::string> order;
    for (const auto& v : verses)
        if (order.empty() || order.back() != v.book) order.push_back(v.book);
    REQUIRE(order.size() == 66);
    for (size_t i = 0; i < order.size(); ++i) CHECK(order[i] == kjv_books()[i].first);
}
