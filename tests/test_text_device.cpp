// The text models off CPU float32 (`anchor-text ... --device / --dtype`, text::Placement): bfloat16 on the CPU against
// the float32 reference (GPT-2 logits, the sink-rolling KV ring over a stream, the MDLM denoiser with and without its
// cross-step cache), the refusals (f16 on the CPU, decode copies or oneDNN off CPU float32, --device cuda without
// CUDA), and, tagged [cuda], the same models on a GPU against the CPU (skipped without one).
#include "tests/mdlm_tiny_config.h"
#include "tests/test_cli_util.h"
#include "tests/test_util.h"
#include "text/gpt2/gpt2_model.h"
#include "text/diffusion/mdlm_cache.h"
#include "text/diffusion/mdlm_model.h"
#include "text/params.h"

#include <catch2/catch.hpp>

#include <torch/torch.h>
#include <torch/version.h>

#include <string>
#include <vector>

using namespace anchor;
using namespace anchor::text;

namespace {

LoadedGpt2 tiny_gpt2(const Placement& p) {
    auto m = load_gpt2(test::golden("text/gpt2_tiny"));
    m.model->place(p);
    return m;
}

std::vector<int64_t> stream_tokens(int64_t n, int64_t vocab) {
    std::vector<int64_t> ids(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) ids[size_t(i)] = (i * 7919 + 13) % vocab;
    return ids;
}

// Next-token logits [n, V] of a sink:2,6 stream (ring wrap-around included) fed one token at a time.
torch::Tensor stream_logits(Gpt2Model model, const std::vector<int64_t>& ids) {
    Gpt2Stream s(model, KvSpec::parse("sink:2,6"), PositionMode::Wrap);
    std::vector<torch::Tensor> out;
    for (auto id : ids) out.push_back(s.feed(id));
    return torch::stack(out);
}

MdlmModel tiny_mdlm(const Placement& p) {
    MdlmModel m(test::tiny_mdlm_config());
    randomize_mdlm_weights(m, 5);
    m->eval();
    m->place(p);
    return m;
}

// Denoiser logits of three steps over a fixed partly decoded sequence (the cached modes reuse rows from step 1 on).
torch::Tensor denoiser_logits(MdlmModel m, const std::string& cache) {
    MdlmDenoiser den(m, parse_cache_spec(cache));
    const int64_t L = 24;
    auto ids = torch::randint(0, 50000, {L}, at::detail::createCPUGenerator(3), torch::kInt64);
    for (int64_t i = L / 2; i < L; i += 2) ids[i] = m->internal_mask_id();
    const auto positions = torch::arange(L / 2, L, torch::kInt64);
    std::vector<torch::Tensor> out;
    for (int64_t step = 0; step < 3; ++step) {
        auto l = den.logits(ids, 1.0 - 0.2 * double(step), step, positions);
        REQUIRE(l.device().is_cpu());
        REQUIRE(l.scalar_type() == torch::kFloat32);
        out.push_back(l.masked_fill(torch::isinf(l), 0.0)); // the [MASK] column is -inf in both
    }
    return torch::stack(out);
}

} // namespace

TEST_CASE("Placement: f16 on the CPU and other dtypes are refused naming dtype", "[text][device]") {
    Placement p;
    CHECK_NOTHROW(p.validate());
    CHECK(p.reference());
    CHECK(p.str() == "cpu f32");
    p.dtype = torch::kBFloat16;
    CHECK_NOTHROW(p.validate());
    CHECK(!p.reference());
    p.dtype = torch::kHalf;
    CHECK(test::error_of([&] { p.validate(); }).find("dtype: f16 is not available on the CPU") != std::string::npos);
    p.dtype = torch::kDouble;
    CHECK(test::error_of([&] { p.validate(); }).find("dtype: must be f32, f16 or bf16") != std::string::npos);
}

// bfloat16 keeps 8 bits of mantissa: every product and norm rounds at ~4e-3 relative, and over the tiny GPT-2's and
// MDLM's layers the logits move by a few percent of their largest value (the stream's ring, written and read in
// bf16, the most); the bound is 10 % of the largest float32 logit, which a wrong placement (a missed cast, a stale
// ring slot) exceeds many times over.
constexpr double kBf16LogitBound = 0.10;

