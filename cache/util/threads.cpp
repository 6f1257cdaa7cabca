#include "cache/util/threads.h"

#include "anchor_build_info.h"

#include <torch/torch.h>
#include <torch/version.h>

#include <dlfcn.h>
#include <fstream>
#include <set>
#include <thread>

namespace anchor::util {

std::string blas_in_use() {
    // Which libblas the dynamic loader resolved (Debian's alternatives decide this at install time).
    std::ifstream maps("/proc/self/maps");
    std::string line;
    std::set<std::string> libs;
    while (std::getline(maps, line)) {
        auto pos = line.find('/');
        if (pos == std::string::npos) continue;
        std::string path = line.substr(pos);
        if (path.find("blas") != std::string::npos && path.find(".so") != std::string::npos) libs.insert(path);
    }
    std::string out;
    using cfg_fn = char* (*)();
    if (auto f = reinterpret_cast<cfg_fn>(dlsym(RTLD_DEFAULT, "openblas_get_config"))) {
        out = std::string("OpenBLAS (") + f() + ")";
        using cores_fn = char* (*)();
        if (auto c = reinterpret_cast<cores_fn>(dlsym(RTLD_DEFAULT, "openblas_get_corename")))
            out += std::string(", core ") + c();
    } else {
        out = "reference BLAS or unknown (OpenBLAS not loaded: install libopenblas0-openmp, ~35x faster GEMM)";
    }
    for (const auto& l : libs) out += "\n               " + l;
    return out;
}

std::string build_description(const std::string& cpu_features) {
    std::string blas = blas_in_use();
    if (auto nl = blas.find('\n'); nl != std::string::npos) blas.resize(nl);
    return std::string("  build: ") + ANCHOR_BUILD_COMPILER + ", " + ANCHOR_BUILD_TYPE + " (" + ANCHOR_BUILD_CXX_FLAGS +
           "), OpenMP " + (std::string(ANCHOR_BUILD_OPENMP) == "TRUE" ? "on" : "off") + ", LibTorch " + TORCH_VERSION +
           "\n  cpu: " + cpu_features + "\n  blas: " + blas + "\n  threads: " + std::to_string(at::get_num_threads()) +
           " intra-op";
}

int configure_threads(int n) {
    if (n <= 0) n = static_cast<int>(std::thread::hardware_concurrency());
    if (n <= 0) n = 1;
    at::set_num_threads(n);
    return at::get_num_threads();
}

} // namespace anchor::util
