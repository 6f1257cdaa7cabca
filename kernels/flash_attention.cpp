// Tiled online-softmax attention for CPU float32 (see kernels/attention.h, flash_attention).
//
// Why: at SD 1.5's 512x512 the first and last UNet levels attend over 4096 tokens with heads of 40, and the VAE's
// mid-block over 4096 tokens of 512 channels. The reference path writes a 4096 x 4096 score matrix per head (64 MiB),
// soft-maxes it and reads it back: q k^T with an inner dimension of 40 is bound by writing its output, and the softmax
// and the second product stream the buffer twice more. Here scores live in a tile of R rows x 192 keys; each block of
// K^T and V is packed once per head and stays in cache while every query tile of a 64-row block passes over it.
//
// Instruction sets: AVX-512F (16 lanes, 8 query rows x 48 keys of scores in 24 accumulators), AVX2/FMA (8 lanes,
// 6 rows x 16 keys), a portable scalar path; chosen at run time (cpu_features). The exponential is Cephes' expf
// polynomial (kernels/simd_math.h, shared with small_attention) in the vector paths, __builtin_expf in the portable
// one.
#include "kernels/attention.h"

#include "kernels/cpu_features.h"
#include "kernels/simd_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace anchor::kernels {

namespace {

// Keys per block (a multiple of every path's key step: 48, 16, 1) and query rows per block.
constexpr int64_t kBlockKeys = 192;
constexpr int64_t kBlockRows = 64;

// One head: q rows at q + i * qs (D values), K^T packed [D, Mp], V packed [Mp, Dp] (zero rows/columns past M, D),
// output rows at o + i * os.
struct FlashHead {
    const float* q;
    const float* kt;
    const float* vb;
    float* o;
    int64_t qs, os, N, M, D, Mp, Dp;
    float scale;
    bool causal;
    int64_t causal_offset; // query i sees keys j <= i + causal_offset
};

struct FlashScratch {
    float *o, *m, *l, *s;
};

// ---- portable -----------------------------------------------------------------------------------------------------
namespace portable {
struct Vec {
    using T = float;
    static constexpr int W = 1;
    static T load(const float* p) { return *p; }
    static void store(float* p, T v) { *p = v; }
    static T set1(float v) { return v; }
    static T zero() { return 0.f; }
    static T fma(T a, T b, T c) { return a * b + c; }
    static T mul(T a, T b) { return a * b; }
    static T add(T a, T b) { return a + b; }
    static T sub(T a, T b) { return a - b; }
    static T max(T a, T b) { return a > b || a != a ? a : b; }
    static float hmax(T v) { return v; }
    static float hsum(T v) { return v; }
    static T exp(T v) { return __builtin_expf(v); }
    static float exp1(float v) { return __builtin_expf(v); }
};
#include "kernels/flash_tile.inc"
void run(const FlashHead& h, int64_t i0, int64_t i1, FlashScratch& s) {
    flash_block<4, 1, 1>(h, i0, i1, s);
}
} // namespace portable

#if defined(__x86_64__)
// ---- AVX2 / FMA ---------------------------------------------------------------------------------------------------
#if defined(__clang__)
// clang ignores GCC's target pragma; its attribute region gives every function below the target.
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif
namespace avx2 {
struct Vec {
    using T = __m256;
    static constexpr int W = 8;
    static T load(const float* p) { return _mm256_loadu_ps(p); }
    static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
    static T set1(float v) { return _mm256_set1_ps(v); }
    static T zero() { return _mm256_setzero_ps(); }
    static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
    static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
    static T add(T a, T b) { return _mm256_add_ps(a, b); }
    static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
    static T max(T a, T b) { return _mm256_max_ps(a, b); }
    static float hmax(T v) { return simd::hmax8(v); }
    static float hsum(T v) { return simd::hsum8(v); }
    static T exp(T x) { return simd::exp_ps(x); } // e^x for x <= 0 (kernels/simd_math.h)
    static float exp1(float v) { return _mm256_cvtss_f32(exp(_mm256_set1_ps(v))); }
};
#include "kernels/flash_tile.inc"
void run(const FlashHead& h, int64_t i0, int64_t i1, FlashScratch& s) {
    flash_block<6, 2, 2>(h, i0, i1, s);
}
} // namespace avx2
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// ---- AVX-512F -----------------------------------------------------------------------------------------------------
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f")
#endif
namespace avx512 {
struct Vec {
    using T = __m512;
    static constexpr int W = 16;
    static T load(const float* p) { return _mm512_loadu_ps(p); }
    static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
    static T set1(float v) { return _mm512_set1_ps(v); }
    static T zero() { return _mm512_setzero_ps(); }
    static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
    static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
    static T add(T a, T b) { return _mm512_add_ps(a, b); }
    static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
    static T max(T a, T b) { return _mm512_max_ps(a, b); }
    static float hmax(T v) { return _mm512_reduce_max_ps(v); }
    static float hsum(T v) { return _mm512_reduce_add_ps(v); }
    static T exp(T x) { return simd::exp_ps(x); }
    static float exp1(float v) { return _mm512_cvtss_f32(exp(_mm512_set1_ps(v))); }
};
#include "kernels/flash_tile.inc"
void run(const FlashHead& h, int64_t i0, int64_t i1, FlashScratch& s) {
    flash_block<8, 3, 3>(h, i0, i1, s);
}
} // namespace avx512
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif

using RunFn = void (*)(const FlashHead&, int64_t, int64_t, FlashScratch&);

struct Path {
    RunFn run;
    int64_t key_step, lanes, rows; // K^T padding, V/O padding, query rows per tile
};

Path path_of(FlashIsa isa) {
#if defined(__x86_64__)
    if (isa == FlashIsa::Avx512) return {avx512::run, 48, 16, 8};
    if (isa == FlashIsa::Avx2) return {avx2::run, 16, 8, 6};
#endif
    (void)isa;
    return {portable::run, 1, 1, 4};
}

int64_t round_up(int64_t x, int64_t m) {
    return (x + m - 1) / m * m;
}

} // namespace

