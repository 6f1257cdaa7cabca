// img2img and inpaint against tests/golden/sd/img2img_tiny and inpaint_tiny (diffusers 0.27.2): teacher-forced
// stages (init image exact, generator parity exact, encodings / latents 1e-4, noise_pred 5e-3), free-running within
// the README's tolerances; the image preprocessing against Pillow (tests/golden/sd/pil_lanczos); the caches in the
// truncated loop; the bad inputs; anchor-sd -i / --strength / --mask.
#include "cache/io/error.h"
#include "cache/io/safetensors.h"
#include "cache/io/sha256.h"
#include "tests/sd_golden_checks.h"
#include "tests/sd_img2img_golden.h"
#include "tests/test_cli_util.h"
#include "tests/test_util.h"
#include "unet/cache/freq_cache.h"
#include "unet/pipeline/txt2img_job.h"

#include <catch2/catch.hpp>

#include <fstream>

using namespace anchor;
namespace fs = std::filesystem;

namespace {

void check_comparisons(const std::string& label, const std::vector<sdgolden::Comparison>& cs) {
    REQUIRE(!cs.empty());
    for (const auto& c : cs) sdgolden::check_comparison(label, c);
}

void run_case(const std::string& folder, const std::vector<std::string>& runs) {
    const fs::path dir = test::golden("sd/" + folder);
    auto cfg = sdgolden::read_json_file(dir / "config.json");
    sdgolden::Img2ImgModels models;
    REQUIRE(sdgolden::img2img_runs_of(dir) == runs);
    for (const auto& run : runs) check_comparisons(run, sdgolden::compare_img2img_run(models, dir, cfg, run));
}

// The tiny models with one UNet of a case (the 4-channel one unless `unet9`).
unet::SDModels case_models(sdgolden::Img2ImgModels& mm, const std::string& folder, bool unet9 = false) {
    const fs::path dir = test::golden("sd/" + folder);
    auto cfg = sdgolden::read_json_file(dir / "config.json");
    const auto& mods = cfg["models"];
    const std::string u =
        mods.contains("unet") ? mods["unet"].get<std::string>() : mods[unet9 ? "unet9" : "unet4"].get<std::string>();
    return sdgolden::models_for(mm, dir, cfg, sdgolden::detail::folder_token(u));
}

unet::Txt2ImgParams tiny_params(unet::SamplerKind sampler, int steps, double strength) {
    unet::Txt2ImgParams p;
    p.prompts = {"a photo of an astronaut riding a horse on mars"};
    p.sampler = sampler;
    p.steps = steps;
    p.seed = 42;
    p.init.init_images = {test::golden("sd/img2img_tiny/init_image.png")};
    p.init.strength = strength;
    return p;
}

// The field of the ParamError `f` throws, and its message.
std::pair<std::string, std::string> param_error(const std::function<void()>& f) {
    try {
        f();
    } catch (const ParamError& e) {
        return {e.field(), e.what()};
    }
    return {"", "no ParamError"};
}

} // namespace

TEST_CASE("img2img DDIM strength 0.6 and Euler strength 0.8 match diffusers", "[sd][img2img]") {
    run_case("img2img_tiny", {"ddim10_strength0.6", "euler10_strength0.8"});
}

TEST_CASE("inpaint with 4- and 9-channel UNets matches diffusers", "[sd][inpaint]") {
    run_case("inpaint_tiny", {"unet4_ddim10_strength1.0", "unet4_euler10_strength0.75", "unet9_ddim10_strength1.0",
                              "unet9_euler10_strength0.6"});
    const fs::path dir = test::golden("sd/inpaint_tiny");
    auto cfg = sdgolden::read_json_file(dir / "config.json");
    sdgolden::Img2ImgModels models;
    check_comparisons("unet forward",
                      sdgolden::compare_unet_forward(models, dir, cfg, dir / "golden_unet_inpaint.safetensors"));
}

