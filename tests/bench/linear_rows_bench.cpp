// Linear layers over a few rows, the product of a cached diffusion step: LibTorch (OpenBLAS), oneDNN's matmul and
// kernels::few_rows_linear (and its AVX2 path on an AVX-512 CPU), interleaved, on the weights of a transformer stack
// (qkv, out, up, down per layer) that do not fit in cache. Prints min / median / max ms per stack pass for each row
// count.
//
//   OMP_NUM_THREADS=1 ./build/tests/linear_rows_bench [width=384] [layers=8] [repeats=9] [rows=1,2,4,8,...]
#include "kernels/gemv.h"
#include "kernels/onednn.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

namespace {
double seconds() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
std::string stats(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    char buf[64];
    std::snprintf(buf, sizeof buf, "%6.2f / %6.2f / %6.2f", v.front() * 1e3, v[v.size() / 2] * 1e3, v.back() * 1e3);
    return buf;
}
} // namespace

int main(int argc, char** argv) {
    using namespace anchor::kernels;
    torch::NoGradGuard ng;
    const int64_t width = argc > 1 ? std::stoll(argv[1]) : 384, layers = argc > 2 ? std::stoll(argv[2]) : 8;
    const int repeats = argc > 3 ? std::stoi(argv[3]) : 9;
    std::vector<int64_t> counts{1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64};
    if (argc > 4) {
        counts.clear();
        std::stringstream ss(argv[4]);
        for (std::string item; std::getline(ss, item, ',');) counts.push_back(std::stoll(item));
    }
    torch::manual_seed(0);
    std::vector<torch::Tensor> w, b;
    for (int64_t l = 0; l < layers; ++l)
        for (auto [out, in] : {std::pair{3 * width, width}, {width, width}, {4 * width, width}, {width, 4 * width}}) {
            w.push_back(torch::randn({out, in}));
            b.push_back(torch::randn({out}));
        }
    const bool dnn = onednn_available();
    std::printf("# %lld layers x width %lld (%.1f MB of float32 weights), threads %d, %s, %s\n", (long long)layers,
                (long long)width, 12.0 * width * width * layers * 4 / 1e6, torch::get_num_threads(), gemv_isa().c_str(),
                dnn ? onednn_description().c_str() : "no oneDNN");
    std::printf("rows | torch ms (min / med / max) | onednn ms | few-rows ms | torch / few | onednn / few | "
                "few-rows on AVX2 ms | torch / AVX2 few\n");
    for (int64_t n : counts) {
        std::vector<torch::Tensor> x;
        for (auto& wi : w) x.push_back(torch::randn({1, n, wi.size(1)}));
        std::vector<double> t[4];
        for (int r = 0; r < repeats + 1; ++r)
            for (int m = 0; m < 4; ++m) {
                if (m == 1 && !dnn) continue;
                if (m >= 2 && !few_rows_linear_applies(x[0], w[0], n)) continue;
                if (m == 3 && !gemv_uses_avx512()) continue; // the AVX2 path is the best one there
                const double t0 = seconds();
                for (size_t i = 0; i < w.size(); ++i) {
                    if (m == 0) torch::nn::functional::linear(x[i], w[i], b[i]);
                    if (m == 1) onednn_linear(x[i], w[i], b[i], false);
                    if (m == 2) few_rows_linear(x[i], w[i], b[i]);
                    if (m == 3) few_rows_linear(x[i], w[i], b[i], SimdPath::Avx2);
                }
                if (r > 0) t[m].push_back(seconds() - t0); // the first pass warms up
            }
        auto med = [](std::vector<double> v) {
            std::sort(v.begin(), v.end());
            return v.empty() ? 0.0 : v[v.size() / 2];
        };
        auto ratio = [&](int a, int b) { return t[a].empty() || t[b].empty() ? 0.0 : med(t[a]) / med(t[b]); };
        auto cell = [&](int m) { return t[m].empty() ? std::string("-") : stats(t[m]); };
        std::printf("%4lld | %s | %s | %s | %5.2fx | %5.2fx | %s | %5.2fx\n", (long long)n, cell(0).c_str(),
                    cell(1).c_str(), cell(2).c_str(), ratio(0, 2), ratio(1, 2), cell(3).c_str(), ratio(0, 3));
    }
}
