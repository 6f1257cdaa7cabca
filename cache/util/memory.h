// The memory check every request and job makes before it allocates: an estimate of its peak bytes against what the
// machine has available, so that a size the machine cannot hold is refused with the field that sets it instead of
// failing half-way (or, in a server, taking the process down).
#pragma once

#include <cstdint>
#include <string>

namespace anchor {

// MemAvailable of /proc/meminfo plus what this process's heap holds freed (util::heap_free_bytes), in bytes; -1
// where /proc/meminfo cannot be read (the check is then skipped).
int64_t available_memory_bytes();
// "1.5" (GiB, one decimal) for messages.
std::string fmt_gib(double bytes);
// ParamError(field): "<what> needs about X GiB of memory, this machine has Y GiB available; <hint>" when `need_bytes`
// exceeds `available` (default: available_memory_bytes(); -1 skips the check).
void check_fits_memory(const std::string& field, double need_bytes, const std::string& what, const std::string& hint,
                       int64_t available = -2);

} // namespace anchor
