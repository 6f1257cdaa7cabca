// A1111 prompt syntax (unet/pipeline/prompt_syntax.h): parse_prompt_attention against the docstring examples of
// AUTOMATIC1111's modules/prompt_parser.py, BREAK and escapes; the 75-token chunking and comma backtracking of
// modules/sd_hijack_clip.py on the bundled CLIP vocabulary; the "Original" emphasis on a hand-computed case; long
// prompts through the pipeline on the golden tiny model; anchor-sd's --prompt-syntax.
#include "cache/bpe.h"
#include "tests/sd_pipeline_golden.h"
#include "tests/test_cli_util.h"
#include "tests/test_util.h"
#include "unet/model/clip_tokenizer.h"
#include "unet/cache/freq_cache.h"
#include "unet/pipeline/prompt_syntax.h"

#include <catch2/catch.hpp>

#include <chrono>
#include <fstream>
#include <numeric>
#include <random>
#include <unordered_map>

using namespace anchor;
using namespace anchor::unet;

namespace {

using Expected = std::vector<std::pair<std::string, double>>;

void check_parse(const std::string& prompt, const Expected& expected) {
    const auto got = parse_prompt_attention(prompt);
    INFO("prompt: " << prompt);
    REQUIRE(got.size() == expected.size());
    for (size_t i = 0; i < got.size(); ++i) {
        INFO("entry " << i << ": '" << got[i].text << "' " << got[i].weight);
        CHECK(got[i].text == expected[i].first);
        CHECK(got[i].weight == Approx(expected[i].second).margin(1e-6));
    }
}

std::string repeat_words(const std::string& word, int n) {
    std::string s;
    for (int i = 0; i < n; ++i) s += (i ? " " : "") + word;
    return s;
}

// The BPE ids of a chunk between bos and the first eos.
std::vector<int64_t> chunk_body(const PromptChunk& c) {
    std::vector<int64_t> body;
    REQUIRE(c.ids.front() == ClipTokenizer::kBos);
    for (size_t i = 1; i < c.ids.size() && c.ids[i] != ClipTokenizer::kEos; ++i) body.push_back(c.ids[i]);
    return body;
}

struct TinyModels {
    std::filesystem::path dir = test::golden("sd/pipeline_tiny");
    nlohmann::json cfg = sdgolden::read_json_file(dir / "config.json");
    SDModels models = sdgolden::load_run_models(dir, cfg);
};

} // namespace

TEST_CASE("parse_prompt_attention: the examples of A1111's docstring", "[prompt]") {
    check_parse("normal text", {{"normal text", 1.0}});
    check_parse("an (important) word", {{"an ", 1.0}, {"important", 1.1}, {" word", 1.0}});
    check_parse("(unbalanced", {{"unbalanced", 1.1}});
    check_parse("\\(literal\\]", {{"(literal]", 1.0}});
    check_parse("(unnecessary)(parens)", {{"unnecessaryparens", 1.1}});
    check_parse("a (((house:1.3)) [on] a (hill:0.5), sun, (((sky))).", {{"a ", 1.0},
                                                                        {"house", 1.573},
                                                                        {" ", 1.1},
                                                                        {"on", 1.0},
                                                                        {" a ", 1.1},
                                                                        {"hill", 0.55},
                                                                        {", sun, ", 1.1},
                                                                        {"sky", 1.4641},
                                                                        {".", 1.1}});
}

TEST_CASE("parse_prompt_attention: weights, square brackets, empty prompt", "[prompt]") {
    check_parse("", {{"", 1.0}});
    check_parse("[a] b", {{"a", 1 / 1.1}, {" b", 1.0}});
    check_parse("[[a]]", {{"a", 1 / 1.1 / 1.1}});
    check_parse("((a:2))", {{"a", 2.2}});
    check_parse("(a: 1.5 ) b", {{"a", 1.5}, {" b", 1.0}}); // spaces around the number are allowed
    check_parse("(a:-1)", {{"a", -1.0}});
    check_parse("[unbalanced", {{"unbalanced", 1 / 1.1}});
    check_parse("a) b]", {{"a) b]", 1.0}});           // closers without an opener are text
    check_parse("a:b c:1.5)", {{"a:b c:1.5)", 1.0}}); // `:w)` without an open bracket is text
    check_parse("(a:b)", {{"a:b", 1.1}});             // not a number: the colon is text
    // A1111 calls float() on `[.\d]+`: "1.2.3" is no number there either.
    std::string field;
    try {
        parse_prompt_attention("a (b:1.2.3)");
    } catch (const ParamError& e) {
        field = e.field();
        CHECK(std::string(e.what()).find("1.2.3") != std::string::npos);
    }
    CHECK(field == "prompts");
}