FlashIsa flash_best_isa() {
#if defined(__x86_64__)
    const auto& f = cpu_features();
    if (f.avx512f) return FlashIsa::Avx512;
    if (f.avx2 && f.fma) return FlashIsa::Avx2;
#endif
    return FlashIsa::Portable;
}

bool flash_isa_available(FlashIsa isa) {
    const FlashIsa best = flash_best_isa();
    if (isa == FlashIsa::Portable || isa == best) return true;
    return isa == FlashIsa::Avx2 && best == FlashIsa::Avx512 && cpu_features().avx2 && cpu_features().fma;
}

const EnumTable<FlashIsa>& flash_isa_table() {
    static const EnumTable<FlashIsa> t = {
        {"avx512", FlashIsa::Avx512}, {"avx2", FlashIsa::Avx2}, {"portable", FlashIsa::Portable}};
    return t;
}

bool flash_attention_applies(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const AttentionOptions& o) {
    const int64_t rank = o.layout == AttentionLayout::Projection ? 3 : 4;
    if (q.dim() != rank || k.dim() != rank || v.dim() != rank || o.additive_mask.defined()) return false;
    for (const auto* t : {&q, &k, &v})
        if (!t->device().is_cpu() || t->scalar_type() != torch::kFloat) return false;
    if (torch::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad())) return false;
    if (rank == 3 && (o.heads < 1 || q.size(2) % o.heads != 0)) return false;
    const int64_t N = q.size(rank - 2), M = k.size(rank - 2);
    // Fewer queries than a tile: the 1x1 / 2x2 levels of the tiny reference UNets, whose GroupNorm over 2-4 values
    // amplifies rounding ~1000x (small_attention_applies); they stay on the exact path.
    return N >= kMinQueries && M >= 1;
}

