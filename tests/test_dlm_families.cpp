// DiffuGPT / LLaDA / Dream (text/diffusion/families): what the goldens (tests/golden/text/dlm) do not cover: the chat
// templates, the options each family refuses, the loaders' errors and the cached decoding's bookkeeping.
#include "cache/io/error.h"
#include "text/diffusion/families/dlm_chat.h"
#include "text/diffusion/families/dlm_bench.h"
#include "text/diffusion/families/dlm_model.h"
#include "text/diffusion/families/dlm_random.h"
#include "text/diffusion/families/dlm_sampler.h"
#include "text/params.h"

#include <catch2/catch.hpp>

#include <filesystem>
#include <map>
#include <string>

#include <unistd.h>

// The tests live in the namespace instead of importing it: a using-directive at file scope would reach the other
// sources of the same unity batch (anchor::text and anchor::unet both have cache_mode_table).
namespace anchor::text {

namespace {
std::string dlm_case_dir(const std::string& name) {
    return std::string(ANCHOR_SOURCE_DIR) + "/tests/golden/text/dlm/" + name;
}
} // namespace

TEST_CASE("dlm chat templates render one user turn and the assistant header", "[dlm]") {
    CHECK(apply_chat_template(ChatTemplate::Llada, "  Hi there \n") ==
          "<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
          "<|start_header_id|>assistant<|end_header_id|>\n\n");
    CHECK(apply_chat_template(ChatTemplate::ChatMl, "Hi") ==
          "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
          "<|im_start|>assistant\n");
    CHECK(apply_chat_template(ChatTemplate::None, " raw ") == " raw ");
    // Two turns: BOS only before the first (LLaDA); Dream's default system turn only when none is given.
    const std::vector<ChatMessage> conv = {{"user", "a"}, {"assistant", "b "}, {"user", "c"}};
    CHECK(render_chat(ChatTemplate::Llada, conv) ==
          "<|startoftext|><|start_header_id|>user<|end_header_id|>\n\na<|eot_id|><|start_header_id|>assistant"
          "<|end_header_id|>\n\nb<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nc<|eot_id|>"
          "<|start_header_id|>assistant<|end_header_id|>\n\n");
    CHECK(render_chat(ChatTemplate::ChatMl, {{"system", "S"}, {"user", "u"}}) ==
          "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n");
    CHECK(detect_chat_template(dlm_case_dir("llada_tiny")) == ChatTemplate::None);
}

TEST_CASE("dlm families are detected from config.json and tensor names", "[dlm]") {
    CHECK(detect_dlm_family(dlm_case_dir("llada_tiny")) == DlmFamily::Llada);
    CHECK(detect_dlm_family(dlm_case_dir("dream_tiny")) == DlmFamily::Dream);
    CHECK(detect_dlm_family(dlm_case_dir("diffugpt_tiny")) == DlmFamily::DiffuGpt);
    CHECK_FALSE(detect_dlm_family(std::string(ANCHOR_SOURCE_DIR) + "/tests/golden/text/gpt2_tiny").has_value());
}

TEST_CASE("dlm loader names every missing tensor when the family is wrong", "[dlm]") {
    try {
        load_dlm(dlm_case_dir("llada_tiny"), DlmFamily::Dream, 90);
        FAIL("expected an error");
    } catch (const anchor::Error& e) {
        const std::string m = e.what();
        // LLaDA's config.json has none of Qwen2's keys: the first missing one is named before any tensor is read.
        CHECK(m.find("'hidden_size' is missing") != std::string::npos);
    }
    try {
        load_dlm(dlm_case_dir("dream_tiny"), DlmFamily::Llada, 93);
        FAIL("expected an error");
    } catch (const anchor::Error& e) {
        // No file holds LLaDA's model.transformer.* names.
        CHECK(std::string(e.what()).find("LLaDA model folder") != std::string::npos);
    }
}

TEST_CASE("dlm options each family refuses name their field", "[dlm]") {
    auto dream = load_dlm(dlm_case_dir("dream_tiny")).model;
    auto llada = load_dlm(dlm_case_dir("llada_tiny")).model;
    auto field = [](const DlmSampleOptions& o, const DlmConfig& c) {
        try {
            o.validate(c);
        } catch (const ParamError& e) {
            return e.field();
        }
        return std::string();
    };
    DlmSampleOptions o;
    o.gen_length = 16, o.steps = 8;
    CHECK(field(o, dream->config()).empty());
    o.cache = DlmCache::Prefix;
    CHECK(field(o, dream->config()) == "cache");
    CHECK(field(o, llada->config()).empty());
    o.cache = DlmCache::Off;
    o.block_length = 5;
    CHECK(field(o, llada->config()) == "block_length");
    CHECK(field(o, dream->config()) == "block_length");
    o.block_length = 8;
    o.steps = 3;
    CHECK(field(o, llada->config()) == "steps");
    o.steps = 8, o.block_length = 0;
    o.remask = DlmRemask::LowConfidence;
    CHECK(field(o, dream->config()) == "remask");
    CHECK(field(o, llada->config()).empty());
    // alg_temp draws the committed positions of Dream's confidence rules only.
    o.alg_temp = 0.5;
    CHECK(field(o, llada->config()) == "alg_temp");
    o.remask.reset();
    CHECK(field(o, dream->config()).empty());
    o.remask = DlmRemask::Origin;
    CHECK(field(o, dream->config()) == "alg_temp");
    o.remask = DlmRemask::TopkMargin, o.alg_temp = -1.0;
    CHECK(field(o, dream->config()) == "alg_temp");
}

TEST_CASE("dlm LLaDA cached decoding: one step per block is the uncached run; dual computes only the block", "[dlm]") {
    auto llada = load_dlm(dlm_case_dir("llada_tiny")).model;
    auto prompt = torch::tensor(std::vector<int64_t>{1, 7, 8, 9}, torch::kLong).reshape({1, 4});
    auto draws = dlm_seeded_draws(0);
    int64_t off_n = 0, dual_n = 0, prefix_n = 0;
    auto off = llada_sample(*llada, prompt, 2, 16, 8, 0.0, DlmRemask::LowConfidence, draws, DlmCache::Off, false, {},
                            &off_n);
    auto dual = llada_sample(*llada, prompt, 2, 16, 8, 0.0, DlmRemask::LowConfidence, draws, DlmCache::Dual, false, {},
                             &dual_n);
    CHECK(torch::equal(off, dual));
    CHECK(off_n == dual_n);
    llada_sample(*llada, prompt, 8, 16, 8, 0.0, DlmRemask::LowConfidence, draws, DlmCache::Dual, false, {}, &dual_n);
    llada_sample(*llada, prompt, 8, 16, 8, 0.0, DlmRemask::LowConfidence, draws, DlmCache::Prefix, false, {},
                 &prefix_n);
    // 2 blocks x (1 full step of 20 + 3 steps): dual 3 x 8 rows, prefix 3 x (20 - block start) rows.
    CHECK(dual_n == 2 * 20 + 2 * 3 * 8);
    CHECK(prefix_n == 2 * 20 + 3 * 16 + 3 * 8);
}

TEST_CASE("dlm streaming sees every committed block", "[dlm]") {
    auto llada = load_dlm(dlm_case_dir("llada_tiny")).model;
    DlmSampleOptions o;
    o.gen_length = 16, o.block_length = 4, o.steps = 8;
    std::vector<size_t> sizes;
    const auto r = dlm_generate(*llada, {1, 7}, o, dlm_seeded_draws(1),
                                [&](const std::vector<int64_t>& c) { sizes.push_back(c.size()); });
    CHECK(sizes == std::vector<size_t>{4, 8, 12, 16});
    CHECK(r.generated.size() == 16);
}

namespace {
using kernels::QWeightType;
double dlm_rel_err(const torch::Tensor& a, const torch::Tensor& b) {
    return (a - b).abs().max().item<double>() / b.abs().max().item<double>();
}
torch::Tensor dlm_test_ids(int64_t vocab, int64_t mask, int64_t L) {
    auto ids = torch::arange(L, torch::kLong).mul(7).remainder(vocab);
    ids.narrow(0, L / 2, L / 4).fill_(mask);
    return ids.reshape({1, L});
}
} // namespace

// Largest logit error of the default int8 products against the same weights in float32, over the largest logit, on
// the tiny LLaDA / Dream q8_0 GGUFs (measured 0.031 / 0.030; the bound is about 2x).
constexpr double kDlmInt8RelErr = 6e-2;

TEST_CASE("dlm quantised weights: logits within the quantisation error of float32, the GGUF's blocks kept", "[dlm]") {
    for (const char* fam : {"llada_tiny", "dream_tiny"}) {
        CAPTURE(fam);
        auto f32 = load_dlm(dlm_case_dir(fam)).model;
        const auto& c = f32->config();
        auto ids = dlm_test_ids(c.vocab_size, c.mask_token_id, 12);
        auto ref = f32->logits(ids);
        // Converted at load: the error against float32 follows each format's step. Measured on these two models
        // (largest logit error / largest logit): bf16 0.010 / 0.014, f16 0.0012 / 0.0012, q8_0 0.046 / 0.043, q4_0
        // 0.40 / 0.79; the bounds are about 2x those, and q4_0 (step max/8) against q8_0 (max/127) is checked as a
        // ratio: 8.6 / 18.5 measured, ~16 expected for errors proportional to the step.
        std::map<QWeightType, double> err;
        for (auto t : {QWeightType::BF16, QWeightType::F16, QWeightType::Q8_0, QWeightType::Q4_0}) {
            CAPTURE(enum_name(kernels::qweight_type_table(), t));
            auto q = load_dlm(dlm_case_dir(fam), {}, -1, t).model;
            q->set_qgemm(kernels::QGemmArithmetic::F32); // the weights' error alone (int8's is checked below)
            CHECK(q->weight_bytes() < f32->weight_bytes());
            err[t] = dlm_rel_err(q->logits(ids), ref);
        }
        CHECK(err[QWeightType::BF16] < 3e-2);
        CHECK(err[QWeightType::F16] < 3e-3);
        CHECK(err[QWeightType::F16] < err[QWeightType::BF16]);
        CHECK(err[QWeightType::Q8_0] < 1e-1);
        CHECK(err[QWeightType::Q4_0] > 4 * err[QWeightType::Q8_0]);
        CHECK(err[QWeightType::Q4_0] < 40 * err[QWeightType::Q8_0]);
        // The q8_0 GGUF's blocks read from the map give the logits of its dequantised weights in float32.
        const std::string gguf = dlm_case_dir(fam) + "/model-q8_0.gguf";
        auto kept = load_dlm(gguf).model, wide = load_dlm(gguf, {}, -1, QWeightType::F32).model;
        CHECK(kept->weight_bytes() * 2 < wide->weight_bytes()); // ffn_down (48 inputs) is stored f32
        CHECK(kept->qgemm() == kernels::default_qgemm_arithmetic());
        // The default int8 products add the activations' rounding to q8_0 blocks (kernels/qgemm_arith.h).
        const auto int8 = kept->logits(ids), wide_logits = wide->logits(ids);
        kept->set_qgemm(kernels::QGemmArithmetic::F32);
        CHECK(dlm_rel_err(kept->logits(ids), wide_logits) < 1e-5);
        CHECK(dlm_rel_err(kept->logits(ids), ref) < 1e-1);
        CHECK(dlm_rel_err(int8, wide_logits) < kDlmInt8RelErr);
    }
}

TEST_CASE("dlm random-model GGUF: q4_0 and q8_0 files load, match their float32 reading and generate", "[dlm]") {
    const auto dir = std::filesystem::temp_directory_path() / ("anchor_dlm_random_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir);
    for (const char* preset : {"llada-tiny", "dream-tiny"}) {
        for (auto t : {QWeightType::Q4_0, QWeightType::Q8_0}) {
            CAPTURE(preset, enum_name(kernels::qweight_type_table(), t));
            const auto c = dlm_random_preset(preset);
            const std::string path =
                (dir / (std::string(preset) + "-" + enum_name(kernels::qweight_type_table(), t) + ".gguf")).string();
            write_random_dlm_gguf(path, c, t, 7);
            CHECK(!std::filesystem::exists(path + ".tmp"));
            auto kept = load_dlm(path).model, wide = load_dlm(path, {}, -1, QWeightType::F32).model;
            kept->set_qgemm(kernels::QGemmArithmetic::F32); // the float32 reading bit for bit (int8: above)
            CHECK(kept->config().family == c.family);
            CHECK(kept->config().mask_token_id == c.mask_token_id);
            CHECK(kept->config().shift == c.shift);
            auto ids = dlm_test_ids(c.vocab_size, c.mask_token_id, 16);
            CHECK(dlm_rel_err(kept->logits(ids), wide->logits(ids)) < 1e-5);
            kept->set_qgemm(kernels::default_qgemm_arithmetic()); // generation on the default products
            DlmSampleOptions o;
            o.gen_length = 8, o.block_length = c.family == DlmFamily::Llada ? 4 : 0, o.steps = 4, o.stop_at_eos = false;
            o.validate(kept->config());
            const auto r = dlm_generate(*kept, {5, 9, 11}, o, dlm_seeded_draws(2));
            CHECK(r.generated.size() == 8);
            for (auto id : r.generated) CHECK(id != c.mask_token_id);
        }
    }
    // Same seed, same bytes.
    const auto c = dlm_random_preset("llada-tiny");
    write_random_dlm_gguf((dir / "a.gguf").string(), c, QWeightType::Q4_0, 9);
    write_random_dlm_gguf((dir / "b.gguf").string(), c, QWeightType::Q4_0, 9);
    CHECK(std::filesystem::file_size(dir / "a.gguf") == std::filesystem::file_size(dir / "b.gguf"));
    std::filesystem::remove_all(dir);
    CHECK_THROWS_AS(dlm_random_preset("llada-9b"), Error);
}

TEST_CASE("dlm DiffuGPT refuses quantised weights naming the option", "[dlm]") {
    try {
        load_dlm(dlm_case_dir("diffugpt_tiny"), {}, -1, QWeightType::Q8_0);
        FAIL("DiffuGPT accepted q8_0");
    } catch (const Error& e) {
        CHECK(std::string(e.what()).find("--weights-dtype q8_0") != std::string::npos);
    }
}

TEST_CASE("dlm compare and bench: modes side by side, the MDLM caches refused with the reason", "[dlm]") {
    const bool parsed = parse_dlm_cache_list({"off,prefix", "dual"}, "compare") ==
                        std::vector<DlmCache>{DlmCache::Off, DlmCache::Prefix, DlmCache::Dual};
    CHECK(parsed);
    for (const char* bad : {"off,anchor", "dual:window=32", "off;drift=0.9"}) {
        try {
            parse_dlm_cache_list({bad}, "compare");
            FAIL(std::string("accepted ") + bad);
        } catch (const ParamError& e) {
            CHECK(e.field() == "compare");
            CHECK(std::string(e.what()).find("MDLM") != std::string::npos);
        }
    }
    CHECK_THROWS_AS(parse_dlm_cache_list({"off,banana"}, "compare"), ParamError);
    auto llada = load_dlm(dlm_case_dir("llada_tiny")).model;
    DlmSampleOptions o;
    o.gen_length = 16, o.block_length = 8, o.steps = 2; // one step per block: dual is the uncached result
    const auto prompt = dlm_synthetic_prompt(llada->config(), 4);
    REQUIRE(prompt.size() == 4);
    for (auto id : prompt) CHECK(id != llada->config().mask_token_id);
    const auto rep = dlm_bench(*llada, prompt, o, {DlmCache::Off, DlmCache::Dual}, 2, 3);
    REQUIRE(rep.rows.size() == 2);
    CHECK(rep.rows[1].agreement == 1.0);
    CHECK(rep.rows[1].generated == rep.rows[0].generated);
    CHECK(rep.rows[0].seconds.size() == 2);
    CHECK(rep.peak_rss_bytes > 0);
    CHECK(rep.weight_bytes == llada->weight_bytes());
    CHECK(rep.to_json()["rows"][1]["cache"] == "dual");
    // Dream decodes the whole answer at once: a cache mode is refused before anything runs.
    auto dream = load_dlm(dlm_case_dir("dream_tiny")).model;
    DlmSampleOptions od;
    od.gen_length = 8, od.steps = 8;
    CHECK_THROWS_AS(dlm_bench(*dream, {1, 2}, od, {DlmCache::Off, DlmCache::Prefix}, 1, 0), ParamError);
}

} // namespace anchor::text
