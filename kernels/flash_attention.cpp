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
    // The bfloat16 path: K^T as pairs of head dimensions [Dh, Mp, 2] and V as pairs of keys [Mp / 2, Dp, 2]
    // (bfloat16 bits; zero past M, D), Dh = ceil(D / 2); kt and vb are unused there.
    const uint16_t* kt2 = nullptr;
    const uint16_t* vb2 = nullptr;
    int64_t Dh = 0;
};

struct FlashScratch {
    float *o, *m, *l, *s;
    uint32_t* qb = nullptr; // bfloat16 path: the block's queries as pairs [rows, Dh]
    uint16_t* pb = nullptr; // and a tile's probabilities [R, kBlockKeys]
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

// ---- AVX-512 BF16 -------------------------------------------------------------------------------------------------
// The same tiling with both products on bfloat16 operands summed in float32 (vdpbf16ps: each lane adds the products
// of one pair of bfloat16 values, so q k^T runs over pairs of head dimensions and p v over pairs of keys). The
// scores, the online softmax and the output stay float32; q, k, v are rounded to bfloat16 once when packed and the
// probabilities once per block - the operands oneDNN's and PyTorch's bf16 attention multiply. Taken only when the
// caller asks for bf16 products (AttentionOptions::bf16_products: the UNet under --gemm bf16).
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512bf16"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16")
#endif
namespace avx512bf16 {
using Vec = avx512::Vec;
#include "kernels/flash_tile.inc"

template <int R, int KC, int DC> void flash_block_bf16(const FlashHead& h, int64_t i0, int64_t i1, FlashScratch& s) {
    constexpr int W = 16;
    const int64_t Mp = h.Mp, Dp = h.Dp, Dh = h.Dh, nrows = i1 - i0;
    const int64_t tiles = (nrows + R - 1) / R;
    float* O = s.o;
    float* m = s.m;
    float* l = s.l;
    float* S = s.s;
    uint32_t* Qb = s.qb;
    uint16_t* Pb = s.pb;
    const float ninf = -__builtin_inff();
    for (int64_t r = 0; r < tiles * R; ++r) {
        m[r] = ninf, l[r] = 0.f;
        for (int64_t d = 0; d < Dp; ++d) O[r * Dp + d] = 0.f;
        const float* q = h.q + (i0 + r < i1 ? i0 + r : i1 - 1) * h.qs; // tail rows repeat the last one
        for (int64_t p = 0; p < Dh; ++p)
            Qb[r * Dh + p] = uint32_t(bf16_bits(q[2 * p])) |
                             uint32_t(2 * p + 1 < h.D ? bf16_bits(q[2 * p + 1]) : 0) << 16;
    }
    const int64_t key_end = block_key_end(h, i1, KC * W);
    const __m512 vscale = _mm512_set1_ps(h.scale);
    const uint32_t* P32 = reinterpret_cast<const uint32_t*>(Pb);
    for (int64_t kb = 0; kb < key_end; kb += kBlockKeys) {
        const int64_t nb = key_end - kb < kBlockKeys ? key_end - kb : kBlockKeys; // a multiple of KC * W, even
        for (int64_t t = 0; t < tiles; ++t) {
            int64_t row[R];
            for (int r = 0; r < R; ++r) row[r] = i0 + t * R + r < i1 ? i0 + t * R + r : i1 - 1;
            const uint32_t* qt = Qb + t * R * Dh;
            for (int64_t j = 0; j < nb; j += KC * W) {
                __m512 acc[R][KC];
                for (int r = 0; r < R; ++r)
                    for (int c = 0; c < KC; ++c) acc[r][c] = _mm512_setzero_ps();
                const uint16_t* kt = h.kt2 + (kb + j) * 2;
                for (int64_t p = 0; p < Dh; ++p) {
                    __m512bh kv[KC];
                    for (int c = 0; c < KC; ++c)
                        kv[c] = (__m512bh)_mm512_loadu_si512(kt + (p * Mp + c * W) * 2);
                    for (int r = 0; r < R; ++r) {
                        const __m512bh b = (__m512bh)_mm512_set1_epi32(int(qt[r * Dh + p]));
                        for (int c = 0; c < KC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], b, kv[c]);
                    }
                }
                for (int r = 0; r < R; ++r)
                    for (int c = 0; c < KC; ++c)
                        _mm512_storeu_ps(S + r * kBlockKeys + j + c * W, _mm512_mul_ps(acc[r][c], vscale));
            }
            online_softmax_tile<R>(h, S, nb, kb, row, m + t * R, l + t * R, O + t * R * Dp, Dp);
            for (int r = 0; r < R; ++r) // the probabilities as bfloat16: consecutive keys form the pairs
                for (int64_t j = 0; j < nb; j += W)
                    _mm256_storeu_si256(reinterpret_cast<__m256i*>(Pb + r * kBlockKeys + j),
                                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(S + r * kBlockKeys + j)));
            for (int64_t d0 = 0; d0 < Dp; d0 += DC * W) {
                const int dc = int((Dp - d0) / W < DC ? (Dp - d0) / W : DC);
                __m512 acc[R][DC];
                for (int r = 0; r < R; ++r)
                    for (int c = 0; c < dc; ++c) acc[r][c] = _mm512_loadu_ps(O + (t * R + r) * Dp + d0 + c * W);
                const uint16_t* vb = h.vb2 + ((kb / 2) * Dp + d0) * 2;
                for (int64_t jp = 0; jp < nb / 2; ++jp) {
                    __m512bh vv[DC];
                    for (int c = 0; c < dc; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vb + (jp * Dp + c * W) * 2);
                    for (int r = 0; r < R; ++r) {
                        const __m512bh p = (__m512bh)_mm512_set1_epi32(int(P32[r * (kBlockKeys / 2) + jp]));
                        for (int c = 0; c < dc; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], p, vv[c]);
                    }
                }
                for (int r = 0; r < R; ++r)
                    for (int c = 0; c < dc; ++c) _mm512_storeu_ps(O + (t * R + r) * Dp + d0 + c * W, acc[r][c]);
            }
        }
    }
    write_block_output(h, i0, nrows, O, l, Dp);
}

