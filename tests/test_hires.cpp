// The hires fix (unet/pipeline/hires.h): its sizes as A1111's calculate_target_resolution, PIL's Lanczos on the
// sizes it resizes to (Pillow's own output, tests/golden/sd/hires_tiny/pil), the infotext A1111 writes and reads back,
// and anchor-sd --hires-*: the PNG at the target size with its infotext, --prompt-from making the same pixels again,
// and bad settings refused with exit 2 naming the option. The passes against diffusers are golden_runner's
// (tests/golden/sd/hires_tiny, check_hires.cpp).
#include "cache/io/error.h"
#include "cache/io/png_text.h"
#include "tests/test_cli_util.h"
#include "tests/test_util.h"
#include "unet/pipeline/hires.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <fstream>

using namespace anchor;
using namespace anchor::unet;
namespace fs = std::filesystem;

namespace {

HiresParams hires_with(double scale, int w = 0, int h = 0) {
    HiresParams hp;
    hp.enabled = true;
    hp.scale = scale;
    hp.width = w;
    hp.height = h;
    return hp;
}

std::string hires_param_error_field(const std::function<void()>& f) {
    try {
        f();
    } catch (const ParamError& e) {
        return e.field();
    }
    return "";
}

nlohmann::json hires_sidecar(const std::string& png) {
    std::ifstream f(png + ".json");
    return nlohmann::json::parse(f);
}

} // namespace

TEST_CASE("hires plan: A1111's target sizes, rounded down to the VAE factor, and the crop of hr_resize_x/_y",
          "[hires]") {
    // hr_scale: int(size * scale), then the factor's multiple below (A1111's latents are target // 8).
    auto p = hires_plan(hires_with(2.0), 512, 768, 20, 8);
    CHECK(p.width == 1024);
    CHECK(p.height == 1536);
    CHECK(p.steps == 20);
    p = hires_plan(hires_with(1.3), 512, 512, 20, 8); // int(665.6) = 665 -> 664
    CHECK(p.width == 664);
    CHECK(p.upscale_width == 664);
    p = hires_plan(hires_with(1.3), 32, 24, 6, 2); // the golden case: 41 -> 40, 31 -> 30
    CHECK((p.width == 40 && p.height == 30));
    // hr_resize_x alone: the height follows the aspect (floor division), rounded down.
    p = hires_plan(hires_with(2.0, 1000, 0), 512, 768, 20, 8);
    CHECK(p.upscale_width == 1000);
    CHECK(p.upscale_height == 1500);
    CHECK((p.width == 1000 && p.height == 1496));
    p = hires_plan(hires_with(2.0, 0, 1024), 512, 768, 20, 8);
    CHECK((p.upscale_width == 682 && p.width == 680 && p.height == 1024));
    // Both, another aspect: the upscale covers the target, truncate_x = (upscale - target) // 8 latent cells.
    p = hires_plan(hires_with(2.0, 1024, 1024), 512, 768, 20, 8);
    CHECK((p.upscale_width == 1024 && p.upscale_height == 1536 && p.crop_x == 0 && p.crop_y == 64));
    CHECK((p.width == 1024 && p.height == 1024));
    p = hires_plan(hires_with(2.0, 40, 36), 32, 24, 5, 2);
    CHECK((p.upscale_width == 48 && p.upscale_height == 36 && p.crop_x == 4 && p.crop_y == 0));
    // Hires steps: 0 = the first pass's.
    auto h = hires_with(2.0);
    h.steps = 12;
    CHECK(hires_plan(h, 64, 64, 20, 8).steps == 12);

    // Refused, naming the setting.
    h = hires_with(0.0);
    CHECK(hires_param_error_field([&] { hires_plan(h, 512, 512, 20, 8); }) == "hires_scale");
    h = hires_with(-1.0);
    CHECK(hires_param_error_field([&] { hires_plan(h, 512, 512, 20, 8); }) == "hires_scale");
    h = hires_with(std::nan(""));
    CHECK(hires_param_error_field([&] { hires_plan(h, 512, 512, 20, 8); }) == "hires_scale");
    h = hires_with(0.001); // a target below the factor
    CHECK(hires_param_error_field([&] { hires_plan(h, 512, 512, 20, 8); }) == "hires_scale");
    h = hires_with(2.0, 1001, 0);
    CHECK(hires_param_error_field([&] { hires_plan(h, 512, 512, 20, 8); }) == "hires_width");
    h = hires_with(2.0, 0, 1020);
    CHECK(hires_param_error_field([&] { hires_plan(h, 512, 512, 20, 8); }) == "hires_height");
    for (double d : {0.0, -0.5, 1.5}) {
        h = hires_with(2.0);
        h.denoise = d;
        CHECK(hires_param_error_field([&] { hires_plan(h, 512, 512, 20, 8); }) == "hires_denoise");
    }
    h = hires_with(2.0);
    h.denoise = 0.05; // int(10 * 0.05) = 0 steps
    CHECK(hires_param_error_field([&] { hires_plan(h, 512, 512, 10, 8); }) == "hires_denoise");
    h = hires_with(2.0);
    h.steps = -1;
    CHECK(hires_param_error_field([&] { hires_plan(h, 512, 512, 10, 8); }) == "hires_steps");
    // The hires fix is txt2img's.
    Txt2ImgParams tp;
    tp.width = tp.height = 64;
    tp.hires = hires_with(2.0);
    tp.init.init_images = {"x.png"};
    CHECK(hires_param_error_field([&] { validate_hires(tp, 8); }) == "init_image");
    tp.init = Img2ImgParams{};
    tp.hires.upscaler = HiresUpscaler::Model;
    tp.hires.model = "/nonexistent/4x-UltraSharp.pth";
    CHECK(hires_param_error_field([&] { validate_hires(tp, 8); }) == "hires_upscaler");
}

