// The King James Version as Debian's `bible-kjv-text` ships it, read without external tools.
//
// `/usr/lib/bible.data` is the compressed data file of the Bible Retrieval System (Chip Chapin, 1989): a header
// ("EC02Compressed Data File"), a table of window offsets, one Unix `compress` (.Z) stream header, then one LZW code
// stream per 64 KiB window of text. The text is one verse per line, each line starting with a tag such as
// `Ge1:1 ` (book, chapter:verse) after a one-line title.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace anchor::text {

// Decompresses a Unix `compress` (.Z) stream: magic 1f 9d, a flags byte (max code width 9..16 in the low 5 bits,
// block mode 0x80 = code 256 is CLEAR), then LSB-first codes of 9..max bits. Like compress(1), codes are read in
// groups of 8 of the current width: whenever the width changes (it grows, or CLEAR resets it), the reader skips to
// the end of the current group of 8 codes (counted from where that width began).
// Throws anchor::Error on a bad magic or flags, a missing header, a code the decoder cannot have seen (corrupt), a
// stream cut inside a code (truncated: 8 or more bits left that make no whole code), or output beyond `max_output`
// bytes. The format has no length or checksum: a cut that falls within the last byte after a whole code cannot be
// told from a shorter stream.
std::string decompress_lzw(const std::string& bytes, size_t max_output = size_t(1) << 30);

// The text inside a Bible Retrieval System data file (every window decompressed and checked against the window
// size). Throws anchor::Error naming what is wrong (header, table, window).
std::string decompress_bible_data(const std::string& bytes);

// Text of a KJV file: a Bible Retrieval System data file, a .Z stream or plain text (recognised by their magic).
std::string kjv_text_from_bytes(const std::string& bytes);

struct KjvVerse {
    std::string book; // tag as in the file: "Ge", "Exo", ..., "1Sm", ..., "Rev"
    int chapter = 0;
    int verse = 0;
    std::string text; // without the tag
};

// Splits text into verses: every line starting with `<book><chapter>:<verse> ` opens a verse; lines before the first
// tag (the title) are skipped, later untagged non-empty lines continue the previous verse. Throws anchor::Error when
// no verse is found or a tag names an unknown book.
std::vector<KjvVerse> parse_kjv_verses(const std::string& text);

// The installed data file (/usr/lib/bible.data, or /usr/share/bible-kjv/bible.data), or "" when none exists.
std::string find_kjv_data();
// Reads and parses `path` ("" = find_kjv_data()). Throws anchor::Error when the file is missing or unreadable, with
// the hint `apt-get install bible-kjv-text`.
std::vector<KjvVerse> read_kjv(const std::string& path = "");

// The 66 books in canonical order: {tag used in bible.data, English name}.
const std::vector<std::pair<std::string, std::string>>& kjv_books();
// Index of a book in kjv_books() by tag or English name (case-insensitive), or -1.
int kjv_book_index(const std::string& tag_or_name);

} // namespace anchor::text
