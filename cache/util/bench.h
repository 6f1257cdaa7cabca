// Small helpers shared by the benchmarks and the long-running jobs: wall clock, min/median/max, load average, RSS and
// its peak, printf-style number formatting.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

namespace anchor::util {

inline double now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// A "Key:   1234 kB" field of /proc/self/status in bytes; -1 when unavailable.
inline int64_t proc_status_bytes(const char* key) {
    std::ifstream f("/proc/self/status");
    std::string line;
    const std::string k = std::string(key) + ":";
    while (std::getline(f, line))
        if (line.rfind(k, 0) == 0) return std::stoll(line.substr(k.size())) * 1024;
    return -1;
}
inline int64_t rss_now_bytes() {
    return proc_status_bytes("VmRSS");
} // resident set size now
inline int64_t peak_rss_bytes() {
    return proc_status_bytes("VmHWM");
} // its high-water mark
// Resets VmHWM to the current RSS (Linux >= 4.0: "5" to /proc/self/clear_refs), so that a later peak_rss_* is the
// high-water mark since now; false where that is not possible (the peak then counts from the start).
inline bool reset_peak_rss() {
    std::ofstream f("/proc/self/clear_refs");
    return bool(f << "5" << std::flush);
}
// Peak resident set size in MiB; -1 when unavailable.
inline double peak_rss_mib() {
    const auto b = peak_rss_bytes();
    return b < 0 ? -1.0 : double(b) / (1024.0 * 1024.0);
}

// "1.23 0.98 0.50": benchmarks print it at start and end, since a loaded 2-core machine makes timings meaningless.
inline std::string load_average() {
    std::ifstream f("/proc/loadavg");
    std::string a, b, c;
    f >> a >> b >> c;
    return a + " " + b + " " + c;
}

struct Stats {
    double min = 0, median = 0, max = 0;
};

inline Stats stats_of(std::vector<double> v) {
    Stats s;
    if (v.empty()) return s;
    std::sort(v.begin(), v.end());
    s.min = v.front();
    s.max = v.back();
    s.median = v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
    return s;
}

inline std::string fmt(const char* f, double v) {
    char buf[64];
    std::snprintf(buf, sizeof buf, f, v);
    return buf;
}

} // namespace anchor::util
