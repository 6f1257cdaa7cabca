// Regression runner for the fuzz targets, built with the ordinary tests (no clang or libFuzzer needed): every file
// of tests/fuzz/corpus/<target>/ and every crashing input kept in tests/fuzz/crashes/<fuzz_target>-* is run through
// the target's entry point. A contract violation aborts, so the CTest entry fails.
// Usage: fuzz_replay DIR (the tests/fuzz folder).
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

// Each target in this one translation unit under its own name.
#define LLVMFuzzerTestOneInput fuzz_one_gpt2_tokenizer
#include "fuzz_gpt2_tokenizer.cpp"
#undef LLVMFuzzerTestOneInput
#define LLVMFuzzerTestOneInput fuzz_one_clip_tokenizer
#include "fuzz_clip_tokenizer.cpp"
#undef LLVMFuzzerTestOneInput
#define LLVMFuzzerTestOneInput fuzz_one_configs
#include "fuzz_configs.cpp"
#undef LLVMFuzzerTestOneInput
#define LLVMFuzzerTestOneInput fuzz_one_options
#include "fuzz_options.cpp"
#undef LLVMFuzzerTestOneInput
#define LLVMFuzzerTestOneInput fuzz_one_safetensors
#include "fuzz_safetensors.cpp"
#undef LLVMFuzzerTestOneInput

namespace fs = std::filesystem;

int main(int argc, char** argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: fuzz_replay DIR (tests/fuzz)\n");
        return 2;
    }
    using Fn = int (*)(const uint8_t*, size_t);
    const std::vector<std::pair<std::string, Fn>> targets = {{"gpt2_tokenizer", fuzz_one_gpt2_tokenizer},
                                                             {"clip_tokenizer", fuzz_one_clip_tokenizer},
                                                             {"configs", fuzz_one_configs},
                                                             {"options", fuzz_one_options},
                                                             {"safetensors", fuzz_one_safetensors}};
    const fs::path dir = argv[1];
    int total = 0;
    for (const auto& [name, fn] : targets) {
        std::vector<fs::path> files;
        if (fs::is_directory(dir / "corpus" / name))
            for (const auto& e : fs::directory_iterator(dir / "corpus" / name)) files.push_back(e.path());
        if (fs::is_directory(dir / "crashes"))
            for (const auto& e : fs::directory_iterator(dir / "crashes"))
                if (e.path().filename().string().rfind("fuzz_" + name + "-", 0) == 0) files.push_back(e.path());
        for (const auto& f : files) {
            std::ifstream in(f, std::ios::binary);
            const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
            fn(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
        }
        std::printf("fuzz_replay: %s: %zu inputs\n", name.c_str(), files.size());
        total += static_cast<int>(files.size());
    }
    std::printf("fuzz_replay: %d inputs, all within the contracts\n", total);
    return 0;
}