TEST_CASE("GPT-2 in bf16 on the CPU: logits and a sink-rolling KV stream close to float32", "[gpt2][device]") {
    Placement bf16;
    bf16.dtype = torch::kBFloat16;
    auto ref = tiny_gpt2({}), low = tiny_gpt2(bf16);
    REQUIRE(low.model->wte->weight.scalar_type() == torch::kBFloat16);
    const auto ids = stream_tokens(12, ref.config.vocab_size);
    const auto x = torch::tensor(ids, torch::kLong).unsqueeze(0);
    const auto a = ref.model->forward(x).logits, b = low.model->forward(x).logits;
    CHECK(b.scalar_type() == torch::kFloat32); // logits leave in float32
    CHECK(test::rel_err(b, a) < kBf16LogitBound);
    // The ring in the model's dtype, written and read through every wrap of a sink:2,6 buffer.
    auto caches = low.model->make_caches(2, 6, true);
    CHECK(caches[0].k_storage().scalar_type() == torch::kBFloat16);
    const auto sa = stream_logits(ref.model, ids), sb = stream_logits(low.model, ids);
    CHECK(test::rel_err(sb, sa) < kBf16LogitBound);
    // The float32 reference itself is untouched by the other model's placement.
    CHECK(ref.model->placement().reference());
}

TEST_CASE("GPT-2 decode copies are CPU float32 only", "[gpt2][device]") {
    Placement bf16;
    bf16.dtype = torch::kBFloat16;
    auto m = tiny_gpt2(bf16);
    CHECK(test::error_of([&] { m.model->set_decode_weights(DecodeWeights::F16); }).find("decode_weights") == 0);
    auto r = tiny_gpt2({});
    r.model->set_decode_weights(DecodeWeights::Q8_0);
    CHECK(test::error_of([&] { r.model->place(bf16); }).find("decode_weights") == 0);
}

TEST_CASE("MDLM in bf16 on the CPU: denoiser logits close to float32, dense and cached", "[mdlm][device]") {
    Placement bf16;
    bf16.dtype = torch::kBFloat16;
    auto ref = tiny_mdlm({}), low = tiny_mdlm(bf16);
    for (const std::string cache : {"off", "dual", "anchor"}) {
        INFO(cache);
        CHECK(test::rel_err(denoiser_logits(low, cache), denoiser_logits(ref, cache)) < kBf16LogitBound);
    }
    // oneDNN's backends read CPU float32.
    CHECK(test::error_of([&] { low->set_gemm_backend(kernels::GemmBackend::OneDnn); }).find("gemm") == 0);
}

TEST_CASE("anchor-text --device cuda without a usable GPU and --dtype f16 on the CPU are usage errors",
          "[cli][errors][device]") {
    const std::string refusal =
#if defined(ANCHOR_WITH_CUDA)
        "sees no CUDA device";
#else
        "this build has no CUDA";
#endif
    if (!torch::cuda::is_available()) {
        for (const auto& args : std::vector<std::vector<std::string>>{
                 {"gpt2", "generate", "-p", "a", "--max-new", "2", "--device", "cuda"},
                 {"gpt2", "ppl", "--file", "README.md", "--device", "cuda:0"},
                 {"gpt2", "bench", "--device", "cuda"},
                 {"diffusion", "generate", "-p", "a", "--device", "cuda"},
                 {"diffusion", "bench", "--device", "cuda"},
                 {"serve", "--device", "cuda", "--port", "0"}}) {
            const auto r = test::run_program(test::text_bin(), args);
            INFO(r.output);
            CHECK(r.exit_code == 2);
            CHECK(r.output.find("error: --device") != std::string::npos);
            CHECK(r.output.find(refusal) != std::string::npos);
        }
    } else {
        WARN("a GPU is present: the --device cuda refusal is not exercised here");
    }
    auto r = test::run_program(test::text_bin(), {"gpt2", "generate", "-p", "a", "--max-new", "2", "--dtype", "f16"});
    INFO(r.output);
    CHECK(r.exit_code == 2);
    CHECK(r.output.find("--dtype f16 is not available on the CPU") != std::string::npos);
    r = test::run_program(test::text_bin(), {"gpt2", "generate", "-p", "a", "--max-new", "2", "--dtype", "bf16", "-s", "1",
                                       "--temperature", "0"});
    CHECK(r.exit_code == 0);
    r = test::run_program(test::text_bin(), {"gpt2", "generate", "-p", "a", "--dtype", "bf16", "--decode-weights", "f16"});
    CHECK(r.exit_code == 2);
    CHECK(r.output.find("--decode-weights") != std::string::npos);
    r = test::run_program(test::text_bin(), {"gpt2", "generate", "-p", "a", "--cuda-graphs"});
    CHECK(r.exit_code == 2);
    CHECK(r.output.find("error: --cuda-graphs: needs --device cuda") != std::string::npos);
}

