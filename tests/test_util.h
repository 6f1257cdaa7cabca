// Helpers shared by the Catch2 tests.
#pragma once

#include <torch/torch.h>

#include <exception>
#include <filesystem>
#include <functional>
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

// The message of what f throws ("" when it throws nothing).
inline std::string error_of(const std::function<void()>& f) {
    try {
        f();
    } catch (const std::exception& e) {
        return e.what();
    }
    return "";
}

} // namespace anchor::test