TEST_CASE("batched img2img and inpaint (one init image and mask per prompt, non-square) match diffusers",
          "[sd][img2img][inpaint]") {
    // tests/golden/sd/anchorcache_cases (generate/gen_img2img_batch.py): the real diffusers 0.27.2 pipelines with
    // prompt=[...], image=[...], mask_image=[...] at 16x24: one VAE batch and one posterior draw for the N images, the
    // noise after it, tiled to the batch; two and three prompts, DDIM and Euler, 4- and 9-channel UNets.
    run_case("anchorcache_cases/img2img_batch", {"ddim8_strength0.7", "euler7_strength0.9"});
    run_case("anchorcache_cases/inpaint_batch", {"unet4_ddim6_strength1.0", "unet4_euler8_strength0.6",
                                                 "unet9_ddim6_strength1.0", "unet9_euler8_strength0.75"});
    // One init image for two prompts (24x16: cat([latents] * 2)), and two init images with one mask.
    run_case("anchorcache_cases/img2img_broadcast", {"euler6_strength0.5"});
    run_case("anchorcache_cases/inpaint_one_mask", {"unet9_ddim5_strength0.8"});
}

TEST_CASE("batched init images: counts that divide the batch, tiled in diffusers' order; others refused",
          "[sd][img2img]") {
    sdgolden::Img2ImgModels mm;
    auto models = case_models(mm, "anchorcache_cases/inpaint_batch");
    unet::Txt2ImgPipeline pipe(models);
    const fs::path dir = test::golden("sd/anchorcache_cases/inpaint_batch");
    auto p = tiny_params(unet::SamplerKind::DDIM, 6, 0.5);
    p.prompts = {"a", "b", "c", "d"};
    p.init.init_images = {(dir / "init_image_0.png").string(), (dir / "init_image_1.png").string()};
    p.init.masks = {(dir / "mask_image_0.png").string()};
    p.decode = false;
    // 2 images for 4 prompts: image b starts from init image b mod 2 (diffusers' cat([x] * 2)).
    auto sched = unet::make_scheduler(p.sampler, pipe.scheduler_config());
    sched->set_timesteps(p.steps);
    torch::Generator g = at::detail::createCPUGenerator(7);
    const auto rp = pipe.resolved(p);
    CHECK(rp.width == 24);
    CHECK(rp.height == 16);
    const auto in = pipe.prepare_init(rp, *sched, 4, g);
    CHECK(in.init_image.size(0) == 2);
    CHECK(in.image_encode_noise.size(0) == 2); // one posterior draw for the two images
    CHECK(torch::equal(in.image_latents[0], in.image_latents[2]));
    CHECK(torch::equal(in.image_latents[1], in.image_latents[3]));
    CHECK(!torch::equal(in.image_latents[0], in.image_latents[1]));
    CHECK(in.mask.size(0) == 4);
    CHECK(in.masked_image.size(0) == 2); // two images x one mask, broadcast
    CHECK(in.masked_image_latents.size(0) == 4);
    // 3 images for 4 prompts, 2 masks for 3 images: refused with the counts.
    auto bad = p;
    bad.init.init_images.push_back((dir / "init_image_2.png").string());
    auto [field, msg] = param_error([&] { pipe.validate(bad); });
    CHECK(field == "init_image");
    CHECK_THAT(msg, Catch::Contains("3 init images") && Catch::Contains("batch of 4"));
    bad = p;
    bad.prompts = {"a", "b", "c"};
    bad.init.init_images.push_back((dir / "init_image_2.png").string());
    bad.init.masks.push_back((dir / "mask_image_1.png").string());
    std::tie(field, msg) = param_error([&] { pipe.validate(bad); });
    CHECK(field == "mask");
    CHECK_THAT(msg, Catch::Contains("2 masks"));
    // Images of a batch must share one size.
    bad = p;
    bad.init.init_images[1] = test::golden("sd/img2img_tiny/init_image.png");
    std::tie(field, msg) = param_error([&] { pipe.validate(bad); });
    CHECK(field == "init_image");
    CHECK_THAT(msg, Catch::Contains("16x16") && Catch::Contains("24x16"));
    // Pixels: [N, H, W, 3] and [H, W, 3] are both taken; other shapes are refused with the shape.
    unet::Img2ImgParams px;
    px.init_pixels = torch::zeros({2, 16, 24, 3}, torch::kUInt8);
    CHECK(px.validate(10, 4) == std::pair<int, int>{24, 16});
    px.init_pixels = torch::zeros({16, 24, 4}, torch::kUInt8);
    CHECK_THAT(param_error([&] { (void)px.validate(10, 4); }).second, Catch::Contains("[16, 24, 4]"));
}

