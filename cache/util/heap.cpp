#include "cache/util/heap.h"

#include <cstdlib>
#include <cstring>
#include <limits>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace anchor::util {

namespace {
std::string& mode() {
    static std::string m = "system (not configured)";
    return m;
}
} // namespace

std::string configure_heap() {
    const char* env = std::getenv("ANCHOR_HEAP");
    if (env != nullptr && std::strcmp(env, "system") == 0) return mode() = "system (glibc defaults, ANCHOR_HEAP=system)";
#if defined(__GLIBC__)
    // Both return 1 on success. The trim threshold is a size_t in glibc; INT_MAX bytes (2 GiB) of free heap top is
    // the most mallopt's int takes, which keeps every block a step frees for the next one.
    if (mallopt(M_MMAP_MAX, 0) == 1 && mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max()) == 1)
        return mode() = "reuse (mmap off, no trim)";
#endif
    return mode() = "system (mallopt not available)";
}

int64_t heap_free_bytes() {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
    return int64_t(mallinfo2().fordblks);
#else
    return 0;
#endif
}

std::string heap_mode() {
    return mode();
}

} // namespace anchor::util
