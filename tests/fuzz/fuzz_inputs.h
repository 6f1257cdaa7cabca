// The replayable inputs of one fuzz target: every file of tests/fuzz/corpus/<target>/ and every crashing input kept
// as tests/fuzz/crashes/fuzz_<target>-*, in a stable (sorted) order. Shared by fuzz_replay and sanitized_parsers.
#pragma once

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace anchor::fuzz {

inline std::vector<std::string> fuzz_inputs(const std::filesystem::path& dir, const std::string& target) {
    namespace fs = std::filesystem;
    std::vector<fs::path> files;
    if (fs::is_directory(dir / "corpus" / target))
        for (const auto& e : fs::directory_iterator(dir / "corpus" / target)) files.push_back(e.path());
    if (fs::is_directory(dir / "crashes"))
        for (const auto& e : fs::directory_iterator(dir / "crashes"))
            if (e.path().filename().string().rfind("fuzz_" + target + "-", 0) == 0) files.push_back(e.path());
    std::sort(files.begin(), files.end());
    std::vector<std::string> out;
    for (const auto& f : files) {
        std::ifstream in(f, std::ios::binary);
        out.emplace_back((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    }
    return out;
}

} // namespace anchor::fuzz
