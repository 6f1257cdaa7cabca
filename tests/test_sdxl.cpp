// SDXL (unet/model/checkpoint.h, unet/pipeline/pipeline.h): tokenizer_2's padding, the zero negative conditioning, the
// micro-conditioning time ids, family detection from shapes, both file layouts giving the same images, and the
// goldens of tests/golden/sd/sdxl_tiny through tests/sdxl_golden.h.
#include "cache/io/error.h"
#include "cache/io/safetensors.h"
#include "cache/io/weight_map.h"
#include "cache/io/yaml_lite.h"
#include "tests/sd_golden_checks.h"
#include "tests/sdxl_golden.h"
#include "tests/test_util.h"
#include "unet/model/checkpoint.h"
#include "unet/pipeline/pipeline.h"

#include <catch2/catch.hpp>

#include <filesystem>

using namespace anchor;
using namespace anchor::unet;
namespace fs = std::filesystem;

namespace {

using test::error_of;

const std::string kFolder = test::golden("sd/sdxl_tiny");
const std::string kSingle = test::golden("sd/sdxl_tiny_single_file/sdxl_tiny_single_file.safetensors");

SDModels& folder_models() {
    static SDModels m = load_sd_models(kFolder);
    return m;
}

void check_all(const std::vector<sdgolden::Comparison>& cs) {
    for (const auto& c : cs) sdgolden::check_comparison("sdxl", c);
}

Txt2ImgParams small_run() {
    Txt2ImgParams p;
    p.prompts = {"a photo of an astronaut riding a horse on mars"};
    p.width = p.height = 16;
    p.steps = 2;
    p.guidance_scale = 5.0;
    p.sampler = SamplerKind::Euler;
    p.prompt_syntax = PromptSyntax::Plain;
    return p;
}

} // namespace

TEST_CASE("SDXL loads as its family, tokenizer_2 pads with '!'", "[sdxl]") {
    auto& m = folder_models();
    CHECK(m.family == SdFamily::SDXL);
    CHECK(m.force_zeros_for_empty_prompt);
    REQUIRE(m.text_encoder_2);
    CHECK(m.text_encoder_2->config().projection_dim == 24);
    CHECK(m.text_encoder_2->config().hidden_act == "gelu");
    CHECK(m.text_encoder->config().hidden_act == "quick_gelu");
    const auto a = m.tokenizer.tokenize("a cat", 77), b = m.tokenizer_2.tokenize("a cat", 77);
    CHECK(a.ids[3] == ClipTokenizer::kEos);
    CHECK(a.ids[4] == ClipTokenizer::kEos);
    CHECK(b.ids[3] == ClipTokenizer::kEos);
    CHECK(b.ids[4] == 0);
    CHECK(std::vector<int64_t>(a.ids.begin(), a.ids.begin() + 4) ==
          std::vector<int64_t>(b.ids.begin(), b.ids.begin() + 4));
}

TEST_CASE("SDXL goldens: text encoders, UNet features, VAE, both pipeline runs", "[sdxl][golden]") {
    auto& m = folder_models();
    check_all(sdgolden::compare_sdxl_text(m, kFolder));
    check_all(sdgolden::compare_sdxl_unet(*m.unet, kFolder, true));
    check_all(sdgolden::compare_sdxl_vae(*m.vae, kFolder));
    for (const auto& run : sdgolden::sdxl_runs(kFolder)) {
        INFO(run);
        check_all(sdgolden::compare_sdxl_run(m, kFolder, run));
    }
}

TEST_CASE("SDXL negative conditioning: zeros without a negative prompt, and only then", "[sdxl]") {
    auto& m = folder_models();
    Txt2ImgPipeline pipe(m);
    c10::InferenceMode guard;
    auto p = small_run();
    const auto none = pipe.encode_conditioning(p, true, nullptr);
    REQUIRE(none.context.size(0) == 2);
    CHECK(none.context[0].abs().max().item<double>() == 0.0);
    CHECK(none.text_embeds[0].abs().max().item<double>() == 0.0);
    CHECK(none.context[1].abs().max().item<double>() > 0.0);
    p.negative_prompts = {""}; // an explicit empty prompt is encoded, as diffusers' negative_prompt=""
    const auto empty = pipe.encode_conditioning(p, true, nullptr);
    CHECK(empty.context[0].abs().max().item<double>() > 0.0);
    Txt2ImgParams q = p;
    q.prompts = {""};
    const auto enc = pipe.encode_conditioning(q, false, nullptr);
    CHECK(torch::equal(empty.context[0], enc.context[0]));
    CHECK(torch::equal(empty.text_embeds[0], enc.text_embeds[0]));
    // The second encoder's own prompt changes only its half of the context.
    q.prompts_2 = {"a red cube"};
    const auto two = pipe.encode_conditioning(q, false, nullptr);
    CHECK(torch::equal(two.context.narrow(-1, 0, 16), enc.context.narrow(-1, 0, 16)));
    CHECK(!torch::equal(two.context.narrow(-1, 16, 32), enc.context.narrow(-1, 16, 32)));
}

