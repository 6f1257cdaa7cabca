// DiffuGPT / LLaDA / Dream (text/diffusion/families): what the goldens (tests/golden/text/dlm) do not cover: the chat
// templates, the options each family refuses, the loaders' errors and the cached decoding's bookkeeping.
#include "cache/io/error.h"
#include "text/diffusion/families/dlm_chat.h"
#include "text/diffusion/families/dlm_model.h"
#include "text/diffusion/families/dlm_sampler.h"
#include "text/params.h"

#include <catch2/catch.hpp>

#include <string>

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

} // namespace anchor::text
