// --prompt-from with issue 59's options: every sampler (and the A1111 names its infotext writes), the timestep
// spacing, the TAESD decoder and VAE tiling come back from a PNG's record, and a PNG made with them is made again
// from the PNG alone.
#include "cache/io/png_text.h"
#include "tests/test_cli_util.h"
#include "tests/test_util.h"
#include "unet/pipeline/infotext.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <fstream>

using namespace anchor;
using namespace anchor::unet;
namespace fs = std::filesystem;

namespace {

// The image chunks of a PNG file (everything but its text chunks): two runs with the same pixels agree here.
std::string fewstep_png_pixels(const std::string& path) { return test::png_image_chunks(test::read_bytes(path)); }

nlohmann::json fewstep_sidecar(const std::string& png) {
    std::ifstream f(png + ".json");
    return nlohmann::json::parse(f);
}

} // namespace

TEST_CASE("every sampler comes back from its record and from the A1111 infotext it writes", "[png][samplers]") {
    InfotextFacts facts;
    facts.model_hash = "0123456789";
    facts.model_name = "m";
    for (const auto& [name, kind] : sampler_table()) {
        if (kind == SamplerKind::FlowMatchEuler) continue; // SD 3 only; no A1111 name
        INFO(name);
        const nlohmann::json record{{"prompt", "p"}, {"sampler", name}};
        CHECK(image_parameters_from_record(record, "record").sampler == kind);
        Txt2ImgParams p;
        p.prompts = {"p"};
        p.sampler = kind;
        p.steps = 4;
        p.width = p.height = 64;
        const auto ip = image_parameters_from_infotext(format_infotext(infotext_of(p, 0, facts)), "infotext");
        REQUIRE(ip.sampler);
        // A1111 writes DPM++ 2M Karras as "DPM++ 2M" + "Schedule type: Karras": either spelling runs the same.
        if (kind == SamplerKind::DPMPP2MKarras)
            CHECK((*ip.sampler == kind || (*ip.sampler == SamplerKind::DPMPP2M && ip.schedule == NoiseSchedule::Karras)));
        else
            CHECK(*ip.sampler == kind);
    }
    for (const auto& [alias, kind] : sampler_alias_table()) {
        INFO(alias);
        CHECK(image_parameters_from_record({{"sampler", alias}}, "record").sampler == kind);
    }
}

TEST_CASE("a record's timestep spacing, TAESD decoder and VAE tiling are read back", "[png]") {
    const nlohmann::json record{{"prompt", "p"},
                                {"timestep_spacing", "trailing"},
                                {"vae_decoder", "taesd"},
                                {"vae_tiling", {{"tile_size", 256}, {"overlap", 0.5}}}};
    const auto ip = image_parameters_from_record(record, "record");
    CHECK(ip.timestep_spacing == TimestepSpacing::Trailing);
    CHECK(ip.vae_decoder == VaeDecoder::Taesd);
    REQUIRE(ip.vae_tiling);
    CHECK(ip.vae_tiling->enabled);
    CHECK(ip.vae_tiling->tile_sample_size == 256);
    CHECK(ip.vae_tiling->overlap == 0.5);
    const auto none = image_parameters_from_record({{"prompt", "p"}}, "record");
    CHECK_FALSE(none.timestep_spacing);
    CHECK_FALSE(none.vae_decoder);
    CHECK_FALSE(none.vae_tiling);
    const auto odd = image_parameters_from_record({{"vae_decoder", "other"}, {"timestep_spacing", "x"}}, "record");
    CHECK_FALSE(odd.vae_decoder);
    CHECK_FALSE(odd.timestep_spacing);
    CHECK(odd.notes.size() == 2);
}

TEST_CASE("anchor-sd --prompt-from remakes a few-step TAESD image and a VAE-tiled one from the PNG alone", "[png][cli]") {
    const auto dir = test::scratch_dir("cli_prompt_from_fewstep");
    // The tiny model with a TAESD beside it (found by --vae-decoder taesd): links to the stored folders.
    const fs::path model = fs::path(dir) / "model";
    fs::create_directories(model);
    const fs::path src = fs::path(ANCHOR_SOURCE_DIR) / "assets/models/sd15-tiny-random";
    for (const auto& e : fs::directory_iterator(src)) fs::create_symlink(e.path(), model / e.path().filename());
    fs::create_directory_symlink(fs::path(ANCHOR_SOURCE_DIR) / "tests/golden/sd/anchorcache_cases/taesd_pipeline/taesd",
                                 model / "taesd");
    const std::vector<std::string> common{"-m", model.string(), "--threads", "1"};
    auto with = [&](std::vector<std::string> a) {
        a.insert(a.end(), common.begin(), common.end());
        return a;
    };

    SECTION("an A1111 sampler name, trailing spacing, guidance 1 and the TAESD decoder") {
        const std::string png = dir + "/turbo.png", again = dir + "/turbo_again.png";
        auto r = test::run_program(test::sd_bin(), with({"-p", "a fox", "--steps", "2", "--sampler", "DPM++ 2M SDE",
                                                         "--timestep-spacing", "trailing", "--cfg-scale", "1",
                                                         "--vae-decoder", "taesd", "-W", "32", "-H", "32", "-s", "5",
                                                         "-o", png}));
        INFO(r.output);
        REQUIRE(r.exit_code == 0);
        const auto first = fewstep_sidecar(png);
        CHECK(first["vae_decoder"] == "taesd");
        CHECK(first["timestep_spacing"] == "trailing");
        CHECK(first["sampler"] == "dpmpp_2m_sde");
        r = test::run_program(test::sd_bin(), with({"--prompt-from", png, "-o", again}));
        INFO(r.output);
        REQUIRE(r.exit_code == 0);
        const auto second = fewstep_sidecar(again);
        for (const char* k : {"vae_decoder", "timestep_spacing", "sampler", "cfg_scale", "steps", "seed"}) {
            INFO(k);
            CHECK(second[k] == first[k]);
        }
        CHECK(fewstep_png_pixels(again) == fewstep_png_pixels(png));
        // An option given on the command line wins over the record.
        const std::string full = dir + "/turbo_full.png";
        r = test::run_program(test::sd_bin(), with({"--prompt-from", png, "--vae-decoder", "full", "-o", full}));
        REQUIRE(r.exit_code == 0);
        CHECK_FALSE(fewstep_sidecar(full).contains("vae_decoder"));
        CHECK(fewstep_png_pixels(full) != fewstep_png_pixels(png));
    }

    SECTION("VAE tiling with its tile size and overlap") {
        const std::string png = dir + "/tiled.png", again = dir + "/tiled_again.png";
        auto r = test::run_program(test::sd_bin(), with({"-p", "a fox", "--steps", "2", "--sampler", "lcm",
                                                         "--cfg-scale", "1", "--vae-tile-size", "16",
                                                         "--vae-tile-overlap", "0.25", "-W", "32", "-H", "32", "-s",
                                                         "6", "-o", png}));
        INFO(r.output);
        REQUIRE(r.exit_code == 0);
        const auto first = fewstep_sidecar(png);
        REQUIRE(first.contains("vae_tiling"));
        r = test::run_program(test::sd_bin(), with({"--prompt-from", png, "-o", again}));
        INFO(r.output);
        REQUIRE(r.exit_code == 0);
        const auto second = fewstep_sidecar(again);
        CHECK(second["vae_tiling"] == first["vae_tiling"]);
        CHECK(second["sampler"] == "lcm");
        CHECK(fewstep_png_pixels(again) == fewstep_png_pixels(png));
    }
}
