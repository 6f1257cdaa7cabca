// Textual-inversion embeddings (unet/model/embeddings.h): the file formats of the golden case folders, the folder's
// refusals (corrupt file, two files for one token, another encoder's width), the chunking of their vectors (A1111's
// tokenize_line), the infotext's TI hashes, and anchor-sd --embedding-dir / --prompt-from on the tiny model. The
// numbers against diffusers' load_textual_inversion are golden_runner's (tests/golden_runner/check_embeddings.cpp).
#include "cache/io/error.h"
#include "cache/io/png_text.h"
#include "cache/io/safetensors.h"
#include "cache/io/sha256.h"
#include "tests/test_cli_util.h"
#include "tests/test_util.h"
#include "unet/model/clip_tokenizer.h"
#include "unet/model/embeddings.h"
#include "unet/pipeline/infotext.h"
#include "unet/pipeline/prompt_syntax.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

using namespace anchor;
using namespace anchor::unet;
namespace fs = std::filesystem;

namespace {

const std::string kTiSd15 = "tests/golden/sd/anchorcache_cases/textual_inversion_sd15/embeddings";
const std::string kTiSdxl = "tests/golden/sd/anchorcache_cases/textual_inversion_sdxl/embeddings";

void ti_write_bytes(const std::string& path, const std::string& bytes) {
    std::ofstream(path, std::ios::binary) << bytes;
}

std::string ti_read_bytes(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

} // namespace

TEST_CASE("embedding files: A1111 .pt, emb_params .safetensors, diffusers .bin, SDXL clip_l/clip_g", "[embeddings]") {
    const auto a = load_textual_inversion(kTiSd15 + "/EasyNegative.pt");
    CHECK(a.name == "EasyNegative");
    CHECK(a.vectors.sizes() == torch::IntArrayRef({2, 32}));
    CHECK(a.vectors.scalar_type() == torch::kFloat);
    CHECK(a.sha256 == sha256_file(kTiSd15 + "/EasyNegative.pt"));
    CHECK(a.short_hash() == a.sha256.substr(0, 10));
    const auto b = load_textual_inversion(kTiSd15 + "/bad_hands.safetensors");
    CHECK(b.vectors.sizes() == torch::IntArrayRef({3, 32}));
    const auto c = load_textual_inversion(kTiSd15 + "/watercolor.bin"); // one 1-D vector: [1, D]
    CHECK(c.vectors.sizes() == torch::IntArrayRef({1, 32}));
    CHECK(!c.sdxl());
    const auto x = load_textual_inversion(kTiSdxl + "/xl_negative.safetensors");
    CHECK(x.sdxl());
    CHECK(x.count() == 2);
    CHECK(x.clip_l.size(1) == 16);
    CHECK(x.clip_g.size(1) == 32);
    CHECK(torch::equal(x.for_encoder(1, {16, 32}), x.clip_g));

    const auto db = EmbeddingDatabase::load_dir(kTiSd15);
    REQUIRE(db.items().size() == 3);
    CHECK(db.find("bad_hands") != nullptr);
    CHECK(db.find("badhands") == nullptr);
    const auto names = db.lookup(ClipTokenizer::bundled());
    REQUIRE(names.size() == 3);
    for (size_t i = 1; i < names.size(); ++i) CHECK(names[i - 1].ids.size() >= names[i].ids.size());
}

TEST_CASE("embedding files: corrupt, not an embedding, another encoder's width, two files for one token",
          "[embeddings]") {
    const auto dir = test::scratch_dir("ti_bad");
    ti_write_bytes(dir + "/junk.pt", "this is not a torch archive");
    CHECK_THROWS_WITH(load_textual_inversion(dir + "/junk.pt"), Catch::Contains("'" + dir + "/junk.pt'"));
    const auto good = ti_read_bytes(kTiSd15 + "/bad_hands.safetensors");
    ti_write_bytes(dir + "/cut.safetensors", good.substr(0, good.size() - 9));
    CHECK_THROWS_WITH(load_textual_inversion(dir + "/cut.safetensors"), Catch::Contains("cut.safetensors"));
    ti_write_bytes(dir + "/empty.pt", "");
    CHECK_THROWS_WITH(load_textual_inversion(dir + "/empty.pt"), Catch::Contains("is empty"));
    save_safetensors(dir + "/two.safetensors", {{"a", torch::zeros({1, 4})}, {"b", torch::zeros({1, 4})}});
    CHECK_THROWS_WITH(load_textual_inversion(dir + "/two.safetensors"),
                      Catch::Contains("not a textual-inversion embedding") && Catch::Contains("2 tensors (a, b)"));
    save_safetensors(dir + "/scalar.safetensors", {{"emb_params", torch::zeros({2, 3, 4})}});
    CHECK_THROWS_WITH(load_textual_inversion(dir + "/scalar.safetensors"),
                      Catch::Contains("[2, 3, 4], expected [vectors, width]"));

    // Width: the file, the expected and the actual shape.
    const auto a = load_textual_inversion(kTiSd15 + "/EasyNegative.pt");
    CHECK_THROWS_WITH(a.for_encoder(0, {768}), Catch::Contains("EasyNegative.pt") &&
                                                   Catch::Contains("expected [2, 768], the file has [2, 32]"));
    CHECK_THROWS_WITH(a.for_encoder(0, {768, 1280}),
                      Catch::Contains("expected clip_l [2, 768], clip_g [2, 1280]") &&
                          Catch::Contains("SDXL needs clip_l and clip_g"));
    const auto x = load_textual_inversion(kTiSdxl + "/xl_style.safetensors");
    CHECK_THROWS_WITH(x.for_encoder(0, {32}), Catch::Contains("(an SDXL embedding)"));

    // One token, two files (the same stem, or stems differing in case): refused naming both.
    const auto twin = test::scratch_dir("ti_twin");
    fs::create_directories(twin + "/sub");
    fs::copy_file(kTiSd15 + "/EasyNegative.pt", twin + "/EasyNegative.pt");
    fs::copy_file(kTiSd15 + "/bad_hands.safetensors", twin + "/sub/easynegative.safetensors");
    CHECK_THROWS_WITH(EmbeddingDatabase::load_dir(twin), Catch::Contains("two embeddings for the token") &&
                                                             Catch::Contains("EasyNegative.pt") &&
                                                             Catch::Contains("easynegative.safetensors"));
    CHECK_THROWS_WITH(EmbeddingDatabase::load_dir(twin + "/none"), Catch::Contains("does not exist"));
}

TEST_CASE("chunk_prompt with embeddings: placeholders, fixes, weights, the 75-token chunks count the vectors",
          "[embeddings][prompt]") {
    const auto tok = ClipTokenizer::bundled();
    std::vector<TokenEmbedding> names{{tok.encode("EasyNegative"), 0, 5}, {tok.encode("tiny"), 1, 1}};
    PromptChunkOptions o;
    o.embeddings = &names;
    auto chunk = [&](const std::string& s) { return chunk_prompt(tok, parse_prompt_attention(s), o); };

    auto c = chunk("a (EasyNegative:1.2) cat");
    REQUIRE(c.chunks.size() == 1);
    const auto& ch = c.chunks[0];
    REQUIRE(ch.fixes.size() == 1);
    CHECK(ch.fixes[0].offset == 1);
    CHECK(ch.fixes[0].index == 0);
    CHECK(c.token_count == 7); // a + 5 vectors + cat
    for (int k = 2; k <= 6; ++k) {
        CHECK(ch.ids[size_t(k)] == 0);
        CHECK(ch.weights[size_t(k)] == Approx(1.2f));
    }
    CHECK(c.embeddings_used == std::vector<int>{0});
    // Case as CLIP reads it, and no match inside another word's tokens.
    CHECK(chunk("easynegative").embeddings_used == std::vector<int>{0});
    CHECK(chunk("tinyhouse").embeddings_used.empty());

    // 72 words then the 5 vectors: they do not fit in the first chunk and open the next one (A1111).
    std::string words;
    for (int i = 0; i < 72; ++i) words += "cat ";
    c = chunk(words + "EasyNegative dog");
    REQUIRE(c.chunks.size() == 2);
    CHECK(c.chunks[0].fixes.empty());
    REQUIRE(c.chunks[1].fixes.size() == 1);
    CHECK(c.chunks[1].fixes[0].offset == 0);
    CHECK(c.token_count == 75 + 6);

    // The comma backtrack moves the vectors with their positions.
    std::string commas;
    for (int i = 0; i < 70; ++i) commas += "cat ";
    c = chunk(commas + ", EasyNegative dog");
    REQUIRE(c.chunks.size() == 2);
    CHECK(c.chunks[0].fixes.empty());
    REQUIRE(c.chunks[1].fixes.size() == 1);
    CHECK(c.chunks[1].fixes[0].offset == 0);
    CHECK(c.chunks[1].ids[1] == 0);

    std::vector<TokenEmbedding> huge{{tok.encode("huge"), 0, 80}};
    o.embeddings = &huge;
    CHECK_THROWS_WITH(chunk("huge"), Catch::Contains("80 vectors does not fit in a chunk of 75"));
}

TEST_CASE("infotext TI hashes: written as A1111 quotes them and read back", "[embeddings][png]") {
    Txt2ImgParams p;
    p.prompts = {"a cat"};
    p.width = p.height = 64;
    InfotextFacts f;
    f.ti_hashes = {{"EasyNegative", "0123456789"}, {"bad_hands", "abcdef0123"}};
    const auto text = format_infotext(infotext_of(p, 0, f));
    CHECK(text.find("TI hashes: \"EasyNegative: 0123456789, bad_hands: abcdef0123\"") != std::string::npos);
    const auto ip = image_parameters_from_infotext(text, "test");
    CHECK(ip.ti_hashes == f.ti_hashes);
    for (const auto& n : ip.notes) CHECK(n.find("TI hashes") == std::string::npos);
}

TEST_CASE("anchor-sd --embedding-dir: TI hashes in the PNG, --prompt-from reads them, bad folders exit 1 writing "
          "nothing",
          "[embeddings][cli]") {
    const auto dir = test::scratch_dir("cli_ti");
    const std::string model = "assets/models/sd15-tiny-random", png = dir + "/ti.png";
    const std::vector<std::string> common{"-m", model, "--steps", "2", "-W", "16", "-H", "16", "-s", "3", "--threads",
                                          "1"};
    auto args = [&](std::vector<std::string> extra) {
        auto a = common;
        a.insert(a.end(), extra.begin(), extra.end());
        return a;
    };
    auto r = test::run_program(test::sd_bin(), args({"-p", "a (watercolor:1.1) house", "-n", "EasyNegative",
                                                     "--embedding-dir", kTiSd15, "-o", png}));
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    const auto hash = [](const std::string& f) { return sha256_file(kTiSd15 + "/" + f).substr(0, 10); };
    const auto* text = find_png_text(read_png_text_chunks(png), "parameters");
    REQUIRE(text);
    CHECK(text->text.find("TI hashes: \"watercolor: " + hash("watercolor.bin") + ", EasyNegative: " +
                          hash("EasyNegative.pt") + "\"") != std::string::npos);
    std::ifstream js(png + ".json");
    const auto rec = nlohmann::json::parse(js);
    CHECK(rec["textual_inversion"].size() == 2);
    // Without the embeddings the names are words: another image.
    r = test::run_program(test::sd_bin(),
                          args({"-p", "a (watercolor:1.1) house", "-n", "EasyNegative", "-o", dir + "/words.png"}));
    REQUIRE(r.exit_code == 0);
    CHECK(ti_read_bytes(dir + "/words.png") != ti_read_bytes(png));

    r = test::run_program(test::sd_bin(), {"-m", model, "--prompt-from", png, "--embedding-dir", kTiSd15, "-o",
                                           dir + "/again.png", "--threads", "1"});
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    CHECK(r.output.find("made with the embedding") == std::string::npos);
    r = test::run_program(test::sd_bin(),
                          {"-m", model, "--prompt-from", png, "-o", dir + "/nodir.png", "--threads", "1"});
    REQUIRE(r.exit_code == 0);
    CHECK(r.output.find("note: the image was made with the embedding 'watercolor' (" + hash("watercolor.bin") +
                        "), which needs --embedding-dir") != std::string::npos);

    // An SDXL embedding named by the prompt of an SD 1.x model: exit 1 naming file and shapes, nothing written.
    const std::string out = dir + "/never.png";
    r = test::run_program(test::sd_bin(),
                          args({"-p", "xl_style cat", "--embedding-dir", kTiSdxl, "-o", out}));
    CHECK(r.exit_code == 1);
    CHECK(r.output.find("error: embedding 'xl_style'") != std::string::npos);
    CHECK(r.output.find("expected [1, 32], the file has clip_l [1, 16], clip_g [1, 32] (an SDXL embedding)") !=
          std::string::npos);
    CHECK(!fs::exists(out));
    CHECK(!fs::exists(out + ".json"));
    // A corrupt file in the folder, and two files for one token: exit 1 before the model loads.
    const auto bad = test::scratch_dir("cli_ti_bad");
    ti_write_bytes(bad + "/broken.safetensors", "\x08\x00\x00\x00\x00\x00\x00\x00{}");
    r = test::run_program(test::sd_bin(), args({"-p", "cat", "--embedding-dir", bad, "-o", out}));
    CHECK(r.exit_code == 1);
    CHECK(r.output.find("broken.safetensors") != std::string::npos);
    CHECK(!fs::exists(out));
    fs::remove(bad + "/broken.safetensors");
    fs::copy_file(kTiSd15 + "/EasyNegative.pt", bad + "/EasyNegative.pt");
    fs::copy_file(kTiSd15 + "/bad_hands.safetensors", bad + "/EasyNegative.safetensors");
    r = test::run_program(test::sd_bin(), args({"-p", "cat", "--embedding-dir", bad, "-o", out}));
    CHECK(r.exit_code == 1);
    CHECK(r.output.find("two embeddings for the token 'EasyNegative'") != std::string::npos);
    CHECK(!fs::exists(out));
    // Plain syntax naming an embedding: a usage error (exit 2), not words silently.
    r = test::run_program(test::sd_bin(), args({"-p", "EasyNegative", "--prompt-syntax", "plain", "--embedding-dir",
                                                kTiSd15, "-o", out}));
    CHECK(r.exit_code == 2);
    CHECK(!fs::exists(out));
}

TEST_CASE("infotext ControlNet units: written as sd-webui-controlnet writes them, read back from it and our record",
          "[png][controlnet]") {
    Txt2ImgParams p;
    p.prompts = {"a cat"};
    p.width = p.height = 64;
    ControlParams c;
    c.source = "models/control_v11p_sd15_canny"; // not a file: no hash
    c.scale = 0.8;
    c.end = 0.5;
    c.guess_mode = true;
    p.control = {c};
    const auto text = format_infotext(infotext_of(p, 0, {}));
    CHECK(text.find("ControlNet 0: \"Module: none, Model: control_v11p_sd15_canny, Weight: 0.8, Resize Mode: Just "
                    "Resize, Low Vram: False, Guidance Start: 0, Guidance End: 0.5, Pixel Perfect: False, Control "
                    "Mode: ControlNet is more important\"") != std::string::npos);
    const auto ip = image_parameters_from_infotext(
        text + ", ControlNet 1: \"Module: canny, Model: other [0123abcd], Weight: 1.2, Guidance Start: 0.1\"", "t");
    REQUIRE(ip.control.size() == 2);
    CHECK(ip.control[0].model == "control_v11p_sd15_canny");
    CHECK(ip.control[0].weight == 0.8);
    CHECK(ip.control[0].end == 0.5);
    CHECK(ip.control[0].guess_mode);
    CHECK(ip.control[1].module == "canny");
    CHECK(ip.control[1].model == "other [0123abcd]");
    CHECK(ip.control[1].start == Approx(0.1));
    CHECK(!ip.control[1].guess_mode);
    CHECK_THROWS_WITH(image_parameters_from_infotext(text + ", ControlNet 0: \"Weight: heavy\"", "t"),
                      Catch::Contains("ControlNet 0"));
    const auto rec = image_parameters_from_record(
        nlohmann::json::parse(R"({"controlnets": [{"model": "cn.safetensors", "image": "edges.png", "scale": 0.7,
                                 "start": 0, "end": 0.9, "guess_mode": false}]})"),
        "record");
    REQUIRE(rec.control.size() == 1);
    CHECK(rec.control[0].image == "edges.png");
    CHECK(rec.control[0].weight == 0.7);
    // A1111's model_hash: SHA-256 of the 64 KiB at 1 MiB (of nothing, for a smaller file), 8 digits.
    CHECK(a1111_legacy_hash(kTiSd15 + "/EasyNegative.pt") == sha256_hex("").substr(0, 8));
    CHECK(a1111_legacy_hash(kTiSd15).empty());
}
