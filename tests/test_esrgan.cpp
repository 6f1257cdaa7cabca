// ESRGAN upscaler (unet/model/esrgan.h, unet/pipeline/upscale.h): the layouts agree with each other at sizes the
// golden cases (tests/golden/sd/esrgan_tiny, against spandrel) cannot have (another gc, an x1 unshuffle model), the
// tiled upscale against the untiled one, the bad-input catalogue, `anchor-sd upscale` and txt2img's --upscale-model.
#include "cache/io/png_text.h"
#include "cache/io/safetensors.h"
#include "tests/test_cli_util.h"
#include "tests/test_util.h"
#include "unet/model/esrgan.h"
#include "unet/pipeline/img2img.h"
#include "unet/pipeline/upscale.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <filesystem>

using namespace anchor;
using namespace anchor::unet;
namespace fs = std::filesystem;

namespace {

using EsrTensors = std::map<std::string, at::Tensor>;

// A random RRDBNet in basicsr names.
EsrTensors esr_random_basicsr(int64_t in, int64_t nf, int64_t nb, int64_t gc, int64_t ups, uint64_t seed) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
    EsrTensors t;
    auto conv = [&](const std::string& n, int64_t o, int64_t i) {
        t[n + ".weight"] = at::randn({o, i, 3, 3}, g, torch::kFloat) * (0.5 / std::sqrt(double(9 * i)));
        t[n + ".bias"] = at::randn({o}, g, torch::kFloat) * 0.01;
    };
    conv("conv_first", nf, in);
    for (int64_t b = 0; b < nb; ++b)
        for (int r = 1; r <= 3; ++r)
            for (int c = 1; c <= 5; ++c)
                conv("body." + std::to_string(b) + ".rdb" + std::to_string(r) + ".conv" + std::to_string(c),
                     c == 5 ? nf : gc, nf + (c - 1) * gc);
    conv("conv_body", nf, nf);
    for (int64_t u = 1; u <= ups; ++u) conv("conv_up" + std::to_string(u), nf, nf);
    conv("conv_hr", nf, nf);
    conv("conv_last", 3, nf);
    return t;
}

// The same network under the original ESRGAN (nn.Sequential) names.
EsrTensors esr_to_original(const EsrTensors& t, int64_t nb, int64_t ups) {
    EsrTensors o;
    for (const auto& [k, v] : t) {
        const auto dot = k.rfind('.');
        const std::string base = k.substr(0, dot), wb = k.substr(dot + 1);
        std::string name;
        if (base == "conv_first")
            name = "model.0." + wb;
        else if (base == "conv_body")
            name = "model.1.sub." + std::to_string(nb) + "." + wb;
        else if (base == "conv_hr")
            name = "model." + std::to_string(3 * ups + 2) + "." + wb;
        else if (base == "conv_last")
            name = "model." + std::to_string(3 * ups + 4) + "." + wb;
        else if (base.rfind("conv_up", 0) == 0)
            name = "model." + std::to_string(3 * std::stoi(base.substr(7))) + "." + wb;
        else { // body.B.rdbR.convC
            const auto p1 = base.find('.', 5), p2 = base.find('.', p1 + 1);
            name = "model.1.sub." + base.substr(5, p1 - 5) + ".RDB" + base.substr(p1 + 4, p2 - p1 - 4) + "." +
                   base.substr(p2 + 1) + ".0." + wb;
        }
        o[name] = v;
    }
    return o;
}

std::string esr_golden(const std::string& f) {
    return test::golden("sd/esrgan_tiny/" + f);
}

} // namespace