TEST_CASE("parse_prompt_attention: escapes", "[prompt]") {
    check_parse("a \\(b\\) \\[c\\] \\\\ d", {{"a (b) [c] \\ d", 1.0}});
    check_parse("(a \\) b)", {{"a ) b", 1.1}});
    check_parse("a\\b", {{"ab", 1.0}}); // a lone backslash is dropped, as A1111's regex does
}

TEST_CASE("parse_prompt_attention: BREAK", "[prompt]") {
    check_parse("a BREAK b", {{"a", 1.0}, {"BREAK", -1.0}, {"b", 1.0}});
    check_parse("a  BREAK\n b, (c)", {{"a", 1.0}, {"BREAK", -1.0}, {"b, ", 1.0}, {"c", 1.1}});
    check_parse("BREAK", {{"", 1.0}, {"BREAK", -1.0}, {"", 1.0}});
    check_parse("(a)BREAK b", {{"a", 1.1}, {"", 1.0}, {"BREAK", -1.0}, {"b", 1.0}});
    // Only the upper-case word on word boundaries.
    check_parse("a break b", {{"a break b", 1.0}});
    check_parse("aBREAK BREAKb BREAK_x", {{"aBREAK BREAKb BREAK_x", 1.0}});
    // Inside brackets A1111 multiplies the break's -1 too: it is then the text "BREAK", not a break.
    const auto in_parens = parse_prompt_attention("(a BREAK b)");
    check_parse("(a BREAK b)", {{"a", 1.1}, {"BREAK", -1.1}, {"b", 1.1}});
    CHECK_FALSE(is_chunk_break(in_parens[1]));
    CHECK(is_chunk_break(parse_prompt_attention("a BREAK b")[1]));
}