TEST_CASE("GPT-2 decode graph: only for a model and batch-1 caches on a CUDA device", "[gpt2][device]") {
    auto m = tiny_gpt2({});
    const auto caches = m.model->make_caches(2, 6, true);
    CHECK_FALSE(Gpt2DecodeGraph::applies(*m.model, caches));
    CHECK(test::error_of([&] { Gpt2DecodeGraph g(m.model, caches); }).find("needs the model and batch-1 KV caches") !=
          std::string::npos);
    // The switch alone changes nothing on the CPU: the eager step runs.
    const auto ids = stream_tokens(10, m.config.vocab_size);
    const auto eager = stream_logits(m.model, ids);
    set_decode_cuda_graphs(true);
    const auto again = stream_logits(m.model, ids);
    set_decode_cuda_graphs(false);
    CHECK(torch::equal(eager, again));
}

// ---- on a GPU ---------------------------------------------------------------------------------------------------

namespace {
bool gpu_or_skip() {
    if (torch::cuda::is_available()) return true;
    WARN("skipped: CUDA device absent (torch::cuda::is_available() = 0)");
    return false;
}
} // namespace

TEST_CASE("GPT-2 on CUDA: logits and the KV-ring stream match the CPU (f32, f16, bf16)", "[gpt2][cuda]") {
    if (!gpu_or_skip()) return;
    auto ref = tiny_gpt2({});
    const auto ids = stream_tokens(12, ref.config.vocab_size);
    const auto x = torch::tensor(ids, torch::kLong).unsqueeze(0);
    const auto a = ref.model->forward(x).logits, sa = stream_logits(ref.model, ids);
    for (const auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16}) {
        INFO(c10::toString(dtype));
        Placement p;
        p.device = torch::Device(torch::kCUDA, 0);
        p.dtype = dtype;
        auto g = tiny_gpt2(p);
        const double bound = dtype == torch::kFloat ? 1e-4 : kBf16LogitBound;
        const auto b = g.model->forward(x).logits;
        CHECK(b.is_cuda());
        CHECK(test::rel_err(b, a) < bound);
        auto caches = g.model->make_caches(2, 6, true);
        CHECK(caches[0].k_storage().is_cuda());
        CHECK(test::rel_err(stream_logits(g.model, ids), sa) < bound);
    }
}

TEST_CASE("MDLM on CUDA: denoiser logits match the CPU, dense and cached (f32, f16)", "[mdlm][cuda]") {
    if (!gpu_or_skip()) return;
    auto ref = tiny_mdlm({});
    for (const auto dtype : {torch::kFloat, torch::kHalf}) {
        Placement p;
        p.device = torch::Device(torch::kCUDA, 0);
        p.dtype = dtype;
        auto m = tiny_mdlm(p);
        for (const std::string cache : {"off", "dual", "anchor"}) {
            INFO(cache << " " << c10::toString(dtype));
            CHECK(test::rel_err(denoiser_logits(m, cache), denoiser_logits(ref, cache)) <
                  (dtype == torch::kFloat ? 1e-4 : kBf16LogitBound));
        }
    }
}

TEST_CASE("GPT-2 decode as a CUDA graph: replay matches the eager step through the ring's wrap", "[gpt2][cuda]") {
    if (!gpu_or_skip()) return;
    if (!kernels::CudaGraph::available()) {
        WARN("skipped: CUDA graphs need LibTorch >= 2 (this is " TORCH_VERSION ")");
        return;
    }
    for (const auto dtype : {torch::kFloat, torch::kHalf}) {
        INFO(c10::toString(dtype));
        Placement p;
        p.device = torch::Device(torch::kCUDA, 0);
        p.dtype = dtype;
        auto g = tiny_gpt2(p);
        const auto ids = stream_tokens(20, g.config.vocab_size); // sink:2,6 wraps twice
        set_decode_cuda_graphs(false);
        const auto eager = stream_logits(g.model, ids);
        set_decode_cuda_graphs(true);
        const auto replay = stream_logits(g.model, ids);
        set_decode_cuda_graphs(false);
        CHECK(test::rel_err(replay, eager) < (dtype == torch::kFloat ? 1e-5 : 1e-2));
    }
}

TEST_CASE("SinkRollingKV::advance keeps append's bookkeeping and writes nothing", "[kv][device]") {
    cache::SinkRollingKVOptions o;
    o.heads = 2, o.head_dim = 3, o.sinks = 2, o.window = 3;
    cache::SinkRollingKV a(o), b(o);
    for (int64_t i = 0; i < 11; ++i) {
        const auto slot = a.append(torch::ones({1, 2, 1, 3}), torch::ones({1, 2, 1, 3}), std::vector<int64_t>{i % 4})[0];
        CHECK(b.advance(i % 4) == slot);
        CHECK(b.filled() == a.filled());
        CHECK(b.count() == a.count());
        CHECK(b.stream_indices() == a.stream_indices());
        CHECK(b.position(slot) == a.position(slot));
    }
    CHECK(b.k_storage().abs().sum().item<double>() == 0.0);
}