TEST_CASE("SDXL micro-conditioning time ids", "[sdxl]") {
    auto& m = folder_models();
    Txt2ImgPipeline pipe(m);
    auto p = small_run();
    p.width = 24; // (height, width) order as diffusers
    auto ids = pipe.sdxl_time_ids(p, 1, false);
    CHECK(torch::equal(ids, torch::tensor({16.f, 24.f, 0.f, 0.f, 16.f, 24.f}).unsqueeze(0)));
    p.original_size = std::array<int, 2>{512, 768};
    p.crop = {16, 8};
    p.negative_original_size = std::array<int, 2>{256, 256}; // alone: ignored, as in diffusers
    ids = pipe.sdxl_time_ids(p, 2, true);
    REQUIRE(ids.sizes() == torch::IntArrayRef({4, 6}));
    const auto pos = torch::tensor({512.f, 768.f, 16.f, 8.f, 16.f, 24.f});
    for (int r = 0; r < 4; ++r) CHECK(torch::equal(ids[r], pos));
    p.negative_target_size = std::array<int, 2>{16, 16};
    ids = pipe.sdxl_time_ids(p, 2, true);
    const auto neg = torch::tensor({256.f, 256.f, 0.f, 0.f, 16.f, 16.f});
    CHECK(torch::equal(ids[0], neg)); // cat([neg, pos]).repeat(images, 1)
    CHECK(torch::equal(ids[1], pos));
    CHECK(torch::equal(ids[2], neg));
    // The UNet sees them: another original size gives another noise prediction.
    c10::InferenceMode guard;
    auto x = torch::randn({1, 4, 8, 8});
    auto ctx = torch::randn({1, 77, 48}), pooled = torch::randn({1, 24});
    auto a = m.unet->forward(x, torch::tensor(500.0),
                             UNetCond{ctx, pooled, torch::tensor({{16.f, 16.f, 0.f, 0.f, 16.f, 16.f}})});
    auto b = m.unet->forward(x, torch::tensor(500.0),
                             UNetCond{ctx, pooled, torch::tensor({{512.f, 512.f, 0.f, 0.f, 16.f, 16.f}})});
    CHECK(test::max_abs_diff(a, b) > 1e-4);
    // Without the added conditioning an SDXL UNet refuses to run; SD parameters on SD 1.x are refused by name.
    CHECK(error_of([&] { m.unet->forward(x, torch::tensor(500.0), ctx); }).find("text_embeds") != std::string::npos);
    CHECK(error_of([&] {
              m.unet->forward(x, torch::tensor(500.0), UNetCond{ctx, pooled, torch::zeros({1, 5})});
          }).find("add_embedding") != std::string::npos);
    p.original_size = std::array<int, 2>{0, 512};
    CHECK(error_of([&] { pipe.validate(p); }).find("original_size") != std::string::npos);
}

TEST_CASE("SD micro-conditioning options are refused on SD 1.x", "[sdxl]") {
    SDModels m = load_sd_models(std::string(ANCHOR_SOURCE_DIR) + "/assets/models/sd15-tiny-random");
    Txt2ImgPipeline pipe(m);
    auto p = small_run();
    p.width = p.height = 0;
    p.target_size = std::array<int, 2>{64, 64};
    const auto e = error_of([&] { pipe.validate(p); });
    CHECK(e.find("target_size") != std::string::npos);
    CHECK(e.find("sd1") != std::string::npos);
}

TEST_CASE("SDXL family from shapes: SD1, SD2, SDXL, refiner; the refiner is refused naming the tensor", "[sdxl]") {
    SdShapes s;
    s.text_width = 768;
    s.cross_attention_dim = 768;
    CHECK(sd_family(s) == SdFamily::SD1);
    s.text_width = 1024, s.cross_attention_dim = 1024, s.linear_projection = true;
    CHECK(sd_family(s) == SdFamily::SD2);
    s.added_conditioning = true, s.text_width = 768, s.second_text_width = 1280, s.cross_attention_dim = 2048;
    CHECK(sd_family(s) == SdFamily::SDXL);
    s.text_width = 0, s.cross_attention_dim = 1280;
    CHECK(sd_family(s) == SdFamily::SDXLRefiner);
    // The golden single file with its first text encoder removed and the second one where a refiner keeps it.
    auto file = WeightMap::load(kSingle);
    NamedTensors out;
    for (const auto& [n, t] : file.all()) {
        if (n.rfind("conditioner.embedders.0.", 0) == 0) continue;
        std::string name = n;
        if (name.rfind("conditioner.embedders.1.", 0) == 0) name.replace(0, 24, "conditioner.embedders.0.");
        out.emplace_back(name, t);
    }
    const auto dir = test::scratch_dir("sdxl_refiner");
    save_safetensors(dir + "/refiner.safetensors", out);
    const auto e = error_of([&] { load_sd_models(dir + "/refiner.safetensors"); });
    CHECK(e.find("refiner") != std::string::npos);
    CHECK(e.find("model.diffusion_model.label_emb.0.0.weight") != std::string::npos);
    // A UNet config with another added conditioning is refused naming the field.
    auto cfg = sdgolden::read_json_file(kFolder + "/unet/config.json");
    cfg["addition_embed_type"] = "image";
    CHECK(error_of([&] { UNetConfig::from_json(cfg, "unet/config.json"); }).find("addition_embed_type") !=
          std::string::npos);
}