TEST_CASE("a job hands each batch the init images of its prompts", "[sd][img2img]") {
    unet::Txt2ImgJob job;
    job.prompts = {"p0", "p1", "p2", "p3", "p4"};
    job.batch_size = 2;
    job.params.init.init_images = {"i0.png", "i1.png", "i2.png", "i3.png", "i4.png"};
    job.params.init.masks = {"m.png"};
    const auto batches = unet::plan_batches(job.prompts, job.batch_size, 1, 1);
    REQUIRE(batches.size() == 3);
    CHECK(job.init_of(batches[1]).init_images == std::vector<std::string>{"i2.png", "i3.png"});
    CHECK(job.init_of(batches[2]).init_images == std::vector<std::string>{"i4.png"});
    CHECK(job.init_of(batches[2]).masks == std::vector<std::string>{"m.png"});
    job.params.init.init_images.clear();
    job.params.init.init_pixels = torch::zeros({5, 8, 8, 3}, torch::kUInt8);
    job.params.init.init_pixels[3].fill_(3);
    const auto px = job.init_of(batches[1]).init_pixels;
    CHECK(px.size(0) == 2);
    CHECK(px[1].max().item<int>() == 3);
    // One prompt: the images stay as given (one per image of the batch).
    job.prompts = {"p"};
    job.batch_size = 5;
    CHECK(job.init_of(unet::plan_batches(job.prompts, 5, 1, 1)[0]).init_pixels.size(0) == 5);
}

TEST_CASE("the img2img spec reader fails on keys it does not understand, naming them", "[sd][img2img]") {
    const fs::path dir = test::golden("sd/img2img_tiny");
    auto cfg = sdgolden::read_json_file(dir / "config.json");
    CHECK_NOTHROW(sdgolden::read_img2img_spec(cfg, "ddim10_strength0.6", 2));
    auto bad = cfg;
    bad["runs"]["ddim10_strength0.6"]["padding_mask_crop"] = 32;
    CHECK_THROWS_WITH(sdgolden::read_img2img_spec(bad, "ddim10_strength0.6", 2), Catch::Contains("padding_mask_crop"));
    bad = cfg;
    bad["runs"]["ddim10_strength0.6"].erase("strength");
    CHECK_THROWS_WITH(sdgolden::read_img2img_spec(bad, "ddim10_strength0.6", 2), Catch::Contains("'strength'"));
    CHECK_THROWS_WITH(sdgolden::read_img2img_spec(cfg, "ddim10_strength0.6", 8), Catch::Contains("vae_scale_factor"));
    // A scheduler setting the engine would not run as diffusers does: the key and its value, never a silent default.
    bad = cfg;
    bad["scheduler_base_config"]["thresholding"] = true;
    CHECK_THROWS_WITH(sdgolden::read_img2img_spec(bad, "ddim10_strength0.6", 2),
                      Catch::Contains("thresholding = true"));
    bad = cfg;
    bad["scheduler_base_config"]["timestep_type"] = "continuous";
    CHECK_THROWS_WITH(sdgolden::read_img2img_spec(bad, "euler10_strength0.8", 2), Catch::Contains("timestep_type"));
}

TEST_CASE("image files are read and resized as Pillow does", "[sd][img2img]") {
    auto g = WeightMap::load(test::golden("sd/inpaint_tiny/unet4_ddim10_strength1.0.safetensors"));
    const auto rgb = unet::read_image_rgb(test::golden("sd/inpaint_tiny/init_image.png"));
    CHECK(torch::equal(rgb, g.get("init_image_uint8").squeeze(0)));
    CHECK(torch::equal(unet::read_image_grey(test::golden("sd/inpaint_tiny/mask_image.png")),
                       g.get("mask_image_uint8").squeeze(0)));
    const std::string ref = test::golden("sd/pil_lanczos/");
    const auto init = unet::read_image_rgb(test::golden("sd/img2img_tiny/init_image.png"));
    CHECK(torch::equal(unet::read_image_grey(test::golden("sd/img2img_tiny/init_image.png")),
                       unet::read_image_grey(ref + "init_L.png")));
    for (auto [w, h] : std::vector<std::pair<int, int>>{{10, 12}, {24, 20}, {7, 16}}) {
        INFO(w << "x" << h);
        const auto want = unet::read_image_rgb(ref + "init_" + std::to_string(w) + "x" + std::to_string(h) + ".png");
        CHECK(torch::equal(unet::resize_lanczos(init, w, h), want));
    }
    const auto mask = unet::read_image_grey(test::golden("sd/inpaint_tiny/mask_image.png"));
    CHECK(torch::equal(unet::resize_lanczos(mask, 12, 8), unet::read_image_grey(ref + "mask_12x8.png")));
    // same size: untouched
    CHECK(torch::equal(unet::resize_lanczos(init, 16, 16), init));
}

