#include "cache/io/atomic_file.h"

#include "cache/io/error.h"

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <mutex>
#include <set>
#include <sys/stat.h>
#include <unistd.h>

namespace fs = std::filesystem;

namespace anchor {

namespace {

// Registry of temporary files in flight so that an interrupted program leaves nothing half-written behind.
constexpr int kMaxTemps = 64;
char g_temps[kMaxTemps][4096];
std::atomic<bool> g_used[kMaxTemps];
std::mutex g_mu;

int register_temp(const std::string& p) {
    std::lock_guard<std::mutex> lock(g_mu);
    for (int i = 0; i < kMaxTemps; ++i) {
        if (!g_used[i].load()) {
            std::snprintf(g_temps[i], sizeof(g_temps[i]), "%s", p.c_str());
            g_used[i].store(true);
            return i;
        }
    }
    return -1;
}

void unregister_temp(int slot) {
    if (slot >= 0) g_used[slot].store(false);
}

extern "C" void on_interrupt(int sig) {
    // Only async-signal-safe calls here: unlink and _exit.
    for (int i = 0; i < kMaxTemps; ++i)
        if (g_used[i].load()) ::unlink(g_temps[i]);
    ::_exit(128 + sig);
}

std::string temp_path_for(const std::string& path) {
    fs::path p(path);
    fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
    static std::atomic<unsigned> counter{0};
    return (dir / ("." + p.filename().string() + ".tmp." + std::to_string(::getpid()) + "." +
                   std::to_string(counter.fetch_add(1))))
        .string();
}

} // namespace

void install_interrupt_cleanup() {
    std::signal(SIGINT, on_interrupt);
    std::signal(SIGTERM, on_interrupt);
}

void check_output_path(const std::string& path, bool overwrite) {
    if (path.empty()) throw ParamError("output", "the output path is empty");
    std::error_code ec;
    if (fs::exists(path, ec) && !overwrite)
        throw ParamError("overwrite", "output file '" + path + "' already exists (replacing it must be asked for)");
    fs::path p(path);
    fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
    if (!fs::is_directory(dir, ec)) throw Error("output directory '" + dir.string() + "' does not exist");
    if (::access(dir.c_str(), W_OK) != 0) throw Error("output directory '" + dir.string() + "' is not writable");
    // access() says yes to root everywhere, also on /proc or a read-only mount: create and remove a probe file, so
    // that a run fails before its work instead of at its end.
    const std::string probe = temp_path_for(path) + ".probe";
    const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600);
    if (fd < 0) throw Error("output directory '" + dir.string() + "' is not writable (" + std::strerror(errno) + ")");
    ::close(fd);
    ::unlink(probe.c_str());
}

void write_via_temp(const std::string& path, const std::function<void(const std::string&)>& writer, bool overwrite) {
    check_output_path(path, overwrite);
    const std::string tmp = temp_path_for(path);
    int slot = register_temp(tmp);
    try {
        writer(tmp);
        // Flush the file's data before the rename so a crash cannot leave a renamed but empty file.
        int fd = ::open(tmp.c_str(), O_RDONLY);
        if (fd >= 0) {
            ::fsync(fd);
            ::close(fd);
        }
        if (!overwrite && fs::exists(path)) throw Error("output file '" + path + "' appeared while writing");
        if (std::rename(tmp.c_str(), path.c_str()) != 0)
            throw Error("cannot rename '" + tmp + "' to '" + path + "': " + std::strerror(errno));
    } catch (...) {
        ::unlink(tmp.c_str());
        unregister_temp(slot);
        throw;
    }
    unregister_temp(slot);
}

void write_file_atomic(const std::string& path, const std::string& bytes, bool overwrite) {
    write_via_temp(
        path,
        [&](const std::string& tmp) {
            FILE* f = std::fopen(tmp.c_str(), "wb");
            if (!f) throw Error("cannot create '" + tmp + "': " + std::strerror(errno));
            size_t n = bytes.empty() ? 0 : std::fwrite(bytes.data(), 1, bytes.size(), f);
            int rc = std::fclose(f);
            if (n != bytes.size() || rc != 0) throw Error("cannot write '" + tmp + "': " + std::strerror(errno));
        },
        overwrite);
}

} // namespace anchor
