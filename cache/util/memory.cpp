#include "cache/util/memory.h"

#include "cache/io/error.h"
#include "cache/util/heap.h"

#include <cstdio>
#include <fstream>

namespace anchor {

int64_t available_memory_bytes() {
    std::ifstream f("/proc/meminfo");
    std::string key, unit;
    int64_t kb = 0;
    while (f >> key >> kb >> unit)
        // What the heap keeps freed is this process's to reuse (cache/util/heap.h): available too.
        if (key == "MemAvailable:") return kb * 1024 + util::heap_free_bytes();
    return -1;
}

std::string fmt_gib(double bytes) {
    char b[32];
    std::snprintf(b, sizeof b, "%.1f", bytes / double(1LL << 30));
    return b;
}

void check_fits_memory(const std::string& field, double need_bytes, const std::string& what, const std::string& hint,
                       int64_t available) {
    const double avail = double(available == -2 ? available_memory_bytes() : available);
    if (avail > 0 && need_bytes > avail)
        throw ParamError(field, what + " needs about " + fmt_gib(need_bytes) + " GiB of memory, this machine has " +
                                    fmt_gib(avail) + " GiB available; " + hint);
}

} // namespace anchor
