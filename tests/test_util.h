// Helpers shared by the Catch2 tests.
#pragma once

#include <torch/torch.h>

#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <stdexcept>
#include <string>

namespace anchor::test {

// tests/golden inside the source tree (copied from ../shared/golden so a fresh clone tests on its own).
inline std::string golden(const std::string& rel) {
    return std::string(ANCHOR_TEST_GOLDEN) + "/" + rel;
}

// A fresh empty directory under the build tree for files a test writes.
inline std::string scratch_dir(const std::string& name) {
    auto d = std::filesystem::path(ANCHOR_BINARY_DIR) / "test-scratch" / name;
    std::filesystem::remove_all(d);
    std::filesystem::create_directories(d);
    return d.string();
}

inline double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
    return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

// max |a - b| / max |b|, in float64 on the CPU.
inline double rel_err(const torch::Tensor& a, const torch::Tensor& b) {
    auto a64 = a.to(torch::kCPU).to(torch::kFloat64), b64 = b.to(torch::kCPU).to(torch::kFloat64);
    const double den = b64.abs().max().item<double>();
    return (a64 - b64).abs().max().item<double>() / (den > 0 ? den : 1.0);
}

// The message of what f throws ("" when it throws nothing).
inline std::string error_of(const std::function<void()>& f) {
    try {
        f();
    } catch (const std::exception& e) {
        return e.what();
    }
    return "";
}

// A whole file's bytes; throws naming the file when it cannot be opened.
inline std::string read_bytes(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    if (!f) throw std::runtime_error("test: cannot open " + path);
    return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

inline void write_bytes(const std::string& path, const std::string& bytes) {
    std::ofstream(path, std::ios::binary) << bytes;
}

} // namespace anchor::test
