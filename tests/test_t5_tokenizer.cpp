// T5's tokenizer edges beyond the golden ids (tests/golden/sd/t5_tiny): truncation keeps </s>, padding, and broken
// or missing model files named in the error.
#include "cache/io/error.h"
#include "tests/test_util.h"
#include "unet/model/sentencepiece.h"
#include "unet/model/t5_tokenizer.h"

#include <catch2/catch.hpp>

using namespace anchor;
using namespace anchor::unet;

TEST_CASE("T5 tokenizer: </s> survives truncation, <pad> fills, the empty prompt is </s> alone", "[t5][tokenizer]") {
    const auto tok = T5Tokenizer::from_folder(test::golden("sd/t5_tiny"));
    const auto full = tok.encode("a photo of a cat on a red sofa");
    REQUIRE(full.size() > 4);
    CHECK(full.back() == tok.eos_id());
    const auto cut = tok.tokenize("a photo of a cat on a red sofa", 4);
    CHECK(cut == std::vector<int64_t>{full[0], full[1], full[2], tok.eos_id()});
    CHECK(tok.tokenize("", 3) == std::vector<int64_t>{tok.eos_id(), tok.pad_id(), tok.pad_id()});
    CHECK(tok.tokenize("a cat", 1) == std::vector<int64_t>{tok.eos_id()});
    CHECK_THAT(test::error_of([&] { (void)tok.tokenize("a", 0); }), Catch::Contains("max_sequence_length"));
}

TEST_CASE("SentencePiece model errors name the file", "[t5][tokenizer][errors]") {
    CHECK_THAT(test::error_of([] { (void)SentencePieceModel::parse("\x0a\xff", "bad.model"); }),
               Catch::Contains("'bad.model': not a SentencePiece model"));
    CHECK_THAT(test::error_of([] { (void)SentencePieceModel::parse("", "empty.model"); }),
               Catch::Contains("'empty.model': the SentencePiece model has no pieces"));
    const std::string dir = test::scratch_dir("t5_no_spiece");
    CHECK_THAT(test::error_of([&] { (void)T5Tokenizer::from_folder(dir); }), Catch::Contains("has no spiece.model"));
}
