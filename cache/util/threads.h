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

// OpenBLAS picks its kernels by CPU model number when it is loaded. Debian 12's OpenBLAS 0.3.21 does not know CPUs
// newer than it (e.g. Xeon family 6 model 207) and falls back to its Prescott (SSE3) kernels: fp32 GEMM several times slower
// than its AVX-512 kernels on the same CPU, for every linear layer. OPENBLAS_CORETYPE overrides the choice, but only
// at load time, so a program calls this first thing in main(): when OpenBLAS chose Prescott, the variable is unset
// and the CPU has AVX-512 (SkylakeX kernels) or AVX2/FMA (Haswell), it sets the variable and re-executes itself once.
// A user's OPENBLAS_CORETYPE (even empty) is left alone. ANCHOR_BLAS_CORE_FROM records what was replaced.
void select_blas_core(char** argv);

// Sets LibTorch's intra-op threads; n <= 0 means all cores. Returns the count in effect.
int configure_threads(int n);

} // namespace anchor::util