TEST_CASE("PIL Lanczos on the hires fix's sizes equals Pillow's, up and down", "[hires][img2img]") {
    const std::string d = test::golden("sd/hires_tiny/pil/");
    const auto src = read_image_rgb(test::golden("sd/img2img_tiny/init_image.png"));
    const auto up = read_image_rgb(d + "up_61x45.png");
    CHECK(torch::equal(resize_lanczos(src, 61, 45), up));
    for (const auto& [w, h] : std::vector<std::pair<int, int>>{{128, 96}, {23, 37}, {20, 17}, {7, 5}, {60, 44}}) {
        INFO(w << "x" << h);
        const auto want = read_image_rgb(d + "from61x45_" + std::to_string(w) + "x" + std::to_string(h) + ".png");
        CHECK(torch::equal(resize_lanczos(up, w, h), want));
    }
}

TEST_CASE("hires infotext: A1111's fields, read back with the denoising strength", "[hires][png]") {
    Txt2ImgParams p;
    p.prompts = {"a castle"};
    p.width = 512, p.height = 512, p.steps = 20;
    p.hires = hires_with(2.0);
    p.hires.steps = 10;
    p.hires.denoise = 0.5;
    const std::string text = format_infotext(infotext_of(p, 0, {}));
    INFO(text);
    CHECK(text.find("Size: 512x512") != std::string::npos); // the first pass's size, as A1111
    CHECK(text.find("Denoising strength: 0.5") != std::string::npos);
    CHECK(text.find("Hires upscale: 2, Hires steps: 10, Hires upscaler: Latent") != std::string::npos);
    auto ip = image_parameters_from_infotext(text, "t");
    REQUIRE(ip.hires);
    CHECK(ip.hires->enabled);
    CHECK(ip.hires->scale == 2.0);
    CHECK(ip.hires->steps == 10);
    CHECK(ip.hires->denoise == 0.5);
    CHECK(ip.hires->upscaler == HiresUpscaler::Latent);
    CHECK_FALSE(ip.strength); // not an img2img strength
    CHECK(ip.notes.empty());

    // An A1111 infotext: Hires resize, another latent mode, an upscaler model (a note: its file is not known here).
    ip = image_parameters_from_infotext(
        "a cat\nSteps: 20, Sampler: Euler a, CFG scale: 7, Seed: 1, Size: 512x768, Denoising strength: 0.45, Hires "
        "resize: 1024x0, Hires upscaler: Latent (nearest-exact)",
        "t");
    REQUIRE(ip.hires);
    CHECK((ip.hires->width == 1024 && ip.hires->height == 0));
    CHECK(ip.hires->denoise == 0.45);
    CHECK(ip.hires->upscaler == HiresUpscaler::LatentNearestExact);
    ip = image_parameters_from_infotext("a cat\nSteps: 20, Seed: 1, Size: 512x512, Denoising strength: 0.3, Hires "
                                        "upscale: 1.5, Hires upscaler: 4x-UltraSharp",
                                        "t");
    REQUIRE(ip.hires);
    CHECK(ip.hires->scale == 1.5);
    CHECK(ip.hires->upscaler == HiresUpscaler::Model);
    CHECK(ip.hires->model == "4x-UltraSharp");
    REQUIRE(ip.notes.size() == 1);
    CHECK(ip.notes[0].find("--hires-upscaler FILE") != std::string::npos);
    // Without Hires upscale / resize there is no hires fix: the field is a note, the strength stays.
    ip = image_parameters_from_infotext("a\nSteps: 20, Seed: 1, Denoising strength: 0.3, Hires upscaler: Latent", "t");
    CHECK_FALSE(ip.hires);
    CHECK(ip.strength == 0.3);

    // Our record.
    HiresPlan plan;
    plan.width = 64, plan.height = 48, plan.steps = 10;
    auto h = hires_with(1.5);
    h.upscaler = HiresUpscaler::Lanczos;
    h.denoise = 0.6;
    const auto back = image_parameters_from_record({{"prompt", "p"}, {"hires", hires_record(h, plan)}}, "r");
    REQUIRE(back.hires);
    CHECK(back.hires->scale == 1.5);
    CHECK(back.hires->upscaler == HiresUpscaler::Lanczos);
    CHECK(back.hires->denoise == 0.6);
}

