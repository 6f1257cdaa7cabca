#include "cache/io/png_text.h"

#include "cache/io/error.h"
#include "cache/io/read_file.h"

#include <zlib.h>

#include <array>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

namespace anchor {

namespace {

const char kSignature[8] = {'\x89', 'P', 'N', 'G', '\r', '\n', '\x1a', '\n'};
// A decompressed text larger than this is refused: a few kilobytes of zlib can expand to gigabytes.
constexpr size_t kMaxInflated = size_t(64) << 20;

// The table of PNG §5.3's sample code: crc_table[n] = CRC of the byte n, polynomial 0xEDB88320 (reflected).
const std::array<uint32_t, 256>& crc_table() {
    static const std::array<uint32_t, 256> table = [] {
        std::array<uint32_t, 256> t{};
        for (uint32_t n = 0; n < 256; ++n) {
            uint32_t c = n;
            for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
            t[n] = c;
        }
        return t;
    }();
    return table;
}

uint32_t read_be32(const std::string& b, size_t at) {
    return uint32_t(uint8_t(b[at])) << 24 | uint32_t(uint8_t(b[at + 1])) << 16 | uint32_t(uint8_t(b[at + 2])) << 8 |
           uint32_t(uint8_t(b[at + 3]));
}

void append_be32(std::string& out, uint32_t v) {
    for (int s = 24; s >= 0; s -= 8) out.push_back(char((v >> s) & 0xff));
}

std::string hex32(uint32_t v) {
    char buf[16];
    std::snprintf(buf, sizeof buf, "0x%08x", v);
    return buf;
}

// UTF-8 -> Latin-1 bytes; `ok` false for invalid UTF-8 or a code point above U+00FF.
std::string utf8_to_latin1(const std::string& s, bool& ok) {
    std::string out;
    ok = true;
    for (size_t i = 0; i < s.size(); ++i) {
        const auto c = uint8_t(s[i]);
        if (c < 0x80) {
            out.push_back(char(c));
        } else if ((c == 0xC2 || c == 0xC3) && i + 1 < s.size() && (uint8_t(s[i + 1]) & 0xC0) == 0x80) {
            out.push_back(char(((c & 0x03) << 6) | (uint8_t(s[i + 1]) & 0x3F)));
            ++i;
        } else {
            ok = false;
            return {};
        }
    }
    return out;
}

std::string latin1_to_utf8(const std::string& s) {
    std::string out;
    for (char ch : s) {
        const auto c = uint8_t(ch);
        if (c < 0x80) {
            out.push_back(ch);
        } else {
            out.push_back(char(0xC0 | (c >> 6)));
            out.push_back(char(0x80 | (c & 0x3F)));
        }
    }
    return out;
}

// §11.3.3.2: 1-79 bytes of printable Latin-1 (32-126, 161-255), no leading, trailing or consecutive spaces.
std::string checked_keyword(const std::string& keyword, const std::string& what) {
    bool ok = false;
    const std::string k = utf8_to_latin1(keyword, ok);
    const auto bad = [&](const std::string& why) {
        return Error(what + ": text chunk keyword '" + keyword + "' " + why);
    };
    if (!ok) throw bad("is not Latin-1");
    if (k.empty() || k.size() > 79) throw bad("must have 1 to 79 characters, has " + std::to_string(k.size()));
    for (size_t i = 0; i < k.size(); ++i) {
        const auto c = uint8_t(k[i]);
        if (c < 32 || (c > 126 && c < 161)) throw bad("has a non-printable character at offset " + std::to_string(i));
    }
    if (k.front() == ' ' || k.back() == ' ' || k.find("  ") != std::string::npos)
        throw bad("has a leading, trailing or double space");
    return k;
}

std::string inflate_text(const std::string& data, size_t at, const std::string& where) {
    z_stream z{};
    if (inflateInit(&z) != Z_OK) throw Error(where + ": cannot initialise zlib");
    z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(data.data() + at));
    z.avail_in = uInt(data.size() - at);
    std::string out;
    char buf[1 << 14];
    int rc = Z_OK;
    while (rc == Z_OK) {
        z.next_out = reinterpret_cast<Bytef*>(buf);
        z.avail_out = sizeof buf;
        rc = inflate(&z, Z_NO_FLUSH);
        out.append(buf, sizeof buf - z.avail_out);
        if (out.size() > kMaxInflated) rc = Z_MEM_ERROR;
        if (rc == Z_BUF_ERROR && z.avail_in == 0) break; // input ended before the stream did
    }
    inflateEnd(&z);
    if (rc != Z_STREAM_END)
        throw Error(
            where + ": compressed text does not inflate (" +
            (out.size() > kMaxInflated ? std::string("larger than 64 MiB") : "zlib error " + std::to_string(rc)) + ")");
    return out;
}

// The text chunk of type `type` from its data bytes; `where` names the file, chunk and offset.
PngTextChunk decode_text_chunk(const std::string& type, const std::string& d, const std::string& where) {
    PngTextChunk c;
    const size_t nul = d.find('\0');
    if (nul == std::string::npos) throw Error(where + ": no NUL after the keyword");
    c.keyword = latin1_to_utf8(d.substr(0, nul));
    if (type == "tEXt") {
        c.kind = PngTextKind::Text;
        c.text = latin1_to_utf8(d.substr(nul + 1));
    } else if (type == "zTXt") {
        c.kind = PngTextKind::ZText;
        c.compressed = true;
        if (nul + 1 >= d.size()) throw Error(where + ": no compression method byte");
        if (d[nul + 1] != 0) throw Error(where + ": unknown compression method " + std::to_string(uint8_t(d[nul + 1])));
        c.text = latin1_to_utf8(inflate_text(d, nul + 2, where));
    } else { // iTXt: keyword NUL flag method language NUL translated-keyword NUL text
        c.kind = PngTextKind::IText;
        if (nul + 2 >= d.size()) throw Error(where + ": no compression flag and method");
        const auto flag = uint8_t(d[nul + 1]), method = uint8_t(d[nul + 2]);
        if (flag > 1) throw Error(where + ": compression flag " + std::to_string(flag) + " (expected 0 or 1)");
        if (flag == 1 && method != 0) throw Error(where + ": unknown compression method " + std::to_string(method));
        const size_t lang_end = d.find('\0', nul + 3);
        const size_t tk_end = lang_end == std::string::npos ? lang_end : d.find('\0', lang_end + 1);
        if (tk_end == std::string::npos) throw Error(where + ": language tag or translated keyword not terminated");
        c.language = d.substr(nul + 3, lang_end - nul - 3);
        c.translated_keyword = d.substr(lang_end + 1, tk_end - lang_end - 1);
        c.compressed = flag == 1;
        c.text = c.compressed ? inflate_text(d, tk_end + 1, where) : d.substr(tk_end + 1);
    }
    return c;
}

std::string encode_text_chunk(const PngTextChunk& c, const std::string& what) {
    if (c.compressed || c.kind == PngTextKind::ZText)
        throw Error(what + ": text chunk '" + c.keyword + "': only uncompressed tEXt / iTXt are written");
    std::string data = checked_keyword(c.keyword, what);
    data.push_back('\0');
    if (c.kind == PngTextKind::Text) {
        bool ok = false;
        const std::string t = utf8_to_latin1(c.text, ok);
        if (!ok) throw Error(what + ": tEXt '" + c.keyword + "': the text is not Latin-1 (use iTXt)");
        if (t.find('\0') != std::string::npos) throw Error(what + ": tEXt '" + c.keyword + "': the text has a NUL");
        data += t;
    } else {
        data += std::string("\0\0", 2); // compression flag 0, method 0
        data += c.language + '\0' + c.translated_keyword + '\0' + c.text;
    }
    std::string out;
    append_be32(out, uint32_t(data.size()));
    const std::string body = std::string(png_chunk_type(c.kind)) + data;
    out += body;
    append_be32(out, png_crc32(body.data(), body.size()));
    return out;
}

} // namespace

