#include "cache/util/threads.h"

#include "cache/util/heap.h"

#include "anchor_build_info.h"

#include <torch/torch.h>
#include <torch/version.h>

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <thread>

namespace anchor::util {

namespace {
// openblas_get_parallel(): 0 single-threaded build, 1 pthreads, 2 OpenMP.
constexpr int kOpenBlasPthreads = 1;
} // namespace

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
        using parallel_fn = int (*)();
        if (auto p = reinterpret_cast<parallel_fn>(dlsym(RTLD_DEFAULT, "openblas_get_parallel"))) {
            const int mode = p();
            out += mode == kOpenBlasPthreads ? ", pthreads build (libopenblas0-openmp is the one to use)"
                   : mode == 2              ? ", OpenMP build"
                                            : ", single-threaded build";
        }
        using cores_fn = char* (*)();
        if (auto c = reinterpret_cast<cores_fn>(dlsym(RTLD_DEFAULT, "openblas_get_corename"))) {
            out += std::string(", core ") + c();
            if (const char* from = std::getenv("ANCHOR_BLAS_CORE_FROM"))
                out += std::string(" (selected at start: OpenBLAS chose ") + from + " for this CPU)";
        }
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
           " intra-op\n  heap: " + heap_mode();
}

void select_blas_core(char** argv) {
    if (std::getenv("OPENBLAS_CORETYPE") != nullptr || argv == nullptr || argv[0] == nullptr) return;
    using cores_fn = char* (*)();
    auto corename = reinterpret_cast<cores_fn>(dlsym(RTLD_DEFAULT, "openblas_get_corename"));
    if (corename == nullptr || std::strcmp(corename(), "Prescott") != 0) return;
#if defined(__x86_64__)
    const char* core = nullptr;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vl"))
        core = "SkylakeX";
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        core = "Haswell";
    if (core == nullptr) return;
    setenv("OPENBLAS_CORETYPE", core, 1);
    setenv("ANCHOR_BLAS_CORE_FROM", corename(), 1);
    execv("/proc/self/exe", argv);
    // exec failed (no /proc): carry on with the kernels OpenBLAS chose
    unsetenv("OPENBLAS_CORETYPE");
    unsetenv("ANCHOR_BLAS_CORE_FROM");
#endif
}

int configure_threads(int n) {
    if (n <= 0) n = static_cast<int>(std::thread::hardware_concurrency());
    if (n <= 0) n = 1;
    at::set_num_threads(n);
    // OpenBLAS built on pthreads (libopenblas0-pthread, which Debian's alternatives prefer where it is installed
    // beside the OpenMP build) keeps its own pool sized by OPENBLAS_NUM_THREADS or the core count, which the OpenMP
    // count set above does not reach: its large GEMMs would run on every core, beside LibTorch's threads. Its own
    // setter makes n hold there too. (The OpenMP build follows omp_get_max_threads() by itself; its setter called with
    // 1 would pin it to one thread for good, so it is left alone.)
    using parallel_fn = int (*)();
    using set_threads_fn = void (*)(int);
    auto parallel = reinterpret_cast<parallel_fn>(dlsym(RTLD_DEFAULT, "openblas_get_parallel"));
    auto set_threads = reinterpret_cast<set_threads_fn>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
    if (parallel != nullptr && set_threads != nullptr && parallel() == kOpenBlasPthreads) set_threads(n);
    return at::get_num_threads();
}

} // namespace anchor::util