TEST_CASE("SDXL: the diffusers folder and the SGM single file give the same image", "[sdxl][single_file]") {
    SDModels sf = load_sd_models(kSingle);
    CHECK(sf.family == SdFamily::SDXL);
    CHECK(sf.layout == "single-file");
    CHECK(sf.vae->config().scaling_factor == 0.13025);
    CHECK(sf.vae->config().force_upcast);
    // The tiny model's 16-channel heads come from the <stem>.yaml next to the file.
    CHECK(sf.unet->config().heads == std::vector<int>{2, 2, 4});
    CHECK(read_original_config(kSingle).addition_time_embed_dim == 8);
    sf.scheduler_config_path = kFolder + "/scheduler/scheduler_config.json";
    auto p = small_run();
    Txt2ImgPipeline a(folder_models()), b(sf);
    const auto ra = a.run(p), rb = b.run(p);
    CHECK(torch::equal(ra.final_latents, rb.final_latents));
    CHECK(torch::equal(ra.image_uint8, rb.image_uint8));
}

TEST_CASE("yaml_lite reads the LDM/SGM config subset", "[sdxl][yaml]") {
    const auto j =
        parse_yaml_lite("model:\n  params:\n    scale_factor: 0.13025  # comment\n    list:\n    - 1\n    - 2\n"
                        "    flow: [4, 2]\n    items:\n      - target: a.B\n        params:\n          outdim: 8\n"
                        "      - name: 'x: y'\n",
                        "test.yaml");
    CHECK(j["model"]["params"]["scale_factor"].get<double>() == 0.13025);
    CHECK(j["model"]["params"]["list"] == nlohmann::json::array({1, 2}));
    CHECK(j["model"]["params"]["flow"] == nlohmann::json::array({4, 2}));
    CHECK(j["model"]["params"]["items"][0]["params"]["outdim"].get<int>() == 8);
    CHECK(j["model"]["params"]["items"][1]["name"].get<std::string>() == "x: y");
    CHECK(error_of([] { parse_yaml_lite("a: &anchor 1\n", "bad.yaml"); }).find("bad.yaml' line 1") !=
          std::string::npos);
}

#include "tests/test_cli_util.h"

#include <fstream>

TEST_CASE("anchor-sd --compare off,deepcache:3,freq on SDXL, both layouts: grid, timeline, report", "[cli][sdxl]") {
    const auto dir = test::scratch_dir("cli_sdxl_compare");
    for (const auto& [model, name] : {std::pair{kFolder, "folder"}, std::pair{kSingle, "single"}}) {
        const std::string png = dir + "/" + name + ".png";
        auto r = test::run_program(test::sd_bin(), {"-m",
                                                    model,
                                                    "-p",
                                                    "a photo of an astronaut riding a horse on mars",
                                                    "-W",
                                                    "16",
                                                    "-H",
                                                    "16",
                                                    "--steps",
                                                    "8",
                                                    "--sampler",
                                                    "euler",
                                                    "--cfg-scale",
                                                    "5",
                                                    "--original-size",
                                                    "768,512",
                                                    "--crop",
                                                    "8,16",
                                                    "--compare",
                                                    "off,deepcache:3,freq",
                                                    "-o",
                                                    png,
                                                    "--threads",
                                                    "1"});
        INFO(r.output);
        REQUIRE(r.exit_code == 0);
        CHECK(fs::exists(png));
        CHECK(fs::exists(dir + "/" + name + "_timeline.png"));
        std::ifstream f(dir + "/" + name + "_report.json");
        const auto rep = nlohmann::json::parse(f);
        CHECK(rep["model_family"] == "sdxl");
        // --original-size W,H and --crop X,Y become diffusers' (height, width) / (top, left) time ids.
        CHECK(rep["sdxl"]["time_ids"] == nlohmann::json::array({512.0, 768.0, 16.0, 8.0, 16.0, 16.0}));
        REQUIRE(rep["modes"].size() == 3);
    }
    // A usage error names the option.
    auto bad = test::run_program(test::sd_bin(),
                                 {"-m", kFolder, "-p", "a", "--original-size", "768x512", "-o", dir + "/bad.png"});
    CHECK(bad.exit_code == 2);
    CHECK(bad.output.find("--original-size") != std::string::npos);
}
