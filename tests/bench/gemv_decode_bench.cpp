// The matrix-vector products of one GPT-2-small decode step (12 x [2304x768, 768x768, 3072x768, 768x3072] and the
// 50257x768 logits: 124 M weights, far more than the caches) in each weight format and kernel, interleaved round by
// round, beside a plain 512-bit streaming read of a buffer as large as the f32 weights (the bandwidth ceiling of a
// weight-streaming kernel at this thread count). Prints min / median ms per step and the weight GB/s at the min.
//
//   OMP_NUM_THREADS=1 ./build/tests/gemv_decode_bench [rounds=15] [hot]
// `hot`: one 512x768 layer read again and again from the L2 cache instead: the kernels' arithmetic rate alone.
#include "kernels/cpu_features.h"
#include "kernels/gemv.h"
#include "kernels/gemv_packed.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include <omp.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

double now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Layer {
    int64_t rows, cols;
    torch::Tensor f32, f16, q8, q4, q8p, q4p;
};

#if defined(__x86_64__)
// Sum of every float of [p, p + n) through 512-bit loads, four chains, OpenMP over contiguous halves.
__attribute__((target("avx512f"))) float stream_read(const float* p, int64_t n) {
    float total = 0.f;
#pragma omp parallel reduction(+ : total)
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t per = (n / nt) & ~int64_t(63), a = t * per, b = t == nt - 1 ? n : a + per;
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        int64_t i = a;
        for (; i + 64 <= b; i += 64) {
            s0 = _mm512_add_ps(s0, _mm512_loadu_ps(p + i));
            s1 = _mm512_add_ps(s1, _mm512_loadu_ps(p + i + 16));
            s2 = _mm512_add_ps(s2, _mm512_loadu_ps(p + i + 32));
            s3 = _mm512_add_ps(s3, _mm512_loadu_ps(p + i + 48));
        }
        float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
        for (; i < b; ++i) s += p[i];
        total += s;
    }
    return total;
}
#endif

} // namespace

int main(int argc, char** argv) {
    using namespace anchor::kernels;
    torch::NoGradGuard ng;
    const int rounds = argc > 1 ? std::stoi(argv[1]) : 15;
    torch::manual_seed(0);
    std::vector<Layer> layers;
    auto add = [&](int64_t rows, int64_t cols) {
        Layer l{rows, cols, {}, {}, {}, {}, {}, {}};
        l.f32 = huge_page_copy(torch::randn({rows, cols}) * 0.02);
        l.f16 = huge_page_copy(l.f32.to(torch::kHalf));
        auto q8 = quantize_q8_0(l.f32), q4 = quantize_q4_0(l.f32);
        l.q8 = huge_page_copy(q8);
        l.q4 = huge_page_copy(q4);
        l.q8p = huge_page_copy(pack_q8_0_rows(q8, cols));
        l.q4p = huge_page_copy(pack_q4_0_rows(q4, cols));
        layers.push_back(std::move(l));
    };
    const bool hot = argc > 2 && std::string(argv[2]) == "hot";
    if (hot)
        add(512, 768);
    else {
        for (int i = 0; i < 12; ++i) add(2304, 768), add(768, 768), add(3072, 768), add(768, 3072);
        add(50257, 768);
    }
    double weights = 0;
    for (const auto& l : layers) weights += double(l.rows * l.cols);
    std::vector<float> x(3072), y(50257);
    for (size_t i = 0; i < x.size(); ++i) x[i] = float(std::sin(double(i)));
    const float* xp = x.data();
    float* yp = y.data();

    struct Row {
        std::string name;
        double bytes_per_weight;
        std::function<void()> run;
        std::vector<double> t;
    };
    std::vector<Row> rows;
    rows.push_back({"f32 gemv", 4.0, [&] {
                        for (auto& l : layers) gemv_f32(l.f32.data_ptr<float>(), xp, nullptr, yp, l.rows, l.cols);
                    }});
    rows.push_back({"f16 gemv", 2.0, [&] {
                        for (auto& l : layers)
                            gemv_f16(reinterpret_cast<const uint16_t*>(l.f16.data_ptr<at::Half>()), xp, nullptr, yp,
                                     l.rows, l.cols);
                    }});
    rows.push_back({"q8_0 blocks", 34.0 / 32, [&] {
                        for (auto& l : layers)
                            gemv_q8_0(reinterpret_cast<const BlockQ8_0*>(l.q8.data_ptr<uint8_t>()), xp, nullptr, yp,
                                      l.rows, l.cols);
                    }});
    rows.push_back({"q8_0 packed", 34.0 / 32, [&] {
                        for (auto& l : layers) gemv_q8_0_packed(l.q8p.data_ptr<uint8_t>(), xp, nullptr, yp, l.rows, l.cols);
                    }});
    rows.push_back({"q4_0 blocks", 18.0 / 32, [&] {
                        for (auto& l : layers)
                            gemv_q4_0(reinterpret_cast<const BlockQ4_0*>(l.q4.data_ptr<uint8_t>()), xp, nullptr, yp,
                                      l.rows, l.cols);
                    }});
    rows.push_back({"q4_0 packed", 18.0 / 32, [&] {
                        for (auto& l : layers) gemv_q4_0_packed(l.q4p.data_ptr<uint8_t>(), xp, nullptr, yp, l.rows, l.cols);
                    }});
#if defined(__x86_64__)
    // The plain read over the f32 weights of the stack layer by layer (the same bytes as the f32 row).
    volatile float sink = 0.f;
    if (cpu_features().avx512f)
        rows.push_back({"stream read f32", 4.0, [&] {
                            float s = 0.f;
                            for (auto& l : layers) s += stream_read(l.f32.data_ptr<float>(), l.rows * l.cols);
                            sink = sink + s;
                        }});
#endif
    for (int r = 0; r < rounds + 1; ++r)
        for (auto& row : rows) {
            const double t0 = now_s();
            row.run();
            if (r > 0) row.t.push_back(now_s() - t0); // round 0 warms
        }
    std::printf("# gemv_decode_bench: GPT-2-small decode products, %d rounds, threads %d, %s, packed %s\n", rounds,
                omp_get_max_threads(), gemv_isa().c_str(), packed_rows_fast() ? "512-bit VNNI" : "portable");
    for (auto& row : rows) {
        std::sort(row.t.begin(), row.t.end());
        const double mn = row.t.front(), med = row.t[row.t.size() / 2];
        std::printf("%-16s min %7.3f ms  median %7.3f ms  %6.1f GB/s at the min (%.1f MB)\n", row.name.c_str(),
                    mn * 1e3, med * 1e3, weights * row.bytes_per_weight / mn / 1e9,
                    weights * row.bytes_per_weight / 1e6);
    }
    return 0;
}
