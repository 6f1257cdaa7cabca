// PNG text chunks (W3C PNG 3rd edition / ISO 15948 §11.3.3): tEXt (Latin-1), zTXt (Latin-1, zlib) and iTXt
// (UTF-8, optionally zlib), inserted into an encoded PNG and read back from a file with every chunk's length and
// CRC-32 (§5.3) checked. Plumbing only: what the keywords mean is the caller's business.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace anchor {

enum class PngTextKind { Text, ZText, IText }; // tEXt, zTXt, iTXt

struct PngTextChunk {
    PngTextKind kind = PngTextKind::Text;
    std::string keyword;     // 1-79 printable Latin-1 characters, no leading, trailing or double spaces
    std::string text;        // always UTF-8 here: tEXt / zTXt are converted from and to Latin-1 at the byte level
    bool compressed = false; // zTXt always; iTXt with compression flag 1
    std::string language, translated_keyword; // iTXt only
};

// "tEXt", "zTXt" or "iTXt".
const char* png_chunk_type(PngTextKind kind);

// CRC-32 of PNG (ISO 3309 / ITU-T V.42 polynomial 0xEDB88320, reflected), continued from `crc` (0 to start).
uint32_t png_crc32(const void* data, size_t n, uint32_t crc = 0);

// Whether `utf8` has only code points below 256 (what a tEXt chunk can hold).
bool is_latin1_representable(const std::string& utf8);

// A tEXt chunk when the text fits Latin-1, else an uncompressed iTXt chunk, as PIL's PngInfo.add_text does.
PngTextChunk png_text(const std::string& keyword, const std::string& utf8_text);
PngTextChunk png_itext(const std::string& keyword, const std::string& utf8_text);

// `png` (an encoded PNG) with the chunks inserted right after IHDR. Written uncompressed (compressed = true is
// refused). Throws anchor::Error naming `what` for a buffer that does not start with the signature and IHDR, a bad
// keyword, a tEXt text outside Latin-1, or a NUL in a tEXt text.
std::string png_insert_text_chunks(const std::string& png, const std::vector<PngTextChunk>& chunks,
                                   const std::string& what = "PNG");

// Every text chunk of a PNG, in file order. Checks the signature, IHDR first, every chunk's length against the bytes
// left, every CRC, and IEND; throws anchor::Error naming `what` (the file), the chunk, its offset, expected and
// actual. Compressed zTXt / iTXt are inflated (zlib).
std::vector<PngTextChunk> parse_png_text_chunks(const std::string& bytes, const std::string& what);
std::vector<PngTextChunk> read_png_text_chunks(const std::string& path);

// The first chunk of `chunks` with `keyword`, nullptr when there is none.
const PngTextChunk* find_png_text(const std::vector<PngTextChunk>& chunks, const std::string& keyword);

} // namespace anchor