TEST_CASE("chunk_prompt: 75-token chunks, BREAK and framing on the CLIP vocabulary", "[prompt]") {
    const auto tok = ClipTokenizer::bundled();
    const int64_t a = tok.token_id("a</w>"), b = tok.token_id("b</w>"), comma = tok.token_id(",</w>");
    REQUIRE(a >= 0);
    REQUIRE(b >= 0);
    REQUIRE(comma >= 0);
    auto chunks_of = [&](const std::string& s, int backtrack = 20) {
        PromptChunkOptions o;
        o.comma_backtrack = backtrack;
        return chunk_prompt(tok, parse_prompt_attention(s), o);
    };

    SECTION("75 tokens fit one chunk, identical to the plain tokenization") {
        const auto c = chunks_of(repeat_words("a", 75));
        REQUIRE(c.chunks.size() == 1);
        CHECK(c.token_count == 75);
        CHECK(c.chunks[0].ids == tok.tokenize(repeat_words("a", 75)).ids);
        CHECK(c.chunks[0].ids.size() == 77);
    }
    SECTION("80 tokens: 75 + 5, each chunk framed and padded") {
        const auto c = chunks_of(repeat_words("a", 80));
        REQUIRE(c.chunks.size() == 2);
        CHECK(c.token_count == 80);
        CHECK(chunk_body(c.chunks[0]).size() == 75);
        CHECK(c.chunks[0].ids.back() == ClipTokenizer::kEos);
        CHECK(chunk_body(c.chunks[1]) == std::vector<int64_t>(5, a));
        CHECK(c.chunks[1].ids.size() == 77);
        CHECK(c.chunks[1].ids[6] == ClipTokenizer::kEos);
        CHECK(c.chunks[1].ids[7] == tok.pad_id());
        for (float w : c.chunks[1].weights) CHECK(w == 1.0f);
    }
    SECTION("the empty prompt is one empty chunk") {
        const auto c = chunks_of("");
        REQUIRE(c.chunks.size() == 1);
        CHECK(c.chunks[0].ids == tok.tokenize("").ids);
        CHECK(c.chunks[0].ids == empty_chunk(tok).ids);
    }
    SECTION("BREAK starts a new chunk; a trailing BREAK adds none") {
        const auto c = chunks_of("a a BREAK b");
        REQUIRE(c.chunks.size() == 2);
        CHECK(chunk_body(c.chunks[0]) == std::vector<int64_t>{a, a});
        CHECK(chunk_body(c.chunks[1]) == std::vector<int64_t>{b});
        CHECK(c.token_count == 75 + 1);
        CHECK(chunks_of("a BREAK").chunks.size() == 1);
        CHECK(chunks_of("BREAK a").chunks.size() == 2); // the leading break leaves an empty first chunk
    }
    SECTION("weights follow the tokens, 1.0 on bos/eos/padding") {
        const auto c = chunks_of("(a) b [b]");
        REQUIRE(c.chunks.size() == 1);
        const auto& w = c.chunks[0].weights;
        CHECK(w[0] == 1.0f);
        CHECK(w[1] == Approx(1.1f));
        CHECK(w[2] == 1.0f);
        CHECK(w[3] == Approx(1 / 1.1f));
        CHECK(w[4] == 1.0f); // eos
        CHECK(w[76] == 1.0f);
    }
    SECTION("comma backtracking: the words after a comma near the end move to the next chunk") {
        // 70 x a, a comma (token 71), 10 x b: the chunk is full after 4 b's; the comma is 5 tokens back (<= 20), so
        // the 4 b's move and the first chunk ends with the comma.
        const std::string s = repeat_words("a", 70) + ", " + repeat_words("b", 10);
        const auto c = chunks_of(s);
        REQUIRE(c.chunks.size() == 2);
        auto first = std::vector<int64_t>(70, a);
        first.push_back(comma);
        CHECK(chunk_body(c.chunks[0]) == first);
        CHECK(chunk_body(c.chunks[1]) == std::vector<int64_t>(10, b));
        // Disabled (A1111's setting 0): a hard cut after 75 tokens.
        const auto hard = chunks_of(s, 0);
        REQUIRE(hard.chunks.size() == 2);
        CHECK(chunk_body(hard.chunks[0]).size() == 75);
        CHECK(chunk_body(hard.chunks[1]) == std::vector<int64_t>(6, b));
    }
    SECTION("no backtracking when the last comma is more than 20 tokens back") {
        // The comma is token 11; at the cut it is 75 - 10 = 65 tokens back.
        const std::string s = repeat_words("a", 10) + ", " + repeat_words("b", 70);
        const auto c = chunks_of(s);
        REQUIRE(c.chunks.size() == 2);
        CHECK(chunk_body(c.chunks[0]).size() == 75);
        CHECK(chunk_body(c.chunks[1]) == std::vector<int64_t>(6, b));
    }
}

TEST_CASE("apply_emphasis: A1111's mean-preserving weighting on a hand-computed case", "[prompt]") {
    // Row 0: z = [[1, 2], [3, 4]], weights [2, 1]. mean0 = 10 / 4 = 2.5; weighted [[2, 4], [3, 4]], mean 13 / 4 = 3.25;
    // times 2.5 / 3.25 = 10 / 13: [[20, 40], [30, 40]] / 13. Row 1: weights all 1, returned as is.
    const auto z = torch::tensor({1.f, 2.f, 3.f, 4.f, 0.1f, 0.2f, 0.3f, 0.7f}).reshape({2, 2, 2});
    const auto w = torch::tensor({2.f, 1.f, 1.f, 1.f}).reshape({2, 2});
    const auto out = apply_emphasis(z, w);
    const auto expected0 = torch::tensor({20.f, 40.f, 30.f, 40.f}).reshape({2, 2}) / 13.f;
    CHECK(torch::allclose(out[0], expected0, 1e-6, 1e-6));
    CHECK(out[0].mean().item<float>() == Approx(2.5f).epsilon(1e-6));
    CHECK(torch::equal(out[1], z[1]));
    // All weights 1: the very tensor.
    const auto ones = torch::ones({2, 2});
    CHECK(apply_emphasis(z, ones).is_same(z));
}

