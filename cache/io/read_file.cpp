#include "cache/io/read_file.h"

#include "cache/io/error.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

namespace anchor {

std::string read_file(const std::string& path, const std::string& what) {
    const std::string named = (what.empty() ? "" : what + " ") + "'" + path + "'";
    // An ifstream opens a folder on Linux and then fails its first read: say what it is instead.
    std::error_code ec;
    if (std::filesystem::is_directory(path, ec)) throw Error("cannot read " + named + ": it is a directory");
    std::ifstream in(path, std::ios::binary);
    if (!in) throw Error("cannot read " + named + ": " + std::strerror(errno));
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (in.bad()) throw Error("cannot read " + named + ": a read failed");
    return bytes;
}

} // namespace anchor
