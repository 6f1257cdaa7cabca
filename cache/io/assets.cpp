#include "cache/io/assets.h"

#include "cache/io/error.h"

#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <filesystem>

namespace anchor {

namespace fs = std::filesystem;

namespace {

std::string executable_dir() {
    char buf[PATH_MAX];
    const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
    if (n <= 0) return "";
    buf[n] = 0;
    return fs::path(buf).parent_path().string();
}

} // namespace

std::vector<std::string> asset_candidates(const std::string& rel) {
    std::vector<std::string> c;
    if (const char* env = std::getenv("ANCHOR_ASSETS")) c.push_back((fs::path(env) / rel).string());
    const std::string exe = executable_dir();
    if (!exe.empty()) {
        c.push_back((fs::path(exe) / "assets" / rel).string());
        c.push_back((fs::path(exe) / ".." / "assets" / rel).lexically_normal().string());
        c.push_back((fs::path(exe) / ".." / "share" / "anchorcache" / "assets" / rel).lexically_normal().string());
    }
#ifdef ANCHOR_SOURCE_DIR
    c.push_back((fs::path(ANCHOR_SOURCE_DIR) / "assets" / rel).string());
#endif
    return c;
}

std::string find_asset_or_empty(const std::string& rel) {
    for (const auto& p : asset_candidates(rel))
        if (fs::exists(p)) return p;
    return "";
}

std::string find_asset(const std::string& rel, const std::string& what) {
    const std::string p = find_asset_or_empty(rel);
    if (!p.empty()) return p;
    std::string tried;
    for (const auto& c : asset_candidates(rel)) tried += "\n  " + c;
    throw Error(what + " not found; looked in:" + tried + "\n(set ANCHOR_ASSETS to the assets folder)");
}

} // namespace anchor
