// PNG metadata as the image ecosystem reads it: text chunks written and read with valid CRCs (and read back by
// libpng, a reader that is not ours), A1111's infotext written in create_infotext's layout and parsed as
// parse_generation_parameters does, and anchor-sd's `info` and `--prompt-from` on real runs of the tiny model.
#include "cache/io/png_text.h"
#include "cache/io/sha256.h"
#include "tests/test_cli_util.h"
#include "tests/test_util.h"
#include "unet/pipeline/infotext.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>
#include <zlib.h>

#include <fstream>
#include <iterator>

#include "tests/libpng_reader.h"

using namespace anchor;
using namespace anchor::unet;
namespace fs = std::filesystem;

namespace {

using test::read_bytes;
using test::write_bytes;
// A 3x2 RGB image with distinct pixels.
torch::Tensor small_image() {
    return torch::arange(18, torch::kInt32).mul(13).remainder(256).to(torch::kUInt8).reshape({2, 3, 3});
}

void append_be32(std::string& out, uint32_t v) {
    for (int s = 24; s >= 0; s -= 8) out.push_back(char((v >> s) & 0xff));
}

// A chunk built by hand (length, type, data, CRC over type + data), inserted after IHDR.
std::string with_raw_chunk(const std::string& png, const std::string& type, const std::string& data) {
    std::string c;
    append_be32(c, uint32_t(data.size()));
    c += type + data;
    append_be32(c, png_crc32(c.data() + 4, c.size() - 4));
    return png.substr(0, 33) + c + png.substr(33);
}

// The image of a PNG without its text chunks: every other chunk's bytes, in order.

Txt2ImgParams known_params() {
    Txt2ImgParams p;
    p.prompts = {"a cat, sitting on a mat"};
    p.negative_prompts = {"blurry"};
    p.steps = 20;
    p.sampler = SamplerKind::EulerAncestral;
    p.guidance_scale = 7;
    p.seed = 42;
    p.width = p.height = 512;
    p.clip_skip = 1; // the penultimate layer: A1111's "Clip skip: 2"
    return p;
}

InfotextFacts known_facts() {
    InfotextFacts f;
    f.model_hash = "6ce0161689";
    f.model_name = "v1-5-pruned-emaonly";
    f.lora_hashes = {{"add_detail", "7c6bad76eb54"}, {"style", "0123456789ab"}};
    f.cache_mode = "freq";
    f.version = "AnchorCache 0.1.0";
    return f;
}

} // namespace

TEST_CASE("PNG CRC-32 is the ISO 3309 check value and IEND's known CRC", "[png]") {
    CHECK(png_crc32("123456789", 9) == 0xCBF43926u);
    CHECK(png_crc32("IEND", 4) == 0xAE426082u);
    // Continued CRCs equal one pass.
    CHECK(png_crc32("6789", 4, png_crc32("12345", 5)) == 0xCBF43926u);
}

TEST_CASE("text chunks written after IHDR read back, tEXt as Latin-1, iTXt as UTF-8, zTXt inflated", "[png]") {
    const auto dir = test::scratch_dir("png_text_roundtrip");
    const std::string path = dir + "/a.png";
    const std::string latin = "caf\xc3\xa9 cr\xc3\xa8me, 100\xc2\xb0",
                      utf8 = "\xe6\x9d\xb1\xe4\xba\xac \xf0\x9f\x90\x88";
    write_png(path, small_image(), true,
              {png_text("parameters", latin), png_text("Title", utf8), png_itext("j", "{}")});
    auto bytes = read_bytes(path);
    // IHDR ends at byte 33; the first text chunk follows it.
    CHECK(bytes.substr(37, 4) == "tEXt");
    // The Latin-1 text is stored as one byte per character.
    CHECK(bytes.find("caf\xe9 cr\xe8me, 100\xb0") != std::string::npos);
    // A zTXt chunk made here with zlib (keyword, NUL, method 0, deflate stream).
    const std::string z_text = "zipped words, zipped words, zipped words";
    std::string z(compressBound(uLong(z_text.size())), '\0');
    uLongf zn = uLongf(z.size());
    REQUIRE(compress(reinterpret_cast<Bytef*>(&z[0]), &zn, reinterpret_cast<const Bytef*>(z_text.data()),
                     uLong(z_text.size())) == Z_OK);
    write_bytes(path, with_raw_chunk(bytes, "zTXt", std::string("Comment\0\0", 9) + z.substr(0, zn)));

    const auto chunks = read_png_text_chunks(path);
    REQUIRE(chunks.size() == 4);
    CHECK(chunks[0].kind == PngTextKind::ZText);
    CHECK(chunks[0].keyword == "Comment");
    CHECK(chunks[0].text == z_text);
    CHECK(chunks[1].kind == PngTextKind::Text);
    CHECK(chunks[1].keyword == "parameters");
    CHECK(chunks[1].text == latin);
    CHECK(chunks[2].kind == PngTextKind::IText); // not Latin-1: iTXt, as PIL's add_text chooses
    CHECK(chunks[2].text == utf8);
    CHECK(find_png_text(chunks, "j")->text == "{}");
    CHECK(find_png_text(chunks, "absent") == nullptr);
    // The image itself is untouched by the chunks.
    const auto plain = dir + "/plain.png";
    write_png(plain, small_image(), true);
    CHECK(test::png_image_chunks(read_bytes(plain)) == test::png_image_chunks(read_bytes(path)));
    CHECK(read_png_text_chunks(plain).empty());
}

