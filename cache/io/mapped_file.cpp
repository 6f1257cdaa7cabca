#include "cache/io/mapped_file.h"

#include "cache/io/error.h"

#include <cerrno>
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
