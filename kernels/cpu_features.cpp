#include "kernels/cpu_features.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace anchor::kernels {

const CpuFeatures& cpu_features() {
    static const CpuFeatures f = [] {
        CpuFeatures r;
#if defined(__x86_64__) || defined(__i386__)
        __builtin_cpu_init();
        r.avx2 = __builtin_cpu_supports("avx2");
        r.fma = __builtin_cpu_supports("fma");
        r.avx512f = __builtin_cpu_supports("avx512f");
        r.avx512bw = __builtin_cpu_supports("avx512bw");
        r.avx512vl = __builtin_cpu_supports("avx512vl");
        r.avx512vnni = __builtin_cpu_supports("avx512vnni");
        // AVX512-BF16: CPUID leaf 7 sub-leaf 1, EAX bit 5; AMX-BF16: leaf 7 sub-leaf 0, EDX bit 22 (Intel SDM vol. 2A,
        // CPUID). GCC 12 has no __builtin_cpu_supports name for either.
        unsigned a = 0, b = 0, c = 0, d = 0;
        if (__get_cpuid_count(7, 1, &a, &b, &c, &d)) r.avx512bf16 = r.avx512f && (a & (1u << 5)) != 0;
        if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) r.amx_bf16 = (d & (1u << 22)) != 0;
        // F16C has no __builtin_cpu_supports name in GCC 12; every AVX2 CPU (Haswell+, Zen+) has it.
        r.f16c = r.avx2;
#endif
        return r;
    }();
    return f;
}

std::string cpu_features_string() {
    const auto& f = cpu_features();
    std::string s;
    if (f.avx2) s += "avx2 ";
    if (f.fma) s += "fma ";
    if (f.f16c) s += "f16c ";
    if (f.avx512f) s += "avx512f ";
    if (f.avx512bw) s += "avx512bw ";
    if (f.avx512vl) s += "avx512vl ";
    if (f.avx512vnni) s += "avx512vnni ";
    if (f.avx512bf16) s += "avx512bf16 ";
    if (f.amx_bf16) s += "amx-bf16 ";
    return s.empty() ? "none" : s.substr(0, s.size() - 1);
}

} // namespace anchor::kernels
