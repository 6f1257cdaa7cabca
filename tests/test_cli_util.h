// Runs the built programs (anchor-sd, anchor-text) from tests: exit code and combined stdout+stderr.
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

namespace anchor::test {

inline std::string sd_bin() { return std::string(ANCHOR_BINARY_DIR) + "/anchor-sd"; }
inline std::string text_bin() { return std::string(ANCHOR_BINARY_DIR) + "/anchor-text"; }

struct ProgramResult {
    int exit_code = -1; // -1: killed by a signal (a crash), see `signal`
    int signal = 0;
    std::string output; // stdout and stderr interleaved
};

// Single-quotes for /bin/sh.
inline std::string shell_quote(const std::string& s) {
    std::string q = "'";
    for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return q + "'";
}

// Runs `program args...` from the source tree (tests run there), stdin from `stdin_file` (default /dev/null).
inline ProgramResult run_program(const std::string& program, const std::vector<std::string>& args,
                                 const std::string& stdin_file = "/dev/null") {
    std::string cmd = "cd " + shell_quote(ANCHOR_SOURCE_DIR) + " && OMP_NUM_THREADS=1 " + shell_quote(program);
    for (const auto& a : args) cmd += " " + shell_quote(a);
    cmd += " <" + shell_quote(stdin_file) + " 2>&1";
    FILE* p = popen(cmd.c_str(), "r");
    if (!p) throw std::runtime_error("popen failed for " + cmd);
    ProgramResult r;
    std::array<char, 4096> buf{};
    size_t n;
    while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
    const int status = pclose(p);
    if (WIFEXITED(status)) {
        r.exit_code = WEXITSTATUS(status);
        // sh reports a child killed by signal N as exit 128+N.
        if (r.exit_code > 128) r.signal = r.exit_code - 128, r.exit_code = -1;
    } else if (WIFSIGNALED(status)) {
        r.signal = WTERMSIG(status);
    }
    return r;
}

// The chunks of PNG bytes other than its text chunks (tEXt, iTXt, zTXt): two runs that made the same pixels agree
// here whatever their metadata says.
inline std::string png_image_chunks(const std::string& png) {
    std::string out;
    for (size_t at = 8; at + 12 <= png.size();) {
        const uint32_t len = uint32_t(uint8_t(png[at])) << 24 | uint32_t(uint8_t(png[at + 1])) << 16 |
                             uint32_t(uint8_t(png[at + 2])) << 8 | uint32_t(uint8_t(png[at + 3]));
        const std::string type = png.substr(at + 4, 4);
        if (type != "tEXt" && type != "iTXt" && type != "zTXt") out += png.substr(at, 12 + size_t(len));
        at += 12 + size_t(len);
    }
    return out;
}

} // namespace anchor::test
