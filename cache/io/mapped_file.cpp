#include "cache/io/mapped_file.h"

#include "cache/io/error.h"

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <utility>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace anchor {

MappedFile::MappedFile(const std::string& path) {
    int fd = ::open(path.c_str(), O_RDONLY);
    if (fd < 0) throw Error("cannot open '" + path + "': " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        ::close(fd);
        throw Error("'" + path + "' is not a regular file");
    }
    const size_t n = static_cast<size_t>(st.st_size);
    if (n > 0) {
        void* m = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
        if (m == MAP_FAILED) {
            const int err = errno;
            ::close(fd);
            throw Error("cannot memory-map '" + path + "': " + std::strerror(err));
        }
        map_ = m;
        size_ = n;
    }
    ::close(fd);
}

void MappedFile::release(const void* p, size_t n) const {
    const auto* b = static_cast<const char*>(map_);
    const auto* c = static_cast<const char*>(p);
    if (!b || c < b || c + n > b + size_) return;
    const auto page = uintptr_t(sysconf(_SC_PAGESIZE));
    const uintptr_t lo = (uintptr_t(c) + page - 1) & ~(page - 1), hi = (uintptr_t(c) + n) & ~(page - 1);
    if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
}

MappedFile::~MappedFile() {
    if (map_) ::munmap(map_, size_);
}

MappedFile::MappedFile(MappedFile&& o) noexcept
    : map_(std::exchange(o.map_, nullptr)), size_(std::exchange(o.size_, 0)) {}

MappedFile& MappedFile::operator=(MappedFile&& o) noexcept {
    if (this != &o) {
        if (map_) ::munmap(map_, size_);
        map_ = std::exchange(o.map_, nullptr);
        size_ = std::exchange(o.size_, 0);
    }
    return *this;
}

} // namespace anchor
