// The process's compute resources as LibTorch sees them: which BLAS the loader resolved, and the intra-op thread
// count. Programs, the golden runner and the tests set threads the same way.
#pragma once

#include <string>

namespace anchor::util {

// The BLAS library actually loaded into this process (from /proc/self/maps and OpenBLAS' own config string).
std::string blas_in_use();

// What this binary was built with and runs on, one line each: compiler, build type and flags, OpenMP, LibTorch
// version, CPU features the kernels dispatch on (passed in: cache/ does not link kernels/), BLAS, threads.
std::string build_description(const std::string& cpu_features);

// Sets LibTorch's intra-op threads; n <= 0 means all cores. Returns the count in effect.
int configure_threads(int n);

} // namespace anchor::util
