// Golden check of the decode-weight block formats against llama.cpp's (tests/golden/text/ggml_quants/README.md): the
// q8_0 and q4_0 blocks kernels/gemv.h makes from the case's inputs must be ggml's reference quantizers' bytes.
#include "cache/io/error.h"
#include "cache/io/safetensors.h"
#include "kernels/gemv.h"
#include "tests/golden_runner/runner.h"

#include <cstring>

namespace anchor::golden {
namespace {

std::string ggml_case_shape(const torch::Tensor& t) {
    return shape_str(t.sizes().vec());
}

bool claims_ggml_quants(const fs::path& dir) {
    return has_file(dir, "quants.safetensors") && has_file(dir, "quants.json");
}

// Byte-exact comparison of one format; a differing block is reported by row and block index.
void check_blocks(Stats& st, const std::string& what, const torch::Tensor& got, const torch::Tensor& want,
                  int64_t block_bytes) {
    if (got.sizes() != want.sizes()) {
        st.fail(what + ": shape " + ggml_case_shape(got) + ", the case has " + ggml_case_shape(want));
        return;
    }
    const auto g = got.contiguous(), w = want.to(torch::kUInt8).contiguous();
    const int64_t rows = g.size(0), nb = g.size(1) / block_bytes;
    int64_t differing = 0;
    std::string first;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < nb; ++b) {
            const auto off = r * g.size(1) + b * block_bytes;
            if (std::memcmp(g.data_ptr<uint8_t>() + off, w.data_ptr<uint8_t>() + off, size_t(block_bytes)) != 0) {
                if (differing++ == 0) first = "row " + std::to_string(r) + " block " + std::to_string(b);
            }
        }
    st.check_true(what + " blocks equal ggml's", differing == 0,
                  std::to_string(differing) + " of " + std::to_string(rows * nb) + " blocks differ, first " + first);
}

std::vector<CaseResult> run_ggml_quants(const fs::path& dir, const Context& ctx) {
    return {guarded(relative_name(dir, ctx), [&](Stats& st) {
        auto f = SafeTensorsFile::open((dir / "quants.safetensors").string());
        const auto x = f->tensor("x").to(torch::kFloat32).contiguous();
        if (x.dim() != 2) throw Error("quants.safetensors: x must be [rows, cols], got " + ggml_case_shape(x));
        check_blocks(st, "q8_0", kernels::quantize_q8_0(x), f->tensor("q8_0"),
                     int64_t(sizeof(kernels::BlockQ8_0)));
        check_blocks(st, "q4_0", kernels::quantize_q4_0(x), f->tensor("q4_0"),
                     int64_t(sizeof(kernels::BlockQ4_0)));
    })};
}

const bool registered_ggml_quants = register_checker({"ggml-quants", claims_ggml_quants, run_ggml_quants});

} // namespace
} // namespace anchor::golden
