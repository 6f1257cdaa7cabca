// Regression runner for the fuzz targets, built with the ordinary tests (no clang or libFuzzer needed): every input
// of fuzz_inputs.h is run through the target's entry point. A contract violation aborts, so the CTest entry fails.
// Usage: fuzz_replay DIR (the tests/fuzz folder).
#include "fuzz_inputs.h"

#include <cstdint>
#include <cstdio>
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
#define LLVMFuzzerTestOneInput fuzz_one_torch_checkpoint
#include "fuzz_torch_checkpoint.cpp"
#undef LLVMFuzzerTestOneInput

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
                                                             {"safetensors", fuzz_one_safetensors},
                                                             {"torch_checkpoint", fuzz_one_torch_checkpoint}};
    int total = 0;
    for (const auto& [name, fn] : targets) {
        const auto inputs = anchor::fuzz::fuzz_inputs(argv[1], name);
        for (const auto& bytes : inputs) fn(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
        std::printf("fuzz_replay: %s: %zu inputs\n", name.c_str(), inputs.size());
        total += static_cast<int>(inputs.size());
    }
    std::printf("fuzz_replay: %d inputs, all within the contracts\n", total);
    return 0;
}
