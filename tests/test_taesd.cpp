// TAESD (unet/model/taesd.h): the two file layouts load to the same tensors, bad files fail with one clear error, and
// the pipeline decodes and previews with it. Its outputs against diffusers are golden_runner's (check_taesd.cpp on
// ../shared/golden/sd/taesd_tiny).
#include "cache/io/safetensors.h"
#include "cache/io/weight_map.h"
#include "tests/test_cli_util.h"
#include "tests/test_util.h"
#include "tests/tiny_sd_run.h"
#include "unet/model/taesd.h"
#include "unet/pipeline/preview.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>

using namespace anchor;
using namespace anchor::unet;
namespace fs = std::filesystem;

namespace {

// A small TAESD of `levels` levels (image factor 2^(levels-1)), random weights.
TaesdConfig taesd_small_config(int levels, int latent_channels = 4) {
    TaesdConfig c;
    c.latent_channels = latent_channels;
    c.encoder_block_out_channels.assign(size_t(levels), 8);
    c.decoder_block_out_channels.assign(size_t(levels), 8);
    c.num_encoder_blocks.assign(size_t(levels), 1);
    c.num_decoder_blocks.assign(size_t(levels), 1);
    c.num_decoder_blocks[0] = 2; // the two coders' orders differ: catches a swapped detection
    return c;
}

// Writes `m` as a diffusers AutoencoderTiny folder (config.json + diffusion_pytorch_model.safetensors).
void save_taesd_diffusers(AutoencoderTinyImpl& m, const std::string& dir) {
    fs::create_directories(dir);
    const auto& c = m.config();
    const nlohmann::json j = {{"_class_name", "AutoencoderTiny"},
                              {"act_fn", "relu"},
                              {"latent_channels", c.latent_channels},
                              {"encoder_block_out_channels", c.encoder_block_out_channels},
                              {"decoder_block_out_channels", c.decoder_block_out_channels},
                              {"num_encoder_blocks", c.num_encoder_blocks},
                              {"num_decoder_blocks", c.num_decoder_blocks},
                              {"upsampling_scaling_factor", c.upsampling_scaling_factor},
                              {"scaling_factor", 1.0}};
    std::ofstream(dir + "/config.json") << j.dump(2);
    NamedTensors t;
    for (const auto& item : m.named_parameters()) t.emplace_back(item.key(), item.value().detach().clone());
    save_safetensors(dir + "/diffusion_pytorch_model.safetensors", t);
}

// madebyollin's layout written by hand (the table under test is not used): the encoder's Sequential index is
// diffusers' layer index, the decoder's is one more (its index 0 is the clamp).
void save_taesd_single_files(AutoencoderTinyImpl& m, const std::string& dir, const std::string& stem = "taesd") {
    fs::create_directories(dir);
    NamedTensors enc, dec;
    for (const auto& item : m.named_parameters()) {
        const std::string& n = item.key();
        const bool is_dec = n.rfind("decoder.layers.", 0) == 0;
        const std::string rest = n.substr(15); // after "encoder.layers." / "decoder.layers."
        const auto dot = rest.find('.');
        const int i = std::stoi(rest.substr(0, dot)) + (is_dec ? 1 : 0);
        (is_dec ? dec : enc).emplace_back(std::to_string(i) + rest.substr(dot), item.value().detach().clone());
    }
    save_safetensors(dir + "/" + stem + "_encoder.safetensors", enc);
    save_safetensors(dir + "/" + stem + "_decoder.safetensors", dec);
}

void check_same_taesd_tensors(AutoencoderTinyImpl& a, AutoencoderTinyImpl& b) {
    auto pa = a.named_parameters(), pb = b.named_parameters();
    REQUIRE(pa.size() == pb.size());
    for (const auto& item : pa) {
        INFO(item.key());
        REQUIRE(pb.contains(item.key()));
        CHECK(torch::equal(pb[item.key()], item.value()));
    }
}

} // namespace