TEST_CASE("ESRGAN layouts give one network, sizes read from the shapes (gc other than 32, x1 unshuffle)", "[esrgan]") {
    torch::NoGradGuard ng;
    const auto t = esr_random_basicsr(3, 8, 2, 12, 2, 7);
    const auto a = esrgan_from_tensors(t, "basicsr");
    CHECK(a.nf == 8);
    CHECK(a.nb == 2);
    CHECK(a.gc == 12);
    CHECK(a.scale == 4);
    CHECK(a.shuffle == 1);
    EsrTensors wrapped;
    for (const auto& [k, v] : t) wrapped["params_ema." + k] = v, wrapped["params." + k] = v * 0; // EMA weights win
    const auto b = esrgan_from_tensors(wrapped, "wrapped");
    const auto c = esrgan_from_tensors(esr_to_original(t, 2, 2), "original");
    CHECK(c.gc == 12);
    const auto x = at::rand({1, 3, 9, 7}, at::make_generator<at::CPUGeneratorImpl>(3));
    const auto ya = a.forward(x);
    CHECK(ya.sizes().vec() == std::vector<int64_t>{1, 3, 36, 28});
    CHECK(torch::equal(ya, b.forward(x)));
    CHECK(torch::equal(ya, c.forward(x)));
    // Real-ESRGAN x1: unshuffle by 4 (48 input channels) and two 2x upsamplings.
    const auto x1 = esrgan_from_tensors(esr_random_basicsr(48, 8, 1, 8, 2, 9), "x1");
    CHECK(x1.shuffle == 4);
    CHECK(x1.scale == 1);
    CHECK(x1.in_channels == 3);
    CHECK(x1.forward(x).sizes().vec() == std::vector<int64_t>{1, 3, 9, 7});
    // An original-layout 1x model (no upsampling: HR conv at model.2, last at model.4).
    const auto one = esrgan_from_tensors(esr_to_original(esr_random_basicsr(3, 8, 1, 8, 0, 5), 1, 0), "1x");
    CHECK(one.scale == 1);
    CHECK(one.forward(x).sizes().vec() == std::vector<int64_t>{1, 3, 9, 7});
}

TEST_CASE("ESRGAN tiles: exact with an overlap past the receptive field, close with a narrow one", "[esrgan]") {
    const auto m = load_esrgan(esr_golden("old_x4.safetensors")); // nb 1: receptive field 17 + 3 input pixels
    const auto x = at::rand({1, 3, 40, 52}, at::make_generator<at::CPUGeneratorImpl>(11));
    const auto whole = esrgan_upscale(m, x, {0, 0});
    CHECK(whole.min().item<float>() >= 0.0f);
    CHECK(whole.max().item<float>() <= 1.0f);
    CHECK(torch::equal(esrgan_upscale(m, x, {12, 24}), whole));
    // A narrow overlap changes pixels next to the seams only, and a little: this is the tolerance the docs state.
    const double narrow = test::max_abs_diff(esrgan_upscale(m, x, {16, 8}), whole);
    INFO("max |tiled - untiled| with overlap 8: " << narrow);
    CHECK(narrow > 0.0);
    CHECK(narrow < 1e-2);
    // The unshuffle model's tiles start at even pixels; odd image sizes are padded once, as untiled.
    const auto m2 = load_esrgan(esr_golden("new_x2_unshuffle.pth"));
    const auto x2 = at::rand({2, 3, 23, 17}, at::make_generator<at::CPUGeneratorImpl>(12));
    CHECK(torch::equal(esrgan_upscale(m2, x2, {5, 24}), esrgan_upscale(m2, x2, {0, 0})));
    CHECK(esrgan_upscale(m2, x2).sizes().vec() == std::vector<int64_t>{2, 3, 46, 34});
    CHECK_THROWS_WITH(esrgan_upscale(m, x, {-1, 0}), Catch::Contains("tiling.tile"));
    CHECK_THROWS_WITH(esrgan_upscale(m, x, {8, -1}), Catch::Contains("tiling.overlap"));
    CHECK_THROWS_WITH(esrgan_upscale(m, x.narrow(1, 0, 1)), Catch::Contains("[1, 1, 40, 52]"));
}