TEST_CASE("PNG reader names the file and chunk on bad CRCs, truncation and non-PNG input", "[png]") {
    const auto dir = test::scratch_dir("png_text_errors");
    const std::string path = dir + "/a.png";
    write_png(path, small_image(), true, {png_text("parameters", "a cat\nSteps: 20, Seed: 1, Size: 3x2")});
    const auto good = read_bytes(path);
    REQUIRE(read_png_text_chunks(path).size() == 1);

    auto flipped = good;
    flipped[good.find("a cat")] = 'A'; // the text changes, its CRC does not
    write_bytes(dir + "/crc.png", flipped);
    CHECK_THROWS_WITH(read_png_text_chunks(dir + "/crc.png"), Catch::Contains(dir + "/crc.png") &&
                                                                  Catch::Contains("chunk 'tEXt' at offset 33") &&
                                                                  Catch::Contains("CRC mismatch"));

    write_bytes(dir + "/cut.png", good.substr(0, good.size() - 20)); // in IDAT
    CHECK_THROWS_WITH(read_png_text_chunks(dir + "/cut.png"),
                      Catch::Contains(dir + "/cut.png") && Catch::Contains("'IDAT'") && Catch::Contains("truncated"));
    write_bytes(dir + "/noend.png", good.substr(0, good.size() - 12)); // IEND missing
    CHECK_THROWS_WITH(read_png_text_chunks(dir + "/noend.png"),
                      Catch::Contains("truncated") && Catch::Contains("no IEND"));

    auto huge = good;
    huge[33] = char(0x90); // tEXt's length > 2^31 - 1
    write_bytes(dir + "/len.png", huge);
    CHECK_THROWS_WITH(read_png_text_chunks(dir + "/len.png"), Catch::Contains("exceeds 2^31 - 1"));

    write_bytes(dir + "/text.png", "this is not an image\n");
    CHECK_THROWS_WITH(read_png_text_chunks(dir + "/text.png"),
                      Catch::Contains(dir + "/text.png") && Catch::Contains("is not a PNG file"));
    CHECK_THROWS_WITH(read_png_text_chunks(dir + "/missing.png"), Catch::Contains("cannot read"));

    // Writing refuses what a reader could not take back.
    CHECK_THROWS_WITH(png_insert_text_chunks(good, {png_text("", "x")}), Catch::Contains("1 to 79"));
    CHECK_THROWS_WITH(png_insert_text_chunks(good, {png_text(" lead", "x")}), Catch::Contains("space"));
    PngTextChunk not_latin = png_text("k", "x");
    not_latin.text = "\xe6\x9d\xb1";
    CHECK_THROWS_WITH(png_insert_text_chunks(good, {not_latin}), Catch::Contains("not Latin-1"));
    CHECK_THROWS_WITH(png_insert_text_chunks("GIF89a", {}), Catch::Contains("not an encoded PNG"));
}