TEST_CASE("TAESD: madebyollin's single-file names load to the same tensors as the diffusers layout", "[sd][taesd]") {
    torch::manual_seed(5);
    AutoencoderTiny m(taesd_small_config(4));
    const std::string dir = test::scratch_dir("taesd_layouts");
    save_taesd_diffusers(*m, dir + "/diffusers");
    save_taesd_single_files(*m, dir + "/single");

    auto from_folder = load_taesd(dir + "/diffusers");
    auto from_weights_file = load_taesd(dir + "/diffusers/diffusion_pytorch_model.safetensors");
    auto from_decoder = load_taesd(dir + "/single/taesd_decoder.safetensors"); // finds its encoder beside it
    auto from_single_folder = load_taesd(dir + "/single");
    for (auto* other : {&from_folder, &from_weights_file, &from_decoder, &from_single_folder}) {
        CHECK((*other)->has_encoder());
        CHECK((*other)->has_decoder());
        check_same_taesd_tensors(*m, **other);
        CHECK((*other)->config().num_encoder_blocks == m->config().num_encoder_blocks);
        CHECK((*other)->config().num_decoder_blocks == m->config().num_decoder_blocks);
    }
    torch::NoGradGuard ng;
    const auto z = torch::randn({1, 4, 3, 5});
    CHECK(torch::equal(from_decoder->decode(z), m->decode(z)));
    CHECK(from_decoder->decode(z).sizes() == torch::IntArrayRef({1, 3, 24, 40}));
    const auto x = torch::rand({1, 3, 16, 24}) * 2 - 1;
    CHECK(torch::equal(from_decoder->encode(x), m->encode(x)));

    // The table itself, and a decoder file alone (no encoder beside it).
    CHECK(taesd_single_file_name("3.conv.0.weight", true) == "decoder.layers.2.conv.0.weight");
    CHECK(taesd_single_file_name("3.conv.0.weight", false) == "encoder.layers.3.conv.0.weight");
    CHECK(taesd_single_file_name("0.weight", true).empty());
    CHECK(taesd_single_file_name("decoder.layers.0.weight", true).empty());
    fs::remove(dir + "/single/taesd_encoder.safetensors");
    auto dec_only = load_taesd(dir + "/single/taesd_decoder.safetensors");
    CHECK(dec_only->has_decoder());
    CHECK(!dec_only->has_encoder());
    CHECK(test::error_of([&] { dec_only->encode(x); }).find("has no encoder") != std::string::npos);
}

TEST_CASE("TAESD: bad files are one error naming the file and what is wrong", "[sd][taesd]") {
    torch::manual_seed(6);
    const std::string dir = test::scratch_dir("taesd_bad");
    AutoencoderTiny m(taesd_small_config(2));
    save_taesd_single_files(*m, dir + "/single");
    // Every missing tensor at once.
    {
        auto w = WeightMap::load(dir + "/single/taesd_decoder.safetensors");
        NamedTensors kept;
        for (const auto& n : w.names())
            if (n != "3.conv.0.weight" && n != "4.conv.2.bias") kept.emplace_back(n, w.get(n));
        fs::create_directories(dir + "/missing");
        save_safetensors(dir + "/missing/taesd_decoder.safetensors", kept);
        const auto e = test::error_of([&] { load_taesd(dir + "/missing/taesd_decoder.safetensors"); });
        INFO(e);
        CHECK(e.find(dir + "/missing/taesd_decoder.safetensors") != std::string::npos);
        CHECK(e.find("decoder.layers.2.conv.0.weight") != std::string::npos); // file index 3: the first block
        CHECK(e.find("decoder.layers.3.conv.2.bias") != std::string::npos);
    }
    // Not a TAESD.
    {
        save_safetensors(dir + "/other.safetensors", {{"model.weight", torch::zeros({2, 2})}});
        const auto e = test::error_of([&] { load_taesd(dir + "/other.safetensors"); });
        INFO(e);
        CHECK(e.find("no TAESD weights") != std::string::npos);
        CHECK(test::error_of([&] { load_taesd(dir + "/nothing_here"); }).find("nothing_here") != std::string::npos);
    }
    // A TAESD of another latent channel count than the UNet's: the file, expected and actual.
    {
        AutoencoderTiny wide(taesd_small_config(2, 16));
        save_taesd_diffusers(*wide, dir + "/taesd16");
        SDModels models = test::deepcache_models();
        const auto e = test::error_of([&] { attach_taesd(models, dir + "/taesd16", "unused"); });
        INFO(e);
        CHECK(e.find(dir + "/taesd16") != std::string::npos);
        CHECK(e.find("latent_channels expected 4") != std::string::npos);
        CHECK(e.find("got 16") != std::string::npos);
        CHECK(!models.taesd);
        // No TAESD next to the model: every place looked at is named.
        fs::create_directories(dir + "/model_without_taesd");
        const auto none = test::error_of([&] { attach_taesd(models, "", dir + "/model_without_taesd"); });
        INFO(none);
        CHECK(none.find(dir + "/model_without_taesd/taesd_decoder.safetensors") != std::string::npos);
    }
}

