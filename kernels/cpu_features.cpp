#include "kernels/cpu_features.h"

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
    return s.empty() ? "none" : s.substr(0, s.size() - 1);
}

} // namespace anchor::kernels
