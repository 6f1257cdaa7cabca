// Reading ZIP archives as torch.save (>= 1.6) writes them, free of LibTorch so the parser that sees untrusted bytes
// can be built alone under the sanitizers (tests/sanitize).
//
// Format (PKWARE APPNOTE.TXT): local file headers + data, then the central directory, then the end of central
// directory record (EOCD, sections 4.3.12-4.3.16). torch's writer (caffe2/serialize/inline_container, miniz) stores
// every record uncompressed, pads each local header's extra field so the data starts 64-byte aligned, and switches
// to the zip64 records (4.3.14, 4.3.15, extra field 0x0001 in 4.5.3) when sizes or offsets pass 4 GiB. We read
// stored (method 0) and deflated (method 8, zlib) entries; encryption, multi-disk archives and other methods are
// refused. The central directory is authoritative (a data descriptor after the data is not needed).
//
// Every offset and size is checked against the buffer before use; a truncated or corrupt archive throws
// anchor::Error naming the file, the entry and what is wrong.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace anchor {

struct ZipEntry {
    std::string name;
    uint16_t method = 0;          // 0 stored, 8 deflate
    uint32_t crc32 = 0;           // of the uncompressed bytes
    uint64_t compressed_size = 0; // bytes at data_offset
    uint64_t size = 0;            // uncompressed
    uint64_t header_offset = 0;   // local file header
    uint64_t data_offset = 0;     // first byte of the (compressed) data in the buffer
};

// A parsed view of `size` bytes at `base`; the bytes must outlive the reader.
class ZipReader {
public:
    // Parses the central directory and every local header. Throws anchor::Error naming `label`.
    ZipReader(const char* base, size_t size, std::string label);

    const std::string& label() const { return label_; }
    const std::vector<ZipEntry>& entries() const { return entries_; } // central directory order
    const ZipEntry* find(const std::string& name) const;              // nullptr when absent
    // The uncompressed bytes of an entry (a copy; inflated when deflated), CRC-32 checked; at most `max_size`
    // bytes, else an error (a small record such as data.pkl must not make us allocate gigabytes).
    std::string read(const ZipEntry& e, uint64_t max_size = UINT64_MAX) const;
    // The bytes of a stored entry in place (no copy); throws for a compressed entry.
    const char* stored_data(const ZipEntry& e) const;
    // Checks the CRC-32 of a stored entry in place; throws naming the entry on a mismatch.
    void check_crc(const ZipEntry& e) const;

private:
    [[noreturn]] void fail(const std::string& what) const;
    const char* base_;
    size_t size_;
    std::string label_;
    std::vector<ZipEntry> entries_;
    std::map<std::string, size_t> index_;
};

// True when the bytes start like a ZIP archive (a local file header, or the EOCD of an empty archive).
bool looks_like_zip(const char* data, size_t size);

} // namespace anchor