void run(const FlashHead& h, int64_t i0, int64_t i1, FlashScratch& s) {
    flash_block_bf16<8, 3, 3>(h, i0, i1, s);
}
} // namespace avx512bf16
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

bool flash_bf16_available() {
#if defined(__x86_64__)
    return flash_best_isa() == FlashIsa::Avx512 && cpu_features().avx512bf16;
#else
    return false;
#endif
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
    const bool bf16 = o.bf16_products && flash_bf16_available() && isa == FlashIsa::Avx512;
    const int64_t Dh = (D + 1) / 2;
    const bool parallel_pack = BH * M * D >= (int64_t(1) << 15);
    // bf16: K^T as pairs of head dimensions [Dh, Mp, 2], V as pairs of keys [Mp / 2, Dp, 2], zero-filled first (the
    // padding; a few MiB at most); the float32 operands are not made.
    const torch::Tensor packed2 = bf16 ? torch::zeros({BH * Dh * Mp * 2 + BH * Mp * Dp}, torch::kShort) : torch::Tensor();
    uint16_t* const kt2 = bf16 ? reinterpret_cast<uint16_t*>(packed2.data_ptr<int16_t>()) : nullptr;
    uint16_t* const vb2 = bf16 ? kt2 + BH * Dh * Mp * 2 : nullptr;
    if (bf16) {
#pragma omp parallel for schedule(static) if (parallel_pack)
        for (int64_t bh = 0; bh < BH; ++bh) {
            const int64_t b = bh / H, h = bh % H;
            const float* kh = head_base(k, b, h);
            const float* vh = head_base(v, b, h);
            uint16_t* ktp = kt2 + bh * Dh * Mp * 2;
            uint16_t* vbp = vb2 + bh * Mp * Dp;
            const int64_t ks = k.stride(row_axis), vs = v.stride(row_axis);
            for (int64_t j = 0; j < M; ++j) {
                const float* kr = kh + j * ks;
                const float* vr = vh + j * vs;
                for (int64_t d = 0; d < D; ++d) {
                    ktp[((d / 2) * Mp + j) * 2 + (d & 1)] = bf16_bits(kr[d]);
                    vbp[((j / 2) * Dp + d) * 2 + (j & 1)] = bf16_bits(vr[d]);
                }
            }
        }
    }
    const torch::Tensor packed = torch::empty({bf16 ? 0 : BH * D * Mp + BH * Mp * Dp}, torch::kFloat);
    float* const kt = packed.data_ptr<float>();
    float* const vb = kt + (bf16 ? 0 : BH * D * Mp);
#pragma omp parallel for schedule(static) if (parallel_pack && !bf16)
    for (int64_t bh = 0; bh < (bf16 ? 0 : BH); ++bh) {
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
        std::vector<uint32_t> qb(bf16 ? size_t(rows * Dh) : 0);
        std::vector<uint16_t> pb(bf16 ? size_t(path.rows * kBlockKeys) : 0);
        s.qb = qb.data(), s.pb = pb.data();
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
#if defined(__x86_64__)
            if (bf16) {
                fh.kt2 = kt2 + bh * Dh * Mp * 2, fh.vb2 = vb2 + bh * Mp * Dp, fh.Dh = Dh;
                avx512bf16::run(fh, i0, i1, s);
                continue;
            }
#endif
            path.run(fh, i0, i1, s);
        }
    }
    return out;
}

} // namespace anchor::kernels