TEST_CASE("get_timesteps' strength rule truncates like Python's int()", "[sd][img2img]") {
    CHECK(unet::strength_schedule(25, 0.7).init_timestep == 17);
    CHECK(unet::strength_schedule(15, 0.45).init_timestep == 6);
    CHECK(unet::strength_schedule(100, 0.29).init_timestep == 28); // 28.999999999999996
    CHECK(unet::strength_schedule(10, 0.6).t_start == 4);
    CHECK(unet::strength_schedule(10, 1.0).t_start == 0);
}

TEST_CASE("DeepCache and the freq cache run in img2img and inpaint over the truncated loop", "[sd][img2img][cache]") {
    sdgolden::Img2ImgModels mm;
    for (bool inpaint : {false, true}) {
        INFO((inpaint ? "inpaint" : "img2img"));
        auto models = case_models(mm, inpaint ? "inpaint_tiny" : "img2img_tiny");
        unet::Txt2ImgPipeline pipe(models);
        auto p = tiny_params(unet::SamplerKind::DDIM, 10, 0.6);
        if (inpaint) p.init.masks = {test::golden("sd/inpaint_tiny/mask_image.png")};
        std::vector<torch::Tensor> plain, cached;
        auto r0 = pipe.run(p, nullptr, {}, [&](const unet::StepRecord& s) { plain.push_back(s.latents); });
        auto dc = unet::parse_cache_mode("deepcache:2");
        std::vector<bool> full;
        auto r1 = pipe.run(p, dc.get(), {}, [&](const unet::StepRecord& s) {
            cached.push_back(s.latents);
            full.push_back(dc->last_step_was_full());
        });
        REQUIRE(r0.total_steps == 6); // int(10 * 0.6) steps of 10
        CHECK(r0.full_steps == 6);
        CHECK(r1.total_steps == 6);
        CHECK(r1.full_steps == 3);
        CHECK(full == std::vector<bool>{true, false, true, false, true, false}); // step k full when k % 2 == 0
        // The first step is a full UNet evaluation from the same start: the same latents bit for bit.
        CHECK(torch::equal(r0.initial_latents, r1.initial_latents));
        CHECK(torch::equal(plain.at(0), cached.at(0)));
        CHECK(r1.image.sizes() == r0.image.sizes());
        auto freq = unet::parse_cache_mode("freq");
        auto r2 = pipe.run(p, freq.get());
        CHECK(r2.total_steps == 6);
        CHECK(r2.full_steps >= 1);
        CHECK(torch::isfinite(r2.image).all().item<bool>());
    }
    // A batch of three prompts with their own init images and masks: the caches see the whole CFG batch.
    auto models = case_models(mm, "anchorcache_cases/inpaint_batch");
    unet::Txt2ImgPipeline pipe(models);
    const fs::path dir = test::golden("sd/anchorcache_cases/inpaint_batch");
    auto p = tiny_params(unet::SamplerKind::Euler, 8, 0.6);
    p.prompts = {"a cat on a sofa", "a bowl of fruit", "a ship at sea"};
    p.init.init_images.clear();
    for (int k = 0; k < 3; ++k) {
        p.init.init_images.push_back((dir / ("init_image_" + std::to_string(k) + ".png")).string());
        p.init.masks.push_back((dir / ("mask_image_" + std::to_string(k) + ".png")).string());
    }
    auto r0 = pipe.run(p);
    for (const char* mode : {"deepcache:2", "freq"}) {
        INFO(mode);
        auto ctl = unet::parse_cache_mode(mode);
        auto r = pipe.run(p, ctl.get());
        CHECK(r.total_steps == 4);
        CHECK(r.image.sizes() == std::vector<int64_t>{3, 3, 16, 24});
        CHECK(torch::equal(r.initial_latents, r0.initial_latents));
        CHECK(torch::isfinite(r.image).all().item<bool>());
    }
}