torch::Tensor flash_attention(const torch::Tensor& q_in, const torch::Tensor& k_in, const torch::Tensor& v_in,
                              const AttentionOptions& o, FlashIsa isa) {
    const bool projection = o.layout == AttentionLayout::Projection;
    const int64_t rank = projection ? 3 : 4;
    TORCH_CHECK(q_in.dim() == rank && k_in.dim() == rank && v_in.dim() == rank, "flash_attention: q, k, v must be ",
                projection ? "[B, tokens, heads * head_dim]" : "[B, heads, tokens, head_dim]", ", got q ", q_in.sizes(),
                ", k ", k_in.sizes(), ", v ", v_in.sizes());
    TORCH_CHECK(q_in.scalar_type() == torch::kFloat && k_in.scalar_type() == torch::kFloat &&
                    v_in.scalar_type() == torch::kFloat,
                "flash_attention: float32 only");
    TORCH_CHECK(!o.additive_mask.defined(), "flash_attention: no additive mask (causal only)");
    TORCH_CHECK(flash_isa_available(isa), "flash_attention: this CPU has no ", enum_name(flash_isa_table(), isa));
    const int64_t B = q_in.size(0), N = q_in.size(rank - 2), M = k_in.size(rank - 2);
    const int64_t H = projection ? o.heads : q_in.size(1);
    TORCH_CHECK(H >= 1 && (!projection || q_in.size(2) % H == 0), "flash_attention: width ", q_in.size(-1),
                " not divisible by ", H, " heads");
    const int64_t D = projection ? q_in.size(2) / H : q_in.size(3);
    TORCH_CHECK(k_in.size(0) == B && v_in.size(0) == B && v_in.size(rank - 2) == M &&
                    (projection ? k_in.size(2) == H * D && v_in.size(2) == H * D
                                : k_in.size(1) == H && v_in.size(1) == H && k_in.size(3) == D && v_in.size(3) == D),
                "flash_attention: k ", k_in.sizes(), " and v ", v_in.sizes(), " do not match q ", q_in.sizes());
    const double scale = o.scale >= 0 ? o.scale : 1.0 / std::sqrt(double(D));
    // PreScaledQuery (CLIP) scales the query first; the others scale the product.
    const bool prescaled = o.formula == ScoreFormula::PreScaledQuery;
    auto unit = [](const torch::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); };
    const torch::Tensor q = prescaled ? (q_in * scale).contiguous() : unit(q_in);
    const torch::Tensor k = unit(k_in), v = unit(v_in);
    auto out = torch::empty(q_in.sizes(), q_in.options().memory_format(torch::MemoryFormat::Contiguous));
    if (B == 0 || N == 0 || H == 0 || D == 0) return out;
    TORCH_CHECK(M > 0, "flash_attention: no keys");
    const Path path = path_of(isa);
    const int64_t Mp = round_up(M, path.key_step), Dp = round_up(D, path.lanes), BH = B * H;
    // Where head (b, h) starts and how far apart its rows are, in both layouts.
    auto head_base = [&](const torch::Tensor& t, int64_t b, int64_t h) {
        return t.data_ptr<float>() + b * t.stride(0) + (projection ? h * D : h * t.stride(1));
    };
    const int64_t row_axis = rank - 2;
    // Both packed operands in one block from LibTorch's allocator, which serves a forward's large blocks from its
    // cache (cache/util/heap.h): glibc may hand a freed block of this size back to the system and fault it in again,
    // page by page, on the next call. Only the padding is zeroed; the packing writes everything else.
    const torch::Tensor packed = torch::empty({BH * D * Mp + BH * Mp * Dp}, torch::kFloat);
    float* const kt = packed.data_ptr<float>();
    float* const vb = kt + BH * D * Mp;
    const bool parallel_pack = BH * M * D >= (int64_t(1) << 15);
#pragma omp parallel for schedule(static) if (parallel_pack)
    for (int64_t bh = 0; bh < BH; ++bh) {
        const int64_t b = bh / H, h = bh % H;
        const float* kh = head_base(k, b, h);
        const float* vh = head_base(v, b, h);
        float* ktp = kt + bh * D * Mp;
        float* vbp = vb + bh * Mp * Dp;
        const int64_t ks = k.stride(row_axis), vs = v.stride(row_axis);
        for (int64_t j = 0; j < M; ++j) {
            const float* kr = kh + j * ks;
            const float* vr = vh + j * vs;
            for (int64_t d = 0; d < D; ++d) ktp[d * Mp + j] = kr[d];
            std::copy(vr, vr + D, vbp + j * Dp);
            std::fill(vbp + j * Dp + D, vbp + (j + 1) * Dp, 0.f);
        }
        for (int64_t d = 0; d < D; ++d) std::fill(ktp + d * Mp + M, ktp + (d + 1) * Mp, 0.f);
        std::fill(vbp + M * Dp, vbp + Mp * Dp, 0.f);
    }
    const int64_t blocks = (N + kBlockRows - 1) / kBlockRows, jobs = BH * blocks;
    const int64_t qs = q.stride(row_axis), os = out.stride(row_axis);
    const bool parallel = jobs > 1 && BH * N * M * D >= (int64_t(1) << 15);
#pragma omp parallel if (parallel)
    {
        const int64_t rows = round_up(kBlockRows, path.rows);
        std::vector<float> scratch(size_t(rows * Dp + 2 * rows + path.rows * kBlockKeys));
        FlashScratch s{scratch.data(), scratch.data() + rows * Dp, scratch.data() + rows * Dp + rows,
                       scratch.data() + rows * Dp + 2 * rows};
#pragma omp for schedule(dynamic, 1)
        for (int64_t job = 0; job < jobs; ++job) {
            const int64_t bh = job / blocks, blk = job % blocks, b = bh / H, h = bh % H;
            FlashHead fh{head_base(q, b, h),
                         kt + bh * D * Mp,
                         vb + bh * Mp * Dp,
                         out.data_ptr<float>() + b * out.stride(0) + (projection ? h * D : h * out.stride(1)),
                         qs,
                         os,
                         N,
                         M,
                         D,
                         Mp,
                         Dp,
                         float(prescaled ? 1.0 : scale),
                         o.causal && N > 1,
                         M - N};
            const int64_t i0 = blk * kBlockRows, i1 = std::min(N, i0 + kBlockRows);
            path.run(fh, i0, i1, s);
        }
    }
    return out;
}

} // namespace anchor::kernels
