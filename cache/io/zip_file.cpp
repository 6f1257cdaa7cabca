#include "cache/io/zip_file.h"

#include "cache/io/error.h"

#include <zlib.h>

#include <cstring>
#include <limits>

namespace anchor {

namespace {

// APPNOTE 4.3.7, 4.3.12, 4.3.14, 4.3.15, 4.3.16 signatures and fixed sizes.
constexpr uint32_t kLocalSig = 0x04034b50, kCentralSig = 0x02014b50, kEocdSig = 0x06054b50;
constexpr uint32_t kZip64EocdSig = 0x06064b50, kZip64LocatorSig = 0x07064b50;
constexpr size_t kLocalSize = 30, kCentralSize = 46, kEocdSize = 22, kZip64EocdSize = 56, kZip64LocatorSize = 20;
constexpr uint32_t k32 = 0xffffffffu;
constexpr uint16_t k16 = 0xffffu;

uint16_t u16(const char* p) {
    const auto* b = reinterpret_cast<const unsigned char*>(p);
    return static_cast<uint16_t>(b[0] | (b[1] << 8));
}
uint32_t u32(const char* p) {
    const auto* b = reinterpret_cast<const unsigned char*>(p);
    return static_cast<uint32_t>(b[0]) | (static_cast<uint32_t>(b[1]) << 8) | (static_cast<uint32_t>(b[2]) << 16) |
           (static_cast<uint32_t>(b[3]) << 24);
}
uint64_t u64(const char* p) {
    return static_cast<uint64_t>(u32(p)) | (static_cast<uint64_t>(u32(p + 4)) << 32);
}

// `off + len <= size` without overflow.
bool fits(uint64_t off, uint64_t len, uint64_t size) {
    return off <= size && len <= size - off;
}

uint32_t crc_of(const char* p, uint64_t n) {
    uLong crc = ::crc32(0L, Z_NULL, 0);
    while (n > 0) {
        const uInt chunk = static_cast<uInt>(n > (1u << 30) ? (1u << 30) : n);
        crc = ::crc32(crc, reinterpret_cast<const Bytef*>(p), chunk);
        p += chunk;
        n -= chunk;
    }
    return static_cast<uint32_t>(crc);
}

} // namespace

bool looks_like_zip(const char* data, size_t size) {
    return size >= 4 && (u32(data) == kLocalSig || (size == kEocdSize && u32(data) == kEocdSig));
}

void ZipReader::fail(const std::string& what) const {
    throw Error("zip archive '" + label_ + "': " + what);
}

ZipReader::ZipReader(const char* base, size_t size, std::string label)
    : base_(base), size_(size), label_(std::move(label)) {
    // The EOCD ends the file, followed only by its comment (at most 65535 bytes): search backwards for it.
    if (size_ < kEocdSize) fail("truncated: " + std::to_string(size_) + " bytes, too short for a zip archive");
    size_t eocd = std::string::npos;
    const size_t lowest = size_ - kEocdSize > 65535 ? size_ - kEocdSize - 65535 : 0;
    for (size_t p = size_ - kEocdSize + 1; p-- > lowest;) {
        if (u32(base_ + p) == kEocdSig && p + kEocdSize + u16(base_ + p + 20) == size_) {
            eocd = p;
            break;
        }
    }
    if (eocd == std::string::npos)
        fail("no end-of-central-directory record (truncated or not a zip file; " + std::to_string(size_) + " bytes)");
    const char* e = base_ + eocd;
    if (u16(e + 4) != 0 || u16(e + 6) != 0) fail("multi-disk archives are not supported");
    uint64_t count = u16(e + 10), cd_size = u32(e + 12), cd_offset = u32(e + 16);
    uint64_t cd_end_limit = eocd; // the central directory lies before the EOCD (or the zip64 records)
    if (count == k16 || cd_size == k32 || cd_offset == k32) {
        // zip64: the locator sits right before the EOCD and points at the zip64 EOCD record.
        if (eocd < kZip64LocatorSize || u32(base_ + eocd - kZip64LocatorSize) != kZip64LocatorSig)
            fail("the end-of-central-directory record asks for zip64 but there is no zip64 locator before it");
        const char* loc = base_ + eocd - kZip64LocatorSize;
        const uint64_t z = u64(loc + 8);
        if (!fits(z, kZip64EocdSize, eocd - kZip64LocatorSize) || u32(base_ + z) != kZip64EocdSig)
            fail("zip64 end-of-central-directory record missing at offset " + std::to_string(z));
        const char* r = base_ + z;
        if (u32(r + 16) != 0 || u32(r + 20) != 0) fail("multi-disk archives are not supported");
        count = u64(r + 32);
        cd_size = u64(r + 40);
        cd_offset = u64(r + 48);
        cd_end_limit = z;
    }
    if (!fits(cd_offset, cd_size, cd_end_limit))
        fail("central directory (offset " + std::to_string(cd_offset) + ", " + std::to_string(cd_size) +
             " bytes) lies outside the file (truncated?)");
    if (count > cd_size / kCentralSize)
        fail("central directory claims " + std::to_string(count) + " entries in " + std::to_string(cd_size) + " bytes");
    entries_.reserve(static_cast<size_t>(count));
    uint64_t p = cd_offset;
    const uint64_t cd_end = cd_offset + cd_size;
    for (uint64_t i = 0; i < count; ++i) {
        const std::string where = "central directory entry " + std::to_string(i);
        if (!fits(p, kCentralSize, cd_end)) fail(where + " is truncated");
        const char* c = base_ + p;
        if (u32(c) != kCentralSig) fail(where + " has a bad signature at offset " + std::to_string(p));
        ZipEntry z;
        const uint16_t flags = u16(c + 8);
        z.method = u16(c + 10);
        z.crc32 = u32(c + 16);
        z.compressed_size = u32(c + 20);
        z.size = u32(c + 24);
        const uint16_t name_len = u16(c + 28), extra_len = u16(c + 30), comment_len = u16(c + 32);
        const uint16_t disk = u16(c + 34);
        z.header_offset = u32(c + 42);
        if (!fits(p + kCentralSize, uint64_t(name_len) + extra_len + comment_len, cd_end))
            fail(where + ": name/extra/comment run past the central directory");
        z.name.assign(c + kCentralSize, name_len);
        const std::string ew = "entry '" + z.name + "'";
        if (flags & 1u) fail(ew + " is encrypted");
        if (z.method != 0 && z.method != 8)
            fail(ew + " uses compression method " + std::to_string(z.method) + " (only stored and deflate are read)");
        // zip64 extended information (APPNOTE 4.5.3): the 8-byte values, in this order, of the fields set to ~0.
        const char* x = c + kCentralSize + name_len;
        const char* x_end = x + extra_len;
        while (x_end - x >= 4) {
            const uint16_t id = u16(x), len = u16(x + 2);
            if (len > x_end - x - 4) fail(ew + ": extra field runs past its header");
            if (id == 0x0001) {
                const char* q = x + 4;
                const char* q_end = q + len;
                auto take = [&](uint64_t& v, const char* field) {
                    if (q_end - q < 8) fail(ew + ": zip64 extra field lacks the " + std::string(field));
                    v = u64(q);
                    q += 8;
                };
                if (z.size == k32) take(z.size, "uncompressed size");
                if (z.compressed_size == k32) take(z.compressed_size, "compressed size");
                if (z.header_offset == k32) take(z.header_offset, "local header offset");
            }
            x += 4 + len;
        }
        if (disk != 0 && disk != k16) fail(ew + " is on another disk");
        if (z.method == 0 && z.compressed_size != z.size)
            fail(ew + " is stored but its sizes differ (" + std::to_string(z.compressed_size) + " vs " +
                 std::to_string(z.size) + ")");
        // The local header repeats name and has its own extra field (torch pads it to align the data).
        if (!fits(z.header_offset, kLocalSize, cd_offset))
            fail(ew + ": local header offset " + std::to_string(z.header_offset) + " lies outside the file data");
        const char* l = base_ + z.header_offset;
        if (u32(l) != kLocalSig)
            fail(ew + ": no local file header at offset " + std::to_string(z.header_offset) + " (corrupt archive)");
        const uint64_t data = z.header_offset + kLocalSize + u16(l + 26) + u16(l + 28);
        if (u16(l + 26) != name_len || !fits(z.header_offset + kLocalSize, name_len, cd_offset) ||
            std::memcmp(l + kLocalSize, z.name.data(), name_len) != 0)
            fail(ew + ": the local header names another entry");
        if (!fits(data, z.compressed_size, cd_offset))
            fail(ew + ": data (offset " + std::to_string(data) + ", " + std::to_string(z.compressed_size) +
                 " bytes) runs past the end of the file data (truncated?)");
        z.data_offset = data;
        if (index_.count(z.name)) fail("entry '" + z.name + "' appears twice");
        index_[z.name] = entries_.size();
        entries_.push_back(std::move(z));
        p += kCentralSize + name_len + extra_len + comment_len;
    }
}

const ZipEntry* ZipReader::find(const std::string& name) const {
    auto it = index_.find(name);
    return it == index_.end() ? nullptr : &entries_[it->second];
}

const char* ZipReader::stored_data(const ZipEntry& e) const {
    if (e.method != 0) fail("entry '" + e.name + "' is compressed; it cannot be read in place");
    return base_ + e.data_offset;
}

void ZipReader::check_crc(const ZipEntry& e) const {
    const uint32_t c = crc_of(stored_data(e), e.size);
    if (c != e.crc32) fail("entry '" + e.name + "' fails its CRC-32 check (corrupt data)");
}

std::string ZipReader::read(const ZipEntry& e, uint64_t max_size) const {
    if (e.size > max_size)
        fail("entry '" + e.name + "' is " + std::to_string(e.size) + " bytes, more than the " +
             std::to_string(max_size) + " allowed");
    if (e.size > std::numeric_limits<size_t>::max() / 2) fail("entry '" + e.name + "' is too large");
    std::string out;
    if (e.method == 0) {
        out.assign(base_ + e.data_offset, static_cast<size_t>(e.size));
    } else {
        out.resize(static_cast<size_t>(e.size));
        z_stream zs{};
        if (inflateInit2(&zs, -MAX_WBITS) != Z_OK) fail("cannot start zlib for entry '" + e.name + "'");
        const char* in = base_ + e.data_offset;
        uint64_t in_left = e.compressed_size, out_done = 0;
        int rc = Z_OK;
        while (rc == Z_OK) {
            const uInt in_chunk = static_cast<uInt>(in_left > (1u << 30) ? (1u << 30) : in_left);
            const uint64_t out_left = e.size - out_done;
            const uInt out_chunk = static_cast<uInt>(out_left > (1u << 30) ? (1u << 30) : out_left);
            zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in));
            zs.avail_in = in_chunk;
            zs.next_out = reinterpret_cast<Bytef*>(&out[0] + out_done);
            zs.avail_out = out_chunk;
            rc = inflate(&zs, Z_NO_FLUSH);
            const uInt used = in_chunk - zs.avail_in, made = out_chunk - zs.avail_out;
            in += used;
            in_left -= used;
            out_done += made;
            if (rc == Z_OK && used == 0 && made == 0) rc = Z_BUF_ERROR; // no progress: input or output exhausted
        }
        inflateEnd(&zs);
        if (rc != Z_STREAM_END || out_done != e.size)
            fail("entry '" + e.name + "': deflate data is corrupt or does not match its size (" +
                 std::to_string(out_done) + " of " + std::to_string(e.size) + " bytes)");
    }
    if (crc_of(out.data(), out.size()) != e.crc32) fail("entry '" + e.name + "' fails its CRC-32 check (corrupt data)");
    return out;
}

} // namespace anchor