TEST_CASE("A1111 infotext of a known parameter set, in create_infotext's order and quoting", "[png]") {
    const auto p = known_params();
    CHECK(format_infotext(infotext_of(p, 0, known_facts())) ==
          "a cat, sitting on a mat\nNegative prompt: blurry\nSteps: 20, Sampler: Euler a, Schedule type: Automatic, "
          "CFG scale: 7, Seed: 42, Size: 512x512, Model hash: 6ce0161689, Model: v1-5-pruned-emaonly, Clip skip: 2, "
          "Lora hashes: \"add_detail: 7c6bad76eb54, style: 0123456789ab\", AnchorCache: freq, Version: AnchorCache "
          "0.1.0");

    // img2img: Denoising strength; no negative prompt: no "Negative prompt:" line; a Karras DPM++ 2M; a cache mode
    // with ',' and ':' quoted; no Clip skip at the last layer.
    auto q = p;
    q.negative_prompts = {};
    q.sampler = SamplerKind::DPMPP2MKarras;
    q.guidance_scale = 7.5;
    q.clip_skip = 0;
    q.init.init_images = {"in.png"};
    q.init.strength = 0.6;
    InfotextFacts f;
    f.cache_mode = "deepcache:3,branch=0";
    CHECK(format_infotext(infotext_of(q, 0, f)) ==
          "a cat, sitting on a mat\nSteps: 20, Sampler: DPM++ 2M, Schedule type: Karras, CFG scale: 7.5, Seed: 42, "
          "Size: 512x512, Denoising strength: 0.6, AnchorCache: \"deepcache:3,branch=0\"");
    for (const auto& [name, k] : sampler_table()) {
        INFO(name);
        const auto a = a1111_sampler(k);
        CHECK((sampler_from_a1111(a.sampler, a.schedule_type) == k)); // every sampler reads back as itself
    }
    CHECK(infotext_number(0.1) == "0.1");
    CHECK(infotext_number(1.0 / 3) == "0.3333333333333333");
}

TEST_CASE("A1111 infotext parse: multi-line prompts, negative prompt, quoted values with commas", "[png]") {
    const std::string text =
        "masterpiece, a castle on a hill,\n(dramatic lighting:1.2), <lora:add_detail:0.5>\n"
        "Negative prompt: lowres, bad hands\nblurry, \"quoted\"\n"
        "Steps: 28, Sampler: DPM++ 2M, Schedule type: Karras, CFG scale: 6.5, Seed: 1234567890, Size: 512x768, "
        "Model hash: 6ce0161689, Model: v1-5-pruned-emaonly, Denoising strength: 0.7, Clip skip: 2, Hires upscaler: "
        "Latent, Lora hashes: \"add_detail: 7c6bad76eb54, more_art: 11aa22bb33cc\", TI hashes: \"EasyNegative: "
        "c74b4e810b03\", Wildcard: \"say \\\"hi\\\", twice\", Version: v1.9.4";
    const auto t = parse_infotext(text);
    CHECK(t.prompt == "masterpiece, a castle on a hill,\n(dramatic lighting:1.2), <lora:add_detail:0.5>");
    CHECK(t.negative_prompt == "lowres, bad hands\nblurry, \"quoted\"");
    REQUIRE(t.get("Lora hashes"));
    CHECK(*t.get("Lora hashes") == "add_detail: 7c6bad76eb54, more_art: 11aa22bb33cc");
    CHECK(*t.get("Wildcard") == "say \"hi\", twice");
    CHECK(*t.get("Version") == "v1.9.4");
    CHECK(*t.get("Hires upscaler") == "Latent");

    const auto ip = image_parameters_from_infotext(text, "test");
    CHECK(ip.source == "parameters");
    CHECK(ip.steps == 28);
    CHECK((ip.sampler == SamplerKind::DPMPP2MKarras));
    CHECK(ip.cfg_scale == 6.5);
    CHECK(ip.seed == 1234567890);
    CHECK(ip.width == 512);
    CHECK(ip.height == 768);
    CHECK(ip.clip_skip == 2);
    CHECK(ip.strength == 0.7);
    REQUIRE(ip.notes.size() == 1);
    CHECK(ip.notes[0] == "fields not applied: Model hash, Model, Hires upscaler, Lora hashes, Wildcard, Version");
    // TI hashes are read: anchor-sd compares them with --embedding-dir (tests/test_embeddings.cpp).
    CHECK(ip.ti_hashes == std::vector<std::pair<std::string, std::string>>{{"EasyNegative", "c74b4e810b03"}});

    // Before A1111 1.9: the schedule in the sampler name; no schedule type means the model's own sigmas.
    CHECK((sampler_from_a1111("DPM++ 2M Karras") == SamplerKind::DPMPP2MKarras));
    CHECK((sampler_from_a1111("DPM++ 2M") == SamplerKind::DPMPP2M));
    CHECK((sampler_from_a1111("DPM++ 2M", "Automatic") == SamplerKind::DPMPP2MKarras)); // 1.9's default for it
    CHECK((sampler_from_a1111("Euler a", "Automatic") == SamplerKind::EulerAncestral));
    CHECK(!sampler_from_a1111("Euler", "Karras"));
    CHECK((sampler_from_a1111("Heun") == SamplerKind::Heun));
    CHECK(!sampler_from_a1111("DPM++ 3M SDE"));
    const auto m3 = image_parameters_from_infotext("a dog\nSteps: 5, Sampler: DPM++ 3M SDE, Seed: 3", "test");
    CHECK(m3.prompt == "a dog");
    CHECK(!m3.sampler);
    CHECK(m3.notes.at(0).find("'DPM++ 3M SDE'") != std::string::npos);
    // A prompt alone (no parameter line of >= 3 fields) stays the prompt.
    CHECK(parse_infotext("just a prompt: with a colon").prompt == "just a prompt: with a colon");
    CHECK_THROWS_WITH(image_parameters_from_infotext("x\nSteps: many, Seed: 1, Size: 8x8", "img.png"),
                      Catch::Contains("img.png") && Catch::Contains("'Steps' is 'many', expected an integer"));

    // Ours reads back field for field.
    const auto p = known_params();
    const auto back = parse_infotext(format_infotext(infotext_of(p, 0, known_facts())));
    CHECK(back.prompt == p.prompts[0]);
    CHECK(back.negative_prompt == "blurry");
    CHECK(back.fields == infotext_of(p, 0, known_facts()).fields);
}