TEST_CASE("img2img and inpaint refuse bad inputs, naming the field and the file", "[sd][img2img]") {
    sdgolden::Img2ImgModels mm;
    auto models = case_models(mm, "img2img_tiny");
    unet::Txt2ImgPipeline pipe(models);
    for (double s : {0.0, 1.5, -0.1}) {
        auto p = tiny_params(unet::SamplerKind::DDIM, 10, s);
        CHECK(param_error([&] { pipe.validate(p); }).first == "strength");
    }
    // int(10 * 0.05) = 0: no step would run
    auto [field, msg] = param_error([&] { pipe.validate(tiny_params(unet::SamplerKind::DDIM, 10, 0.05)); });
    CHECK(field == "strength");
    CHECK_THAT(msg, Catch::Contains("no denoising step"));
    auto p = tiny_params(unet::SamplerKind::DDIM, 10, 0.6);
    p.init.init_images = {"/nonexistent/init.png"};
    std::tie(field, msg) = param_error([&] { pipe.run(p); });
    CHECK(field == "init_image");
    CHECK_THAT(msg, Catch::Contains("/nonexistent/init.png"));
    // a file that is not an image
    p.init.init_images = {test::golden("sd/img2img_tiny/config.json")};
    std::tie(field, msg) = param_error([&] { pipe.run(p); });
    CHECK(field == "init_image");
    CHECK_THAT(msg, Catch::Contains("config.json"));
    // a mask of another size than the init image is refused with both sizes
    p = tiny_params(unet::SamplerKind::DDIM, 10, 0.6);
    p.init.masks = {test::golden("sd/pil_lanczos/mask_12x8.png")};
    std::tie(field, msg) = param_error([&] { pipe.run(p); });
    CHECK(field == "mask");
    CHECK_THAT(msg, Catch::Contains("12x8") && Catch::Contains("16x16"));
    // a mask without an init image
    p = tiny_params(unet::SamplerKind::DDIM, 10, 0.6);
    p.init.init_images.clear();
    p.init.masks = {test::golden("sd/inpaint_tiny/mask_image.png")};
    CHECK(param_error([&] { pipe.validate(p); }).first == "mask");
    // the model-independent checks alone (what anchor-sd runs before loading the model)
    unet::Img2ImgParams ip;
    ip.init_images = {test::golden("sd/img2img_tiny/init_image.png")};
    CHECK(ip.validate(10) == std::pair<int, int>{16, 16});
    ip.strength = 1.5;
    CHECK(param_error([&] { (void)ip.validate(10); }).first == "strength");
    ip.strength = 0.5;
    ip.masks = {test::golden("sd/pil_lanczos/mask_12x8.png")};
    CHECK(param_error([&] { (void)ip.validate(10); }).first == "mask");
    // a 9-channel UNet needs a mask
    auto m9 = case_models(mm, "inpaint_tiny", true);
    unet::Txt2ImgPipeline pipe9(m9);
    CHECK(param_error([&] { pipe9.validate(tiny_params(unet::SamplerKind::DDIM, 10, 0.6)); }).first == "mask");
}

TEST_CASE("img2img output size: the init image's rounded down to the VAE factor, or -W/-H with a Lanczos resize",
          "[sd][img2img]") {
    sdgolden::Img2ImgModels mm;
    auto models = case_models(mm, "img2img_tiny");
    unet::Txt2ImgPipeline pipe(models);
    auto p = tiny_params(unet::SamplerKind::Euler, 4, 0.5);
    p.init.init_images = {test::golden("sd/pil_lanczos/init_7x16.png")}; // 7 wide: 6 with factor 2
    auto r = pipe.resolved(p);
    CHECK(r.width == 6);
    CHECK(r.height == 16);
    p.width = 32, p.height = 16; // stretched to 32x16 (latents 16x8: even down to the tiny UNet's deepest level)
    auto res = pipe.run(p);
    CHECK(res.init.init_image.sizes() == std::vector<int64_t>{1, 3, 16, 32});
    CHECK(res.image_uint8.sizes() == std::vector<int64_t>{1, 16, 32, 3});
    const auto resized = unet::resize_lanczos(unet::read_image_rgb(p.init.init_images[0]), 32, 16);
    CHECK(torch::equal(res.init.init_image, unet::preprocess_image(resized, 32, 16)));
}