TEST_CASE("A1111 syntax gives plain's embeddings for a plain prompt, no truncation for a long one", "[prompt][sd]") {
    TinyModels t;
    Txt2ImgPipeline pipe(t.models);
    Txt2ImgParams p;
    p.prompts = {"a photo of an astronaut riding a horse on mars", "a cat"};
    p.negative_prompts = {"blurry, low quality"};
    p.prompt_syntax = PromptSyntax::Plain;
    const auto plain = pipe.encode_prompts(p, true, nullptr);
    p.prompt_syntax = PromptSyntax::A1111;
    const auto a1111 = pipe.encode_prompts(p, true, nullptr);
    CHECK(torch::equal(plain, a1111));

    p.prompts = {repeat_words("a", 80)};
    std::vector<std::string> warnings;
    p.prompt_syntax = PromptSyntax::Plain;
    CHECK(pipe.encode_prompts(p, true, &warnings).sizes() == torch::IntArrayRef({2, 77, 32}));
    CHECK(warnings.size() == 1);
    warnings.clear();
    p.prompt_syntax = PromptSyntax::A1111;
    const auto longer = pipe.encode_prompts(p, true, &warnings);
    CHECK(longer.sizes() == torch::IntArrayRef({2, 154, 32}));
    CHECK(warnings.empty());
    // The first chunk is the plain (truncated) encoding: 75 a's between bos and eos in both.
    p.prompt_syntax = PromptSyntax::Plain;
    CHECK(torch::equal(longer.narrow(1, 0, 77), pipe.encode_prompts(p, true, nullptr)));
}

TEST_CASE("A1111 prompt with emphasis, BREAK and ~120 tokens runs on the golden tiny model", "[prompt][sd]") {
    TinyModels t;
    Txt2ImgPipeline pipe(t.models);
    Txt2ImgParams p;
    const std::string long_prompt =
        "a (photo:1.2) of an astronaut riding a [horse] on mars, ((masterpiece)), best quality, highly detailed, "
        "sharp focus, dramatic lighting, red desert, dust storm, distant mountains, BREAK a small robot companion, "
        "shiny metal, blue lights, " +
        repeat_words("stars,", 40) + " (nebula:0.8)";
    p.prompts = {long_prompt, "a cat"};
    p.negative_prompts = {"[blurry], low quality"};
    p.steps = 2;
    p.sampler = SamplerKind::DDIM;
    p.seed = 7;
    p.prompt_syntax = PromptSyntax::A1111;
    const auto chunks = pipe.prompt_chunks({long_prompt});
    INFO("tokens " << chunks[0].token_count);
    CHECK(chunks[0].token_count > 120);
    const int64_t k = int64_t(chunks[0].chunks.size());
    REQUIRE(k >= 3); // BREAK, then more than 75 tokens after it
    const auto r = pipe.run(p);
    CHECK(r.prompt_embeds.sizes() == torch::IntArrayRef({4, 77 * k, 32}));
    CHECK(torch::isfinite(r.prompt_embeds).all().item<bool>());
    CHECK(torch::isfinite(r.image).all().item<bool>());
    CHECK(r.image.sizes() == torch::IntArrayRef({2, 3, 16, 16}));
    CHECK(r.warnings.empty());
    // "a cat" (row 3) and the negative prompt (rows 0-1) are padded with the encoding of the empty chunk.
    const auto pad = pipe.encode_prompts(
        [&] {
            Txt2ImgParams e;
            e.prompts = {""};
            return e;
        }(),
        false, nullptr);
    for (int64_t c = 1; c < k; ++c) {
        CHECK(torch::allclose(r.prompt_embeds[3].narrow(0, 77 * c, 77), pad[0], 1e-5, 1e-5));
        CHECK(torch::allclose(r.prompt_embeds[0].narrow(0, 77 * c, 77), pad[0], 1e-5, 1e-5));
    }
    // The long prompt's first chunk: its own encoding, weighted by apply_emphasis (mean kept, values changed).
    torch::NoGradGuard ng;
    const auto& c0 = chunks[0].chunks[0];
    const auto z = t.models.text_encoder->encode(torch::tensor(c0.ids, torch::kLong).unsqueeze(0), 0);
    const auto weighted = apply_emphasis(z, torch::tensor(c0.weights, torch::kFloat).unsqueeze(0));
    CHECK(torch::allclose(r.prompt_embeds[2].narrow(0, 0, 77), weighted[0], 1e-5, 1e-5));
    CHECK(weighted.mean().item<double>() == Approx(z.mean().item<double>()).epsilon(1e-5));
    CHECK_FALSE(torch::allclose(weighted, z));
}