#if ANCHOR_HAVE_LIBPNG
TEST_CASE("libpng reads our text chunks and the image unchanged", "[png]") {
    const auto dir = test::scratch_dir("png_text_libpng");
    const std::string path = dir + "/a.png";
    const std::string params = format_infotext(infotext_of(known_params(), 0, known_facts()));
    const std::string record = nlohmann::json{{"prompt", "\xe6\x9d\xb1\xe4\xba\xac"}, {"seed", 42}}.dump();
    const auto img = small_image();
    write_png(path, img, true, {png_text(kInfotextKeyword, params), png_itext(kRecordKeyword, record)});
    test::LibpngImage out;
    test::read_with_libpng(path, out);
    REQUIRE(out.error == "");
    CHECK(out.width == 3);
    CHECK(out.height == 2);
    CHECK(out.rgb == std::vector<uint8_t>(img.data_ptr<uint8_t>(), img.data_ptr<uint8_t>() + img.numel()));
    REQUIRE(out.text.size() == 2);
    CHECK(std::get<0>(out.text[0]) == "parameters");
    CHECK(std::get<1>(out.text[0]) == params);
    CHECK(std::get<2>(out.text[0]) == "tEXt");
    CHECK(std::get<0>(out.text[1]) == "anchorcache");
    CHECK(std::get<1>(out.text[1]) == record);
    CHECK(std::get<2>(out.text[1]) == "iTXt");
    // And libpng sees a bad CRC where our reader does.
    auto bytes = read_bytes(path);
    bytes[bytes.find("Steps")] = 's';
    write_bytes(dir + "/bad.png", bytes);
    test::LibpngImage bad;
    test::read_with_libpng(dir + "/bad.png", bad);
    CHECK(bad.error.find("CRC") != std::string::npos);
}
#endif

