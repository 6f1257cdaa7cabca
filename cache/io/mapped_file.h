// A file mapped into memory copy-on-write (MAP_PRIVATE + PROT_WRITE): tensors can be views of the file's bytes, and an
// in-place op on such a view can never reach the file.
#pragma once

#include <cstddef>
#include <string>

namespace anchor {

class MappedFile {
public:
    MappedFile() = default;
    // Throws anchor::Error naming the file when it cannot be opened, is not a regular file or cannot be mapped. An
    // empty file maps to data() == nullptr, size() == 0.
    explicit MappedFile(const std::string& path);
    ~MappedFile();
    MappedFile(MappedFile&& o) noexcept;
    MappedFile& operator=(MappedFile&& o) noexcept;
    MappedFile(const MappedFile&) = delete;
    MappedFile& operator=(const MappedFile&) = delete;

    const char* data() const { return static_cast<const char*>(map_); }
    // Drops the resident pages wholly inside [p, p + n) when that range lies in the mapping (madvise DONTNEED): a
    // later read maps them from the file again, so a loader that has copied a tensor out keeps no second copy of it
    // in memory. Only for ranges nobody changed in place (a copy-on-write change would be dropped).
    void release(const void* p, size_t n) const;
    size_t size() const { return size_; }

private:
    void* map_ = nullptr;
    size_t size_ = 0;
};

} // namespace anchor