TEST_CASE("anchor-sd --prompt-syntax: a1111 runs a long prompt and is recorded; a bogus value exits 2",
          "[prompt][cli]") {
    const auto dir = test::scratch_dir("cli_prompt_syntax");
    const std::string png = dir + "/a.png";
    auto r =
        test::run_program(test::sd_bin(), {"-m", "assets/models/sd15-tiny-random", "-p",
                                           "a (cat:1.3) BREAK [dog], " + repeat_words("grass,", 50), "--prompt-syntax",
                                           "a1111", "--steps", "2", "-o", png, "--threads", "1"});
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    std::ifstream f(png + ".json");
    const auto j = nlohmann::json::parse(f);
    CHECK(j.at("prompt_syntax") == "a1111");
    CHECK(j.at("warnings").empty());

    r = test::run_program(test::sd_bin(), {"-m", "assets/models/sd15-tiny-random", "-p", "a", "--prompt-syntax",
                                           "bogus", "-o", dir + "/b.png", "--threads", "1"});
    INFO(r.output);
    CHECK(r.exit_code == 2);
    for (const char* s : {"--prompt-syntax", "bogus", "a1111", "plain"}) CHECK(r.output.find(s) != std::string::npos);
    CHECK_FALSE(std::filesystem::exists(dir + "/b.png"));

    r = test::run_program(test::sd_bin(), {"-m", "assets/models/sd15-tiny-random", "-p", "a (b:1.2.3)", "-o",
                                           dir + "/c.png", "--threads", "1"});
    INFO(r.output);
    CHECK(r.exit_code == 2);
    for (const char* s : {"--prompt", "1.2.3"}) CHECK(r.output.find(s) != std::string::npos);
}

TEST_CASE("The UNet caches take the longer A1111 context", "[prompt][sd][deepcache]") {
    TinyModels t;
    Txt2ImgPipeline pipe(t.models);
    Txt2ImgParams p;
    p.prompts = {"a (red:1.3) cat BREAK [blurry] background, " + repeat_words("grass,", 50)};
    p.steps = 4;
    p.sampler = SamplerKind::DDIM;
    const auto plain_run = pipe.run(p);
    REQUIRE(plain_run.prompt_embeds.size(1) == 3 * 77);
    // DeepCache interval 1 runs the full UNet every step: the uncached run's latents, bit for bit.
    DeepCacheDenoiser every_step(1, 0);
    CHECK(torch::equal(pipe.run(p, &every_step).final_latents, plain_run.final_latents));
    DeepCacheDenoiser interval2(2, 0);
    const auto cached = pipe.run(p, &interval2);
    CHECK(cached.full_steps == 2);
    CHECK(torch::isfinite(cached.image).all().item<bool>());
    auto freq = parse_cache_mode("freq");
    const auto f = pipe.run(p, freq.get());
    CHECK(f.full_steps >= 1);
    CHECK(torch::isfinite(f.image).all().item<bool>());
}

// ---- issue 56: bounded, linear-time prompt reading ------------------------------------------------------------------