TEST_CASE("anchor-sd --hires-*: the target size, A1111's infotext, --prompt-from and bad settings", "[hires][cli]") {
    const auto dir = test::scratch_dir("cli_hires");
    const std::vector<std::string> common{"-m", "assets/models/sd15-tiny-random", "--threads", "1", "-p", "a fox",
                                          "--steps", "4", "-W", "32", "-H", "24", "-s", "11"};
    auto with = [&](std::vector<std::string> a) {
        a.insert(a.begin(), common.begin(), common.end());
        return a;
    };
    SECTION("latent and lanczos upscalers; --prompt-from makes the same pixels") {
        for (const std::string up : {"latent", "lanczos"}) {
            INFO(up);
            const std::string png = dir + "/" + up + ".png", again = dir + "/" + up + "_again.png";
            auto r = test::run_program(test::sd_bin(), with({"--hires-scale", "2", "--hires-steps", "6",
                                                             "--hires-denoise", "0.5", "--hires-upscaler", up,
                                                             "--cache", "freq", "-o", png}));
            INFO(r.output);
            REQUIRE(r.exit_code == 0);
            const auto rgb = read_image_rgb(png);
            CHECK(rgb.size(1) == 64);
            CHECK(rgb.size(0) == 48);
            const auto chunks = read_png_text_chunks(png);
            const auto* t = find_png_text(chunks, kInfotextKeyword);
            REQUIRE(t);
            INFO(t->text);
            CHECK(t->text.find("Size: 32x24") != std::string::npos);
            CHECK(t->text.find("Denoising strength: 0.5") != std::string::npos);
            CHECK(t->text.find(std::string("Hires upscale: 2, Hires steps: 6, Hires upscaler: ") +
                               (up == "latent" ? "Latent" : "Lanczos")) != std::string::npos);
            const auto rec = hires_sidecar(png);
            CHECK(rec["hires"]["width"] == 64);
            CHECK(rec["unet_steps"] == 4 + 3); // both passes: int(6 * 0.5) = 3 second-pass steps
            r = test::run_program(test::sd_bin(), {"-m", "assets/models/sd15-tiny-random", "--threads", "1",
                                                   "--prompt-from", png, "-o", again});
            INFO(r.output);
            REQUIRE(r.exit_code == 0);
            CHECK(test::png_image_chunks(test::read_bytes(again)) == test::png_image_chunks(test::read_bytes(png)));
            // The same from the A1111 infotext alone (no record): a copy of the PNG with only its parameters chunk.
            const std::string a1111 = dir + "/" + up + "_a1111.png", third = dir + "/" + up + "_third.png";
            const std::string bytes = test::read_bytes(png);
            std::ofstream(a1111, std::ios::binary)
                << png_insert_text_chunks(bytes.substr(0, 8) + test::png_image_chunks(bytes),
                                          {png_text(kInfotextKeyword, t->text)}, "x");
            r = test::run_program(test::sd_bin(), {"-m", "assets/models/sd15-tiny-random", "--threads", "1",
                                                   "--prompt-from", a1111, "-o", third});
            INFO(r.output);
            REQUIRE(r.exit_code == 0);
            CHECK(test::png_image_chunks(test::read_bytes(third)) == test::png_image_chunks(bytes));
        }
    }
    SECTION("an ESRGAN model file as the upscaler: its x2 passes, then the target; named by its stem") {
        const std::string png = dir + "/esrgan.png";
        const std::string model = "tests/golden/sd/esrgan_tiny/new_x2_unshuffle.safetensors";
        const auto r = test::run_program(test::sd_bin(), with({"--hires-scale", "1.5", "--hires-steps", "4",
                                                               "--hires-denoise", "0.5", "--hires-upscaler", model,
                                                               "-o", png}));
        INFO(r.output);
        REQUIRE(r.exit_code == 0);
        const auto rgb = read_image_rgb(png);
        CHECK(rgb.size(1) == 48); // int(32 * 1.5)
        CHECK(rgb.size(0) == 36); // int(24 * 1.5), a multiple of this tiny VAE's factor (4)
        const auto* t = find_png_text(read_png_text_chunks(png), kInfotextKeyword);
        REQUIRE(t);
        INFO(t->text);
        CHECK(t->text.find("Hires upscaler: new_x2_unshuffle") != std::string::npos);
    }
    SECTION("bad settings: exit 2 naming the option, nothing written") {
        const std::string png = dir + "/bad.png";
        const std::vector<std::pair<std::vector<std::string>, std::string>> bad = {
            {{"--hires-denoise", "0"}, "--hires-denoise"},
            {{"--hires-denoise", "1.5"}, "--hires-denoise"},
            {{"--hires-scale", "0"}, "--hires-scale"},
            {{"--hires-scale", "-2"}, "--hires-scale"},
            {{"--hires-width", "33"}, "--hires-width"},
            {{"--hires-height", "31"}, "--hires-height"},
            {{"--hires-steps", "-3"}, "--hires-steps"},
            {{"--hires-upscaler", dir + "/none.pth"}, "--hires-upscaler"},
            {{"--hires-scale", "2", "-i", "tests/golden/sd/img2img_tiny/init_image.png"}, "--init-img"},
        };
        for (const auto& [args, option] : bad) {
            auto a = with(args);
            a.push_back("-o");
            a.push_back(png);
            const auto r = test::run_program(test::sd_bin(), a);
            INFO(r.output);
            CHECK(r.exit_code == 2);
            CHECK(r.output.find(option) != std::string::npos);
            CHECK_FALSE(fs::exists(png));
        }
    }
}