TEST_CASE("anchor-sd: -i repeated gives each line of --prompts-file its own init image, as diffusers' image=[...]",
          "[cli][sd][img2img]") {
    const fs::path gdir = test::golden("sd/anchorcache_cases/img2img_batch");
    const auto dir = test::scratch_dir("cli_sd_img2img_batch");
    {
        std::ofstream pf(dir + "/prompts.txt");
        pf << "a red fox in the snow\nan old lighthouse at dusk, oil painting\n";
    }
    const std::string png = dir + "/out.png", lat = dir + "/lat.safetensors";
    const std::string i0 = (gdir / "init_image_0.png").string(), i1 = (gdir / "init_image_1.png").string();
    auto r = test::run_program(test::sd_bin(),
                               {"-m", "assets/models/sd15-tiny-random", "--prompts-file", dir + "/prompts.txt", "-i", i0,
                                "-i", i1, "--batch-size", "2", "--strength", "0.7", "--sampler", "ddim", "--steps", "8",
                                "-s", "321", "--cfg-scale", "6.5", "-o", png, "--save-latents", lat, "--threads", "1",
                                "--overwrite"});
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    auto golden = WeightMap::load((gdir / "ddim8_strength0.7.safetensors").string());
    for (int k = 0; k < 2; ++k) {
        const std::string f = unet::Txt2ImgJob::numbered(lat, k);
        auto ours = SafeTensorsFile::open(f);
        CHECK(torch::equal(ours->tensor("initial_noise"), golden.get("noise").narrow(0, k, 1)));
        const auto fl = ours->tensor("final_latents").to(torch::kFloat64),
                   gl = golden.get("final_latents").narrow(0, k, 1).to(torch::kFloat64);
        CHECK((fl - gl).abs().max().item<double>() <= 1e-1 * gl.abs().max().item<double>());
        std::ifstream j(unet::Txt2ImgJob::numbered(png, k) + ".json");
        const auto rec = nlohmann::json::parse(j);
        CHECK(rec["init_image"]["file"] == (k ? i1 : i0));
        CHECK(rec["init_image"]["sha256"] == sha256_file(k ? i1 : i0));
    }
    // Three images for two prompts: refused before any model work, naming the counts.
    r = test::run_program(test::sd_bin(),
                          {"-m", "assets/models/sd15-tiny-random", "--prompts-file", dir + "/prompts.txt", "-i", i0, "-i",
                           i1, "-i", i0, "--batch-size", "2", "-o", dir + "/bad.png", "--threads", "1"});
    CHECK(r.exit_code != 0);
    CHECK_THAT(r.output, Catch::Contains("3 init images"));
}