TEST_CASE("bpe_merge_heap gives the reference merge loop's symbols on random words and merge tables", "[prompt]") {
    std::mt19937 rng(56);
    for (int table = 0; table < 40; ++table) {
        // Symbols over a small alphabet so merges apply often; some tables grow like trained BPE (a merge's parts
        // exist before it), others list pairs in any order (the heap must still match the loop).
        std::vector<std::string> symbols = {"a", "b", "c", "d"};
        std::unordered_map<std::string, int> ranks;
        std::vector<int> order(60);
        std::iota(order.begin(), order.end(), 0);
        if (table % 2) std::shuffle(order.begin(), order.end(), rng);
        for (int r = 0; r < 60; ++r) {
            const auto& l = symbols[rng() % symbols.size()];
            const auto& rr = symbols[rng() % symbols.size()];
            if (ranks.emplace(l + " " + rr, order[size_t(r)]).second) symbols.push_back(l + rr);
        }
        for (int w = 0; w < 25; ++w) {
            std::vector<std::string> word;
            const size_t n = 1 + rng() % 300;
            for (size_t i = 0; i < n; ++i) word.push_back(std::string(1, char('a' + rng() % 4)));
            auto reference = word, heap = word;
            bpe_merge(reference, ranks);
            bpe_merge_heap(heap, ranks);
            INFO("table " << table << ", word of " << n);
            REQUIRE(heap == reference);
        }
    }
}

TEST_CASE("CLIP tokenizing is linear in the prompt: 60 KB of words or one 60 KB word in well under a second",
          "[prompt]") {
    const auto tok = ClipTokenizer::bundled();
    std::string words;
    while (words.size() < 60000) words += "a red shirt, ";
    const std::string word(60000, 'q');
    for (const std::string* text : {static_cast<const std::string*>(&words), &word}) {
        const auto t0 = std::chrono::steady_clock::now();
        const auto ids = tok.encode(*text);
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        INFO(text->substr(0, 12) << "...: " << ids.size() << " tokens in " << s << " s");
        CHECK(ids.size() > 1000);
        CHECK(s < 1.0);
    }
    // Text that is not valid UTF-8 (a lone surrogate, a code point past U+10FFFF) is read as U+FFFD, not cut short:
    // the words after it are still tokenized.
    const auto after = tok.encode("red");
    for (const std::string bad : {"\xed\xa0\x80 red", "\xf4\x90\x80\x80 red"}) {
        const auto ids = tok.encode(bad);
        REQUIRE(ids.size() >= after.size());
        CHECK(std::vector<int64_t>(ids.end() - long(after.size()), ids.end()) == after);
    }
}

TEST_CASE("A1111 prompts are bounded before tokenizing: bytes, bracket depth, CLIP tokens", "[prompt]") {
    const auto tok = ClipTokenizer::bundled();
    CHECK_THROWS_WITH(parse_prompt_attention(std::string(kMaxPromptBytes + 1, 'a')),
                      Catch::Contains("bytes") && Catch::Contains(std::to_string(kMaxPromptBytes)));
    CHECK_NOTHROW(parse_prompt_attention(std::string(kMaxPromptNesting, '(') + "a"));
    CHECK_THROWS_WITH(parse_prompt_attention(std::string(kMaxPromptNesting + 1, '[') + "a"), Catch::Contains("nested"));
    const std::vector<std::string> huge = {std::string(70000, 'a')};
    CHECK_THROWS_WITH(check_prompt_syntax(PromptSyntax::Plain, {&huge}), Catch::Contains("bytes"));
    std::string long_prompt;
    for (int i = 0; i < kMaxPromptTokens / 2 + 1; ++i) long_prompt += "red, ";
    try {
        (void)chunk_prompt(tok, parse_prompt_attention(long_prompt));
        FAIL("no error past the token bound");
    } catch (const ParamError& e) {
        CHECK(e.field() == "prompts");
        CHECK(std::string(e.what()).find(std::to_string(kMaxPromptTokens) + " CLIP tokens") != std::string::npos);
    }
    // The bound itself still reads, and the cancellation point runs once per fragment.
    std::string at_bound;
    for (int i = 0; i < kMaxPromptTokens / 2 - 1; ++i) at_bound += "red, ";
    PromptChunkOptions o;
    int checks = 0;
    o.check = [&] { ++checks; };
    CHECK(chunk_prompt(tok, parse_prompt_attention("(" + at_bound + ") plain"), o).chunks.size() >= 20);
    CHECK(checks == 2);
    o.check = [] { throw Error("cancelled"); };
    CHECK_THROWS_WITH(chunk_prompt(tok, parse_prompt_attention("a"), o), "cancelled");
}
