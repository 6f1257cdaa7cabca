// Run-time CPU feature detection: the AVX2/FMA/F16C kernels are chosen only where the CPU has them, so one binary
// runs everywhere and the portable reference path is always available.
#pragma once

// A function compiled for AVX-512, AVX2 and baseline x86-64 and picked by the loader (GCC's function
// multiversioning): for plain loops the compiler vectorises, without a per-ISA copy of the source.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ANCHOR_TARGET_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define ANCHOR_TARGET_CLONES
#endif

#include <string>

namespace anchor::kernels {

struct CpuFeatures {
    bool avx2 = false;
    bool fma = false;
    bool f16c = false;
    bool avx512f = false;
    bool avx512bw = false; // with avx512vl: masked 16-bit loads (f16 row tails)
    bool avx512vl = false;
    bool avx512vnni = false; // vpdpbusd: the int8 dot of the q8_0 gemv
    bool avx512bf16 = false; // vdpbf16ps: bfloat16 products summed in float32 (the bf16 GEMM backend)
    bool amx_bf16 = false;   // AMX tiles with bfloat16 (ditto)
};

const CpuFeatures& cpu_features();
std::string cpu_features_string();

} // namespace anchor::kernels