TEST_CASE("anchor-sd writes the metadata, `info` shows it and --prompt-from runs it again", "[png][cli]") {
    const auto dir = test::scratch_dir("cli_png_meta");
    const std::string model = "assets/models/sd15-tiny-random", png = dir + "/out.png";
    auto r =
        test::run_program(test::sd_bin(), {"-m",          model,    "-p",          "a red fox, in the snow\nat dusk",
                                           "-n",          "blurry", "--steps",     "3",
                                           "-W",          "16",     "-H",          "24",
                                           "-s",          "7",      "--sampler",   "euler",
                                           "--cfg-scale", "6.5",    "--clip-skip", "2",
                                           "-o",          png,      "--threads",   "1"});
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    const std::string hash = sha256_file(model + "/unet/diffusion_pytorch_model.safetensors").substr(0, 10);
    const std::string expected = "a red fox, in the snow\nat dusk\nNegative prompt: blurry\nSteps: 3, Sampler: "
                                 "Euler, Schedule type: Automatic, CFG scale: 6.5, Seed: 7, Size: 16x24, Model hash: " +
                                 hash + ", Model: sd15-tiny-random, Clip skip: 2, Version: AnchorCache " +
                                 ANCHOR_VERSION;
    const auto chunks = read_png_text_chunks(png);
    REQUIRE(find_png_text(chunks, "parameters"));
    CHECK(find_png_text(chunks, "parameters")->text == expected);
    REQUIRE(find_png_text(chunks, "anchorcache"));
    std::ifstream sidecar(png + ".json");
    CHECK(nlohmann::json::parse(find_png_text(chunks, "anchorcache")->text) == nlohmann::json::parse(sidecar));

    auto info = test::run_program(test::sd_bin(), {"info", png});
    INFO(info.output);
    CHECK(info.exit_code == 0);
    CHECK(info.output.find(expected) != std::string::npos);
    CHECK(info.output.find("\"prompt\": \"a red fox, in the snow\\nat dusk\"") != std::string::npos);

    // The same image from the PNG alone (seed, size, sampler, clip skip included), and options given win.
    const std::string again = dir + "/again.png", steps4 = dir + "/steps4.png";
    r = test::run_program(test::sd_bin(), {"-m", model, "--prompt-from", png, "-o", again, "--threads", "1"});
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    CHECK(r.output.find("from its 'anchorcache' chunk") != std::string::npos);
    CHECK(test::png_image_chunks(read_bytes(again)) == test::png_image_chunks(read_bytes(png)));
    r = test::run_program(test::sd_bin(),
                          {"-m", model, "--prompt-from", png, "--steps", "4", "-o", steps4, "--threads", "1"});
    REQUIRE(r.exit_code == 0);
    std::ifstream js(steps4 + ".json");
    const auto j = nlohmann::json::parse(js);
    CHECK(j["steps"] == 4);
    CHECK(j["seed"] == 7);
    CHECK(j["sampler"] == "euler");
    CHECK(j["prompt"] == "a red fox, in the snow\nat dusk");

    // A PNG with only A1111's text (as webui writes it): parsed, the fields this engine has applied.
    const std::string a1111 = dir + "/a1111.png", from_a1111 = dir + "/from_a1111.png";
    write_png(a1111, small_image(), true,
              {png_text("parameters", "a red fox, in the snow\nat dusk\nNegative prompt: blurry\nSteps: 3, Sampler: "
                                      "Euler, Schedule type: Automatic, CFG scale: 6.5, Seed: 7, Size: 16x24, Model "
                                      "hash: 0123456789, Model: other, Clip skip: 2, Version: v1.9.4")});
    r = test::run_program(test::sd_bin(), {"-m", model, "--prompt-from", a1111, "-o", from_a1111, "--threads", "1"});
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    CHECK(r.output.find("note: fields not applied: Model hash, Model, Version") != std::string::npos);
    CHECK(test::png_image_chunks(read_bytes(from_a1111)) == test::png_image_chunks(read_bytes(png)));
}

TEST_CASE("anchor-sd info refuses what is not a readable PNG, naming the file", "[png][cli]") {
    const auto dir = test::scratch_dir("cli_png_info_errors");
    const std::string txt = dir + "/notes.txt";
    std::ofstream(txt) << "not an image\n";
    auto r = test::run_program(test::sd_bin(), {"info", txt});
    CHECK(r.exit_code == 1);
    CHECK(r.output.find("'" + txt + "' is not a PNG file") != std::string::npos);
    r = test::run_program(test::sd_bin(), {"info", dir + "/missing.png"});
    CHECK(r.exit_code == 1);
    CHECK(r.output.find(dir + "/missing.png") != std::string::npos);
    // A PNG without our chunks: says which are absent.
    write_png(dir + "/plain.png", small_image(), true);
    r = test::run_program(test::sd_bin(), {"info", dir + "/plain.png"});
    CHECK(r.exit_code == 0);
    CHECK(r.output.find("no 'parameters' text chunk") != std::string::npos);
    CHECK(r.output.find("no 'anchorcache' text chunk") != std::string::npos);
    // --prompt-from a PNG without parameters.
    r = test::run_program(test::sd_bin(), {"--prompt-from", dir + "/plain.png", "-o", dir + "/x.png"});
    CHECK(r.exit_code == 1);
    CHECK(r.output.find("has no generation parameters") != std::string::npos);
}