TEST_CASE("anchor-sd -i --strength runs img2img and --mask inpaint, recording the inputs", "[cli][sd][img2img]") {
    const auto dir = test::scratch_dir("cli_sd_img2img");
    const std::string png = dir + "/img.png", lat = dir + "/img.safetensors";
    auto r = test::run_program(test::sd_bin(), {"-m",
                                                "assets/models/sd15-tiny-random",
                                                "-i",
                                                test::golden("sd/img2img_tiny/init_image.png"),
                                                "--strength",
                                                "0.6",
                                                "--sampler",
                                                "ddim",
                                                "--steps",
                                                "10",
                                                "-s",
                                                "42",
                                                "-p",
                                                "a photo of an astronaut riding a horse on mars",
                                                "-o",
                                                png,
                                                "--save-latents",
                                                lat,
                                                "--threads",
                                                "1",
                                                "--overwrite"});
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    REQUIRE(fs::exists(png));
    auto ours = SafeTensorsFile::open(lat);
    auto golden = WeightMap::load(test::golden("sd/img2img_tiny/ddim10_strength0.6.safetensors"));
    CHECK(torch::equal(ours->tensor("initial_noise"), golden.get("noise")));
    const auto fl = ours->tensor("final_latents").to(torch::kFloat64),
               gl = golden.get("final_latents").to(torch::kFloat64);
    CHECK((fl - gl).abs().max().item<double>() <= 1e-1 * gl.abs().max().item<double>());
    std::ifstream f(png + ".json");
    const auto rec = nlohmann::json::parse(f);
    CHECK(rec["mode"] == "img2img");
    CHECK(rec["strength"] == 0.6);
    CHECK(rec["first_step"] == 4);
    CHECK(rec["unet_steps"] == 6);
    CHECK(rec["init_image"]["sha256"] == sha256_file(test::golden("sd/img2img_tiny/init_image.png")));

    const std::string png2 = dir + "/inpaint.png";
    r = test::run_program(test::sd_bin(),
                          {"-m", "assets/models/sd15-tiny-random", "-i", test::golden("sd/inpaint_tiny/init_image.png"),
                           "--mask", test::golden("sd/inpaint_tiny/mask_image.png"), "--strength", "0.75", "--sampler",
                           "euler", "--steps", "10", "-p", "a photo of an astronaut riding a horse on mars", "-o", png2,
                           "--threads", "1", "--overwrite"});
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    std::ifstream f2(png2 + ".json");
    const auto rec2 = nlohmann::json::parse(f2);
    CHECK(rec2["mode"] == "inpaint");
    CHECK(rec2["mask"]["sha256"] == sha256_file(test::golden("sd/inpaint_tiny/mask_image.png")));
    CHECK(rec2["unet_steps"] == 7);

    // bad strength: exit 2 naming the option
    r = test::run_program(test::sd_bin(),
                          {"-m", "assets/models/sd15-tiny-random", "-i", test::golden("sd/img2img_tiny/init_image.png"),
                           "--strength", "1.5", "-p", "x", "-o", dir + "/bad.png", "--threads", "1"});
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.output, Catch::Contains("--strength"));
    r = test::run_program(test::sd_bin(), {"-m", "assets/models/sd15-tiny-random", "-i", dir + "/missing.png", "-p",
                                           "x", "-o", dir + "/bad.png", "--threads", "1"});
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.output, Catch::Contains("missing.png"));
}

TEST_CASE("anchor-sd --compare on inpaint with two LoRAs: the report records every input with its hash",
          "[cli][sd][img2img][lora]") {
    const auto dir = test::scratch_dir("cli_sd_compare_inpaint");
    const std::string init = test::golden("sd/inpaint_tiny/init_image.png"),
                      mask = test::golden("sd/inpaint_tiny/mask_image.png"),
                      lora_a = test::golden("sd/lora_sd15_tiny/lora_kohya_a.safetensors"),
                      lora_c = test::golden("sd/lora_sd15_tiny/lora_peft_c.safetensors"), png = dir + "/cmp.png";
    auto r = test::run_program(test::sd_bin(), {"-m",         "assets/models/sd15-tiny-random",
                                                "-i",         init,
                                                "--mask",     mask,
                                                "--strength", "0.75",
                                                "--steps",    "8",
                                                "--sampler",  "ddim",
                                                "-p",         "a cat",
                                                "--lora",     lora_a + ":0.8",
                                                "--lora",     lora_c + ":-0.5",
                                                "--compare",  "off,deepcache:2",
                                                "-o",         png,
                                                "--threads",  "1"});
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    std::ifstream f(dir + "/cmp_report.json");
    const auto rep = nlohmann::json::parse(f);
    CHECK(rep["mode"] == "inpaint");
    CHECK(rep["prompt"] == "a cat");
    CHECK(rep["strength"] == 0.75);
    CHECK(rep["sampler"] == "ddim");
    CHECK(rep["init_image"]["sha256"] == sha256_file(init));
    CHECK(rep["mask"]["sha256"] == sha256_file(mask));
    REQUIRE(rep["loras"].size() == 2);
    CHECK(rep["loras"][0]["sha256"] == sha256_file(lora_a));
    CHECK(rep["loras"][0]["multiplier"] == 0.8);
    CHECK(rep["loras"][1]["sha256"] == sha256_file(lora_c));
    CHECK(rep["loras"][1]["multiplier"] == -0.5);
}