TEST_CASE("ESRGAN bad input: not an RRDBNet, missing and unexpected tensors, shapes, truncated files", "[esrgan]") {
    auto t = esr_random_basicsr(3, 8, 2, 12, 2, 1);
    SECTION("every missing tensor at once, named") {
        t.erase("body.1.rdb2.conv3.weight");
        t.erase("conv_hr.bias");
        const auto e = test::error_of([&] { esrgan_from_tensors(t, "x.pth"); });
        CHECK_THAT(e, Catch::Contains("'x.pth' is not an RRDBNet"));
        CHECK_THAT(e, Catch::Contains("missing 2 tensor(s)"));
        CHECK_THAT(e, Catch::Contains("body.1.rdb2.conv3.weight"));
        CHECK_THAT(e, Catch::Contains("conv_hr.bias"));
    }
    SECTION("an unexpected tensor (ESRGAN+'s conv1x1) in the file's own names") {
        auto o = esr_to_original(t, 2, 2);
        o["model.1.sub.0.RDB1.conv1x1.weight"] = at::zeros({12, 8, 1, 1});
        const auto e = test::error_of([&] { esrgan_from_tensors(o, "plus.pth"); });
        CHECK_THAT(e, Catch::Contains("unexpected tensor(s): model.1.sub.0.RDB1.conv1x1.weight"));
    }
    SECTION("a shape that does not fit") {
        t["body.0.rdb3.conv5.weight"] = at::zeros({8, 40, 3, 3});
        const auto e = test::error_of([&] { esrgan_from_tensors(t, "s.safetensors"); });
        CHECK_THAT(e, Catch::Contains("'body.0.rdb3.conv5.weight' has shape [8, 40, 3, 3], expected [8, 56, 3, 3]"));
    }
    SECTION("another model's file") {
        const auto e = test::error_of([&] { load_esrgan(esr_golden("golden.safetensors")); });
        CHECK_THAT(e, Catch::Contains("golden.safetensors' is not an RRDBNet"));
        CHECK_THAT(e, Catch::Contains("conv_first.weight"));
    }
    SECTION("truncated and missing files name the file") {
        const auto dir = test::scratch_dir("esrgan_bad");
        for (const std::string f : {"new_x4.pth", "new_x4.safetensors"}) {
            const auto bytes = test::read_bytes(esr_golden(f));
            const std::string cut = dir + "/cut_" + f;
            test::write_bytes(cut, bytes.substr(0, bytes.size() / 2));
            CHECK_THAT(test::error_of([&] { load_esrgan(cut); }), Catch::Contains(cut));
        }
        CHECK_THAT(test::error_of([&] { load_esrgan(dir + "/none.pth"); }), Catch::Contains("does not exist"));
    }
}

TEST_CASE("anchor-sd upscale: the library's pixels, A1111's postprocessing text, nothing overwritten",
          "[esrgan][cli]") {
    const auto dir = test::scratch_dir("cli_upscale");
    const std::string in = test::golden("sd/pil_lanczos/init_24x20.png"), out = dir + "/up.png";
    const std::string model = esr_golden("new_x2_unshuffle.safetensors");
    auto r = test::run_program(test::sd_bin(), {"upscale", "-i", in, "--model", model, "-o", out, "--tile", "8"});
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    const auto m = load_esrgan(model);
    const auto want = esrgan_upscale_uint8(m, read_image_rgb(in), {8, 16});
    const auto got = read_image_rgb(out);
    CHECK(got.sizes().vec() == std::vector<int64_t>{40, 48, 3});
    CHECK(torch::equal(got, want));
    const auto chunks = read_png_text_chunks(out);
    const auto* pp = find_png_text(chunks, "postprocessing");
    REQUIRE(pp);
    CHECK(pp->text == "Postprocess upscale by: 2, Postprocess upscaler: new_x2_unshuffle");
    const auto before = test::read_bytes(out);
    SECTION("output exists: exit 2, file kept") {
        r = test::run_program(test::sd_bin(), {"upscale", "-i", in, "--model", model, "-o", out});
        CHECK(r.exit_code == 2);
        CHECK_THAT(r.output, Catch::Contains("exists; add --overwrite"));
        CHECK(test::read_bytes(out) == before);
    }
    SECTION("image missing: exit 2 naming it, nothing written") {
        r = test::run_program(test::sd_bin(),
                              {"upscale", "-i", dir + "/no.png", "--model", model, "-o", dir + "/a.png"});
        CHECK(r.exit_code == 2);
        CHECK_THAT(r.output, Catch::Contains("no.png"));
        CHECK(!fs::exists(dir + "/a.png"));
    }
    SECTION("not an RRDBNet / truncated: exit 1 naming the file, nothing written") {
        r = test::run_program(test::sd_bin(),
                              {"upscale", "-i", in, "--model", esr_golden("golden.safetensors"), "-o", dir + "/b.png"});
        CHECK(r.exit_code == 1);
        CHECK_THAT(r.output, Catch::Contains("is not an RRDBNet"));
        const auto bytes = test::read_bytes(model);
        test::write_bytes(dir + "/cut.safetensors", bytes.substr(0, 1000));
        r = test::run_program(test::sd_bin(),
                              {"upscale", "-i", in, "--model", dir + "/cut.safetensors", "-o", dir + "/b.png"});
        CHECK(r.exit_code == 1);
        CHECK_THAT(r.output, Catch::Contains("cut.safetensors"));
        CHECK(!fs::exists(dir + "/b.png"));
    }
}