TEST_CASE("TAESD decodes the pipeline's final image and its previews; the projection without it", "[sd][taesd]") {
    torch::manual_seed(7);
    SDModels models = test::deepcache_models();
    const std::string dir = test::scratch_dir("taesd_pipeline");
    const int levels = 1 + int(std::log2(models.vae_scale_factor()));
    AutoencoderTiny t(taesd_small_config(levels));
    save_taesd_diffusers(*t, dir + "/model/taesd");
    Txt2ImgPipeline pipe(models);
    auto p = test::tiny_params(4, SamplerKind::Euler);

    // Without a TAESD: taesd is refused naming the field, previews are the latent projection.
    p.vae_decoder = VaeDecoder::Taesd;
    CHECK(test::error_of([&] { pipe.run(p); }).find("vae_decoder") != std::string::npos);
    p.vae_decoder = VaeDecoder::Full;
    std::vector<std::string> pngs;
    PreviewHook projection(models, 2, [&](const std::string& png, int, int) { pngs.push_back(png); });
    CHECK(projection.method() == PreviewMethod::LatentProjection);
    const auto full = pipe.run(p, nullptr, [&](const ProgressInfo& pi) { projection(pi); });
    CHECK(pngs.size() == 2); // steps 2 and 4
    CHECK(pngs[0].compare(0, 8, "\x89PNG\r\n\x1a\n") == 0);

    // Found next to the model (taesd/ beside the folder of a "model" path inside dir).
    CHECK(find_taesd(dir + "/model", false) == dir + "/model/taesd");
    attach_taesd(models, "", dir + "/model");
    REQUIRE(models.taesd);
    p.vae_decoder = VaeDecoder::Taesd;
    pngs.clear();
    PreviewHook previews(models, 3, [&](const std::string& png, int step, int total) {
        CHECK(total == 4);
        pngs.push_back(png + std::to_string(step));
    });
    CHECK(previews.method() == PreviewMethod::Taesd);
    const auto r = pipe.run(p, nullptr, [&](const ProgressInfo& pi) { previews(pi); });
    CHECK(pngs.size() == 2); // step 3 and the last
    // The same latents as the full-VAE run; the image is TAESD's decode of them (scaling_factor 1).
    CHECK(torch::equal(r.final_latents, full.final_latents));
    torch::NoGradGuard ng;
    const auto want = models.taesd->decode(r.final_latents);
    CHECK(torch::equal(r.decoded, want));
    CHECK(r.image_uint8.sizes() == full.image_uint8.sizes());
    // The preview of the last step is the final image's first row.
    const auto last = preview_image(models, r.final_latents);
    CHECK((last.to(torch::kInt) - r.image_uint8[0].to(torch::kInt)).abs().max().item<int>() <= 1);

    // The projection: an image in [0, 1] at the latent size, the SD 1.x factors on a unit latent.
    auto unit = torch::zeros({1, 4, 1, 1});
    unit[0][0] = 1;
    const auto rgb = latent_rgb_projection(unit, SdFamily::SD1);
    CHECK(rgb.sizes() == torch::IntArrayRef({1, 3, 1, 1}));
    CHECK(std::abs(rgb[0][0][0][0].item<double>() - (0.3512 + 1) / 2) < 1e-6);
    CHECK(preview_path("out/a.png") == "out/a_preview.png");
    CHECK(preview_path("out/") == "out/preview.png");
}