const char* png_chunk_type(PngTextKind kind) {
    static const char* const types[] = {"tEXt", "zTXt", "iTXt"}; // in PngTextKind's order
    const auto i = size_t(kind);
    return i < std::size(types) ? types[i] : "?";
}

uint32_t png_crc32(const void* data, size_t n, uint32_t crc) {
    const auto& t = crc_table();
    uint32_t c = crc ^ 0xFFFFFFFFu;
    const auto* p = static_cast<const uint8_t*>(data);
    for (size_t i = 0; i < n; ++i) c = t[(c ^ p[i]) & 0xff] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

bool is_latin1_representable(const std::string& utf8) {
    bool ok = false;
    (void)utf8_to_latin1(utf8, ok);
    return ok;
}

PngTextChunk png_text(const std::string& keyword, const std::string& utf8_text) {
    PngTextChunk c;
    c.kind = is_latin1_representable(utf8_text) && utf8_text.find('\0') == std::string::npos ? PngTextKind::Text
                                                                                             : PngTextKind::IText;
    c.keyword = keyword;
    c.text = utf8_text;
    return c;
}

PngTextChunk png_itext(const std::string& keyword, const std::string& utf8_text) {
    PngTextChunk c;
    c.kind = PngTextKind::IText;
    c.keyword = keyword;
    c.text = utf8_text;
    return c;
}

std::string png_insert_text_chunks(const std::string& png, const std::vector<PngTextChunk>& chunks,
                                   const std::string& what) {
    // Signature (8) + IHDR: length 13, type, 13 data bytes, CRC = 33 bytes.
    if (png.size() < 33 || png.compare(0, 8, kSignature, 8) != 0 || png.compare(12, 4, "IHDR") != 0 ||
        read_be32(png, 8) != 13)
        throw Error(what + ": not an encoded PNG starting with the signature and a 13-byte IHDR");
    std::string out = png.substr(0, 33);
    for (const auto& c : chunks) out += encode_text_chunk(c, what);
    out.append(png, 33, std::string::npos);
    return out;
}

std::vector<PngTextChunk> parse_png_text_chunks(const std::string& b, const std::string& what) {
    if (b.size() < 8 || b.compare(0, 8, kSignature, 8) != 0)
        throw Error("'" + what + "' is not a PNG file (no PNG signature in its first 8 bytes)");
    std::vector<PngTextChunk> out;
    size_t at = 8;
    for (int index = 0;; ++index) {
        const std::string at_s = " at offset " + std::to_string(at);
        if (b.size() - at < 12)
            throw Error("'" + what + "': truncated: " + std::to_string(b.size() - at) + " bytes" + at_s +
                        " where a chunk header and CRC (12 bytes) " + (index == 0 ? "of IHDR " : "") +
                        "should be, and no IEND before the end");
        const uint32_t len = read_be32(b, at);
        const std::string type = b.substr(at + 4, 4);
        for (char ch : type)
            if (!((ch >= 'A' && ch <= 'Z') || (ch >= 'a' && ch <= 'z')))
                throw Error("'" + what + "': chunk " + std::to_string(index) + at_s +
                            " has an invalid type (not 4 ASCII letters)");
        const std::string where = "'" + what + "': chunk '" + type + "'" + at_s;
        if (index == 0 && type != "IHDR") throw Error(where + ": the first chunk must be IHDR");
        if (len > 0x7FFFFFFFu) throw Error(where + ": length " + std::to_string(len) + " exceeds 2^31 - 1");
        if (size_t(len) > b.size() - at - 12)
            throw Error(where + ": declares " + std::to_string(len) + " data bytes, only " +
                        std::to_string(b.size() - at - 12) + " left before its CRC (truncated file)");
        const uint32_t stored = read_be32(b, at + 8 + len);
        const uint32_t computed = png_crc32(b.data() + at + 4, size_t(len) + 4);
        if (stored != computed)
            throw Error(where + ": CRC mismatch (stored " + hex32(stored) + ", computed " + hex32(computed) + ")");
        if (type == "tEXt" || type == "zTXt" || type == "iTXt")
            out.push_back(decode_text_chunk(type, b.substr(at + 8, len), where));
        at += 12 + size_t(len);
        if (type == "IEND") return out;
    }
}

std::vector<PngTextChunk> read_png_text_chunks(const std::string& path) {
    if (std::filesystem::is_directory(path)) throw Error("'" + path + "' is a directory, not a PNG file");
    return parse_png_text_chunks(read_file(path), path);
}

const PngTextChunk* find_png_text(const std::vector<PngTextChunk>& chunks, const std::string& keyword) {
    for (const auto& c : chunks)
        if (c.keyword == keyword) return &c;
    return nullptr;
}

} // namespace anchor