TEST_CASE("anchor-sd --upscale-model: the generated image upscaled before it is written, recorded as A1111's Extras",
          "[esrgan][cli]") {
    const auto dir = test::scratch_dir("cli_upscale_txt2img");
    const std::string ckpt = test::golden("sd/sd15_tiny_single_file/sd15_tiny_single_file.safetensors");
    const std::string model = esr_golden("old_x4.pth");
    const std::vector<std::string> base = {"-m", ckpt, "-p", "a red fox", "--steps", "4",         "-s",
                                           "42", "-W", "16", "-H",        "16",      "--threads", "1"};
    auto plain = base, up = base;
    plain.insert(plain.end(), {"-o", dir + "/plain.png"});
    up.insert(up.end(), {"-o", dir + "/up.png", "--upscale-model", model});
    auto r = test::run_program(test::sd_bin(), plain);
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    r = test::run_program(test::sd_bin(), up);
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    const auto m = load_esrgan(model);
    const auto got = read_image_rgb(dir + "/up.png");
    CHECK(got.sizes().vec() == std::vector<int64_t>{64, 64, 3});
    CHECK(torch::equal(got, esrgan_upscale_uint8(m, read_image_rgb(dir + "/plain.png"))));
    const auto chunks = read_png_text_chunks(dir + "/up.png");
    const auto* pp = find_png_text(chunks, "postprocessing");
    REQUIRE(pp);
    CHECK(pp->text == "Postprocess upscale by: 4, Postprocess upscaler: old_x4");
    const auto* params = find_png_text(chunks, "parameters");
    REQUIRE(params);
    CHECK_THAT(params->text, Catch::Contains("Size: 16x16")); // the generation's size, as A1111 keeps it
    const auto rec = nlohmann::json::parse(test::read_bytes(dir + "/up.png.json"));
    CHECK(rec["postprocess_upscale"]["scale"] == 4);
    CHECK(rec["postprocess_upscale"]["upscaler"] == "old_x4");
    SECTION("a bad upscale model stops the run before anything is written") {
        auto bad = base;
        bad.insert(bad.end(), {"-o", dir + "/bad.png", "--upscale-model", esr_golden("golden.safetensors")});
        r = test::run_program(test::sd_bin(), bad);
        CHECK(r.exit_code == 1);
        CHECK_THAT(r.output, Catch::Contains("is not an RRDBNet"));
        CHECK(!fs::exists(dir + "/bad.png"));
    }
}

TEST_CASE("A1111's Scale by: the network until the size is reached, then Lanczos to floor(side x scale / 8) x 8",
          "[esrgan]") {
    CHECK(python_float_str(2.0) == "2.0");
    CHECK(python_float_str(1.5) == "1.5");
    CHECK(python_float_str(0.1) == "0.1");
    const auto m = load_esrgan(esr_golden("new_x2_unshuffle.safetensors"));
    const auto img = read_image_rgb(test::golden("sd/pil_lanczos/init_24x20.png"));
    const auto once = esrgan_upscale_uint8(m, img);
    CHECK(torch::equal(a1111_upscale_by(m, img, 1.5), resize_lanczos(once, 32, 24)));
    CHECK(torch::equal(a1111_upscale_by(m, img, 2.0), once)); // 48x40: a multiple of 8 already
    // 4x with a 2x model: the network twice (96x80), nothing to resize.
    CHECK(torch::equal(a1111_upscale_by(m, img, 4.0), esrgan_upscale_uint8(m, once)));
    CHECK_THROWS_WITH(a1111_upscale_by(m, img, 0.2), Catch::Contains("smaller than 8 pixels"));
}
