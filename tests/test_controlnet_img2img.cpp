// ControlNet with img2img and inpainting from the command line (golden_runner's check_controlnet_img2img.cpp checks
// the pipeline against diffusers 0.27.2): anchor-sd -i INIT [--mask M] --control-net --control-image runs with the
// 4- and 9-channel UNets, a control image of another size than the init image is resized to the output size as
// diffusers' control_image_processor does, and a ControlNet of another family is refused before anything is written.
#include "tests/controlnet_test_util.h"
#include "tests/test_cli_util.h"
#include "tests/test_util.h"
#include "unet/model/controlnet.h"
#include "unet/pipeline/pipeline.h"

#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

using namespace anchor;
using namespace anchor::unet;

namespace {

const std::string kCniCase = "tests/golden/sd/controlnet_img2img_tiny";
const std::string kCniModel = "assets/models/sd15-tiny-random";

std::vector<std::string> cni_args(const std::string& out, std::vector<std::string> more) {
    std::vector<std::string> a{"-m", kCniModel,   "-p", "a red house", "--steps", "4",         "--seed",
                               "7",  "--threads", "1",  "-o",          out,       "--sampler", "ddim"};
    a.insert(a.end(), more.begin(), more.end());
    return a;
}

// A model folder like kCniModel with the 9-channel inpainting UNet of inpaint_tiny (links, nothing copied).
std::string cni_inpaint_model(const std::string& dir) {
    namespace fs = std::filesystem;
    const fs::path root = fs::path(dir) / "model9", src = fs::absolute(kCniModel);
    fs::create_directories(root);
    for (const char* part : {"scheduler", "text_encoder", "vae"}) fs::create_directory_symlink(src / part, root / part);
    fs::copy_file(src / "model_index.json", root / "model_index.json");
    fs::create_directory_symlink(fs::absolute(test::golden("sd/inpaint_tiny/unet_inpaint")), root / "unet");
    return root.string();
}

// A ControlNet of other block widths than the tiny UNet's, as a diffusers folder.
std::string cni_wide_controlnet(const std::string& dir) {
    auto ucfg = nlohmann::json::parse(std::ifstream(kCniModel + "/unet/config.json"));
    UNetConfig u = UNetConfig::from_json(ucfg);
    for (auto& c : u.block_out_channels) c *= 2;
    ucfg["block_out_channels"] = u.block_out_channels;
    ControlNetConfig c;
    c.unet = u;
    c.embedding_channels = {8, 16};
    torch::manual_seed(3);
    ControlNetModel net(c);
    return test::save_controlnet_folder(net, ucfg, dir + "/wide_cn");
}

} // namespace

TEST_CASE(
    "anchor-sd img2img and inpaint with --control-net: run with 4- and 9-channel UNets, a control image of "
    "another size is resized to the output, --prompt-from gives the same pixels, another family's ControlNet exits 2 "
    "with nothing written",
    "[controlnet][img2img][cli][sd]") {
    namespace fs = std::filesystem;
    const auto dir = test::scratch_dir("cli_controlnet_img2img");
    const std::string cn = kCniCase + "/controlnet", init = kCniCase + "/init_32x16.png",
                      mask = kCniCase + "/mask_32x16.png", control = kCniCase + "/control_20x20.png";
    const std::vector<std::string> with_cn{
        "-i", init, "--strength", "0.75", "--control-net", cn, "--control-image", control, "--control-scale", "1.5"};
    auto run = [&](const std::vector<std::string>& args) {
        auto r = test::run_program(test::sd_bin(), args);
        INFO(r.output);
        REQUIRE(r.exit_code == 0);
        return r;
    };
    SECTION("img2img: the init image's size; the control image resized to it, as given pre-resized") {
        run(cni_args(dir + "/cn.png", with_cn));
        const auto img = read_image_rgb(dir + "/cn.png");
        CHECK(img.size(0) == 16);
        CHECK(img.size(1) == 32);
        // The same control image resized by PIL's Lanczos (our resize_lanczos, checked against Pillow) gives the
        // same pixels: the 20x20 image was resized to the 32x16 output, not cropped or refused.
        write_png(dir + "/control_32x16.png", resize_lanczos(read_image_rgb(control), 32, 16), true);
        auto pre = with_cn;
        pre[7] = dir + "/control_32x16.png";
        run(cni_args(dir + "/pre.png", pre));
        CHECK(torch::equal(read_image_rgb(dir + "/pre.png"), img));
        // Without the ControlNet the image differs; the sidecar records both inputs.
        run(cni_args(dir + "/plain.png", {"-i", init, "--strength", "0.75"}));
        CHECK_FALSE(torch::equal(read_image_rgb(dir + "/plain.png"), img));
        const auto rec = nlohmann::json::parse(std::ifstream(dir + "/cn.png.json"));
        REQUIRE(rec.contains("controlnets"));
        CHECK(rec["controlnets"][0]["scale"].get<double>() == Approx(1.5));
        CHECK(rec.dump().find("init_32x16.png") != std::string::npos);
    }
    SECTION("inpaint with the 4-channel UNet and with a 9-channel inpainting UNet (the ControlNet sees the latents)") {
        auto inp = with_cn;
        inp.insert(inp.end(), {"--mask", mask});
        run(cni_args(dir + "/inp4.png", inp));
        const auto a = read_image_rgb(dir + "/inp4.png");
        CHECK(a.size(1) == 32);
        // --prompt-from the image: its record names the init image, the mask, the ControlNet and its image, so the
        // same pixels come back.
        run({"-m", kCniModel, "--prompt-from", dir + "/inp4.png", "-o", dir + "/inp4_again.png", "--threads", "1"});
        CHECK(torch::equal(read_image_rgb(dir + "/inp4_again.png"), a));
        auto args9 = cni_args(dir + "/inp9.png", inp);
        args9[1] = cni_inpaint_model(dir);
        run(args9);
        CHECK_FALSE(torch::equal(read_image_rgb(dir + "/inp9.png"), a));
        auto plain9 = cni_args(dir + "/inp9_plain.png", {"-i", init, "--strength", "0.75", "--mask", mask});
        plain9[1] = args9[1];
        run(plain9);
        CHECK_FALSE(torch::equal(read_image_rgb(dir + "/inp9_plain.png"), read_image_rgb(dir + "/inp9.png")));
    }
    SECTION("a ControlNet of other block widths with -i: exit 2 naming the file, nothing written") {
        const std::string wide = cni_wide_controlnet(dir);
        auto bad = with_cn;
        bad[5] = wide;
        auto r = test::run_program(test::sd_bin(), cni_args(dir + "/bad.png", bad));
        INFO(r.output);
        CHECK(r.exit_code == 2);
        CHECK_THAT(r.output, Catch::Contains("error: --control-net") && Catch::Contains(wide) &&
                                 Catch::Contains("block_out_channels"));
        CHECK_FALSE(fs::exists(dir + "/bad.png"));
    }
}