TEST_CASE("anchor-sd --vae-decoder taesd:FILE and --preview N; --compare with TAESD", "[cli][sd][taesd]") {
    torch::manual_seed(8);
    const std::string dir = test::scratch_dir("cli_taesd");
    AutoencoderTiny t(taesd_small_config(2)); // the tiny model's VAE factor 2
    save_taesd_single_files(*t, dir + "/taesd");
    const std::vector<std::string> base{"-m", "assets/models/sd15-tiny-random", "-p", "a cat", "--steps", "3",
                                        "--threads", "1"};
    auto args = base;
    args.insert(args.end(), {"-o", dir + "/a.png", "--vae-decoder", "taesd:" + dir + "/taesd/taesd_decoder.safetensors",
                             "--preview", "1"});
    auto r = test::run_program(test::sd_bin(), args);
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    CHECK(r.output.find("preview: " + dir + "/a_preview.png every 1 steps (taesd)") != std::string::npos);
    CHECK(test::read_bytes(dir + "/a_preview.png").compare(0, 4, "\x89PNG") == 0);
    CHECK(test::read_bytes(dir + "/a.png.json").find("\"vae_decoder\": \"taesd\"") != std::string::npos);
    // The preview file is an output like the image: not replaced without --overwrite.
    r = test::run_program(test::sd_bin(), args);
    CHECK(r.exit_code == 2);
    CHECK(r.output.find("--preview: '" + dir + "/a_preview.png' exists") != std::string::npos);

    // --compare decodes every mode with it.
    args = base;
    args.insert(args.end(), {"-o", dir + "/cmp.png", "--vae-decoder", "taesd:" + dir + "/taesd", "--compare",
                             "off,deepcache:2"});
    r = test::run_program(test::sd_bin(), args);
    INFO(r.output);
    CHECK(r.exit_code == 0);
    CHECK(fs::exists(dir + "/cmp.png"));

    // Bad values: a usage error naming the option; a TAESD that is not there, a runtime error naming the file.
    args = base;
    args.insert(args.end(), {"-o", dir + "/b.png", "--vae-decoder", "tiny"});
    r = test::run_program(test::sd_bin(), args);
    CHECK(r.exit_code == 2);
    CHECK(r.output.find("--vae-decoder: expected full, taesd or taesd:FILE, got 'tiny'") != std::string::npos);
    args.back() = "taesd:" + dir + "/nothing";
    r = test::run_program(test::sd_bin(), args);
    CHECK(r.exit_code == 1);
    CHECK(r.output.find(dir + "/nothing") != std::string::npos);
}

TEST_CASE("TAESD on the fast paths agrees with the reference modules", "[sd][taesd][perf]") {
    torch::manual_seed(9);
    AutoencoderTiny m(taesd_small_config(4));
    torch::NoGradGuard ng;
    const auto z = torch::randn({2, 4, 12, 10});
    const auto x = torch::rand({1, 3, 40, 24}) * 2 - 1;
    const auto ref_dec = m->decode(z), ref_enc = m->encode(x);
    for (auto gemm : {kernels::GemmBackend::Torch, kernels::GemmBackend::OneDnn, kernels::GemmBackend::Winograd}) {
        INFO(int(gemm));
        m->set_fast_paths(true, gemm);
        const auto dec = m->decode(z), enc = m->encode(x);
        CHECK(dec.is_contiguous());
        CHECK(test::rel_err(dec, ref_dec) < 1e-5);
        CHECK(test::rel_err(enc, ref_enc) < 1e-5);
    }
    m->set_fast_paths(false);
    CHECK(torch::equal(m->decode(z), ref_dec));
}
