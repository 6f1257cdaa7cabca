// GPT-2 tokenizer, model, KV cache and streaming against tests/golden/text (README there gives the semantics).
#include "tests/test_util.h"
#include "text/gpt2_tokenizer.h"

#include "cache/io/error.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <fstream>
#include <sstream>

using namespace anchor;
using namespace anchor::text;

namespace {

std::string slurp(const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    std::ostringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

std::string from_hex(const std::string& h) {
    std::string out;
    for (size_t i = 0; i + 1 < h.size(); i += 2) out += static_cast<char>(std::stoi(h.substr(i, 2), nullptr, 16));
    return out;
}

const Gpt2Tokenizer& tokenizer() {
    static Gpt2Tokenizer tok = Gpt2Tokenizer::from_dir(test::golden("text/vocab/gpt2"));
    return tok;
}

} // namespace

TEST_CASE("GPT-2 tokenizer matches every golden case", "[gpt2][tokenizer]") {
    auto j = nlohmann::json::parse(slurp(test::golden("text/tokenizer_cases.json")));
    const auto& tok = tokenizer();
    REQUIRE(tok.vocab_size() == 50257);
    REQUIRE(tok.n_merges() == 50000);
    int failures = 0;
    for (const auto& c : j["cases"]) {
        const std::string text = from_hex(c["utf8_hex"].get<std::string>());
        auto pre = tok.pretokenize(text);
        auto ids = tok.encode(text);
        auto want_pre = c["pretokens"].get<std::vector<std::string>>();
        auto want_ids = c["ids"].get<std::vector<int64_t>>();
        const std::string dec = tok.decode(ids);
        const std::string want_dec = c["decoded"].get<std::string>();
        bool ok = pre == want_pre && ids == want_ids && dec == want_dec;
        if (!ok) {
            ++failures;
            UNSCOPED_INFO("case " << c["id"].get<std::string>() << " pre_ok=" << (pre == want_pre)
                                  << " ids_ok=" << (ids == want_ids) << " dec_ok=" << (dec == want_dec));
        }
    }
    for (const auto& c : j["decode_cases"]) {
        const std::string dec = tok.decode(c["ids"].get<std::vector<int64_t>>());
        const std::string want = from_hex(c["decoded_utf8_hex"].get<std::string>());
        if (dec != want) {
            ++failures;
            UNSCOPED_INFO("decode case " << c["id"].get<std::string>());
        }
    }
    CHECK(failures == 0);
}

TEST_CASE("GPT-2 tokenizer special token, invalid UTF-8 and streaming decode", "[gpt2][tokenizer]") {
    const auto& tok = tokenizer();
    CHECK(tok.encode("<|endoftext|>") == std::vector<int64_t>{27, 91, 437, 1659, 5239, 91, 29});
    CHECK(tok.encode("a<|endoftext|>b", true) ==
          std::vector<int64_t>{tok.encode("a")[0], Gpt2Tokenizer::kEndOfText, tok.encode("b")[0]});
    CHECK(tok.decode({Gpt2Tokenizer::kEndOfText}) == "<|endoftext|>");
    CHECK_THROWS_AS(tok.encode(std::string("ab\xC3", 3)), anchor::Error);
    CHECK_THROWS_AS(tok.encode(std::string("\xED\xA0\x80")), anchor::Error);
    CHECK_THROWS_AS(tok.decode({50257}), anchor::Error);
    // A 4-byte emoji split over tokens prints only once complete.
    Utf8StreamDecoder sd;
    CHECK(sd.push("a\xF0\x9F") == "a");
    CHECK(sd.push("\x98") == "");
    CHECK(sd.push("\x80!") == "\xF0\x9F\x98\x80!");
    CHECK(sd.push("\xF0\x9F") == "");
    CHECK(sd.flush() == "\xEF\xBF\xBD");
    CHECK(utf8_decode_replace("\xC0\xAF") == "\xEF\xBF\xBD\xEF\xBF\xBD");
    CHECK(utf8_decode_replace("\xF0\x9F\x98") == "\xEF\xBF\xBD");
}

TEST_CASE("GPT-2 tokenizer re-encodes the KJV evaluation text exactly", "[gpt2][tokenizer][slow]") {
    const std::string text = slurp(test::golden("text/eval/kjv_text.txt"));
    const std::string raw = slurp(test::golden("text/eval/kjv_tokens.bin"));
    REQUIRE(raw.size() == 400000);
    std::vector<int64_t> want(raw.size() / 2);
    for (size_t i = 0; i < want.size(); ++i)
        want[i] = static_cast<unsigned char>(raw[2 * i]) | (static_cast<unsigned char>(raw[2 * i + 1]) << 8);
    auto ids = tokenizer().encode(text);
    REQUIRE(ids.size() == want.size());
    size_t mismatches = 0;
    for (size_t i = 0; i < ids.size(); ++i) mismatches += ids[i] != want[i];
    CHECK(mismatches == 0);
    CHECK(tokenizer().decode(ids) == text);
}
