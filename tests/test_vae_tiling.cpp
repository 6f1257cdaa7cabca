// VAE tiling (unet/model/vae_tiling.h): the tile grid and blend rule with hand-computed numbers, the streaming tiled
// decode/encode against a line-by-line transcription of diffusers 0.27.2's tiled_decode / tiled_encode on odd sizes
// (the golden case vae_tiling_tiny covers even ones through golden_runner), the fall-back to the plain path where the
// input fits one tile, the option checks, and the CLI.
#include "cache/io/error.h"
#include "tests/test_cli_util.h"
#include "tests/test_util.h"
#include "unet/model/checkpoint.h"
#include "unet/model/vae_tiling.h"

#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <iterator>

using namespace anchor;
using namespace anchor::unet;
using torch::Tensor;

namespace {

AutoencoderKL tiny_vae() {
    auto vae = load_vae_folder(test::golden("sd/vae_tiny"));
    vae->eval();
    return vae;
}

// diffusers' blend_v / blend_h as written there: row (column) y of b, in place, with Python-scalar weights.
void ref_blend(const Tensor& a, Tensor& b, int64_t extent, int64_t dim) {
    extent = std::min({a.size(dim), b.size(dim), extent});
    for (int64_t y = 0; y < extent; ++y)
        b.select(dim, y).copy_(a.select(dim, a.size(dim) - extent + y) * (1.0 - double(y) / double(extent)) +
                               b.select(dim, y) * (double(y) / double(extent)));
}

// diffusers' tiled_decode / tiled_encode loops: every tile kept, blended in place in raster order, the kept parts
// concatenated.
Tensor ref_tiled(const Tensor& x, int64_t tile_in, int64_t tile_out, double overlap,
                 const std::function<Tensor(const Tensor&)>& code) {
    const int64_t overlap_size = int64_t(double(tile_in) * (1 - overlap)), blend = int64_t(double(tile_out) * overlap),
                  row_limit = tile_out - blend;
    std::vector<std::vector<Tensor>> rows;
    for (int64_t i = 0; i < x.size(2); i += overlap_size) {
        rows.emplace_back();
        for (int64_t j = 0; j < x.size(3); j += overlap_size)
            rows.back().push_back(
                code(x.slice(2, i, i + tile_in).slice(3, j, j + tile_in).contiguous()).clone().contiguous());
    }
    std::vector<Tensor> result_rows;
    for (size_t i = 0; i < rows.size(); ++i) {
        std::vector<Tensor> result_row;
        for (size_t j = 0; j < rows[i].size(); ++j) {
            Tensor& t = rows[i][j];
            if (i > 0) ref_blend(rows[i - 1][j], t, blend, 2);
            if (j > 0) ref_blend(rows[i][j - 1], t, blend, 3);
            result_row.push_back(t.slice(2, 0, row_limit).slice(3, 0, row_limit));
        }
        result_rows.push_back(torch::cat(result_row, 3));
    }
    return torch::cat(result_rows, 2);
}

} // namespace

TEST_CASE("VAE tile grid: diffusers' stride, blend extent and row limit by hand", "[sd][vae][vae_tiling]") {
    // SD decode, tile 512 / 64, overlap 0.25, 1024x1024 image (128 latents): stride int(64 * 0.75) = 48, blend
    // int(512 * 0.25) = 128, keep 512 - 128 = 384; tiles at 0, 48, 96 of 64, 64, 32 latents; 384 + 384 + 256 = 1024.
    auto d = plan_tile_axis(128, 64, 512, 0.25);
    CHECK(d.stride == 48);
    CHECK(d.blend == 128);
    CHECK(d.keep == 384);
    CHECK(d.starts == std::vector<int64_t>{0, 48, 96});
    CHECK(d.sizes == std::vector<int64_t>{64, 64, 32});
    // SD encode of the same image: stride int(512 * 0.75) = 384, blend int(64 * 0.25) = 16, keep 48.
    auto e = plan_tile_axis(1024, 512, 64, 0.25);
    CHECK(e.stride == 384);
    CHECK(e.blend == 16);
    CHECK(e.keep == 48);
    CHECK(e.starts == std::vector<int64_t>{0, 384, 768});
    CHECK(e.sizes == std::vector<int64_t>{512, 512, 256});
    // The golden case's decode: 24 latents, tile 8 -> 16 pixels: stride 6, blend 4, keep 12, last tile 6 latents.
    auto g = plan_tile_axis(24, 8, 16, 0.25);
    CHECK(g.starts == std::vector<int64_t>{0, 6, 12, 18});
    CHECK(g.sizes == std::vector<int64_t>{8, 8, 8, 6});
    CHECK(g.keep == 12);
    // No overlap: back-to-back tiles, nothing blended.
    auto z = plan_tile_axis(20, 8, 64, 0.0);
    CHECK(z.starts == std::vector<int64_t>{0, 8, 16});
    CHECK(z.blend == 0);
    CHECK(z.keep == 64);
    CHECK_THROWS_AS(plan_tile_axis(10, 1, 8, 0.5), Error); // int(1 * 0.5) = 0: no stride
}

TEST_CASE("VAE tile blending: linear weights y / extent, clamped extent, in place", "[sd][vae][vae_tiling]") {
    CHECK(blend_weights(4) == std::vector<double>{0.0, 0.25, 0.5, 0.75});
    CHECK(blend_weights(0).empty());
    // Vertical: the tile above is all 1 (its last 4 rows are used), the current one 0: rows become 1, .75, .5, .25,
    // the rows past the extent keep their value.
    Tensor a = torch::ones({1, 1, 6, 3}), b = torch::zeros({1, 1, 5, 3});
    blend_edge(a, b, 4, 2);
    const Tensor col = b.select(3, 1).flatten();
    CHECK(torch::equal(col, torch::tensor({1.0f, 0.75f, 0.5f, 0.25f, 0.0f})));
    CHECK(torch::equal(b.select(3, 0), b.select(3, 2)));
    // Horizontal, the extent clamped to the current tile's 2 columns: weights 0, 0.5 on the left tile's last 2
    // columns (3 and 5 here).
    Tensor l = torch::arange(6, torch::kFloat).view({1, 1, 1, 6}), r = torch::full({1, 1, 1, 2}, 10.0f);
    blend_edge(l, r, 4, 3);
    CHECK(torch::equal(r.flatten(), torch::tensor({4.0f, 0.5f * 5.0f + 0.5f * 10.0f})));
    // Extent 0 (overlap 0) leaves the tile as it is.
    Tensor c = torch::zeros({1, 1, 2, 2});
    blend_edge(torch::ones({1, 1, 2, 2}), c, 0, 2);
    CHECK(c.abs().sum().item<float>() == 0.0f);
}

TEST_CASE("VAE tiled decode/encode: the streaming pass equals diffusers' keep-every-tile loop on odd sizes",
          "[sd][vae][vae_tiling]") {
    torch::NoGradGuard ng;
    auto vae = tiny_vae(); // factor 2
    torch::manual_seed(7);
    TileSizes t;
    t.sample = 16, t.latent = 8, t.overlap = 0.25;
    // 11 x 23 latents: last tiles of 5 and 5 latents, a row of 2 tiles and a column of 4.
    const Tensor z = torch::randn({2, 4, 11, 23});
    const Tensor want = ref_tiled(z, t.latent, t.sample, t.overlap, [&](const Tensor& x) { return vae->decode(x); });
    const Tensor got = vae_decode(*vae, z, t);
    REQUIRE(got.sizes() == torch::IntArrayRef({2, 3, 22, 46}));
    CHECK(torch::equal(got, want));
    // Odd image sides 21 x 45: the last tiles are 9 pixels, coded to the encoder's (9 - 2) / 2 + 1 = 4 latents.
    const Tensor x = torch::rand({1, 3, 21, 45}) * 2 - 1;
    const Tensor want_m =
        ref_tiled(x, t.sample, t.latent, t.overlap, [&](const Tensor& tile) { return vae->encode(tile).moments; });
    const auto d = vae_encode(*vae, x, t);
    REQUIRE(d.moments.sizes() == want_m.sizes());
    CHECK(torch::equal(d.moments, want_m));
    CHECK(torch::equal(d.mean, want_m.chunk(2, 1)[0]));
    // Another overlap (0.5: blend 8 of 16, stride 4 latents).
    t.overlap = 0.5;
    const Tensor want_half = ref_tiled(z, t.latent, t.sample, 0.5, [&](const Tensor& x) { return vae->decode(x); });
    CHECK(torch::equal(vae_decode(*vae, z, t), want_half));
}

TEST_CASE("VAE tiling: an input that fits one tile takes the plain path, and one tile equals it",
          "[sd][vae][vae_tiling]") {
    torch::NoGradGuard ng;
    auto vae = tiny_vae();
    torch::manual_seed(3);
    const Tensor z = torch::randn({1, 4, 8, 6});
    const Tensor plain = vae->decode(z);
    VaeTiling on;
    on.enabled = true;
    on.tile_sample_size = 16; // latent tile 8: 8 x 6 is not larger
    CHECK(torch::equal(vae_decode(*vae, z, on), plain));
    const Tensor x = torch::rand({1, 3, 16, 12}) * 2 - 1;
    CHECK(torch::equal(vae_encode(*vae, x, on).mean, vae->encode(x).mean));
    // Forced through the tiled path, an input within one stride (6 latents, 12 pixels) is one tile that keeps all of
    // its output (12 <= keep 12 rows, 6 <= keep 6 latents; nothing blended). A tile-sized input is two tiles there:
    // starts 0 and 6.
    const Tensor z1 = torch::randn({1, 4, 6, 5});
    CHECK((decode_tiled(*vae, z1, TileSizes::of(on, 2)) - vae->decode(z1)).abs().max().item<double>() <= 1e-6);
    CHECK(plan_tile_axis(8, 8, 16, 0.25).starts.size() == 2);
    const Tensor x1 = torch::rand({1, 3, 12, 10}) * 2 - 1;
    const auto tiled1 = encode_tiled(*vae, x1, TileSizes::of(on, 2));
    CHECK((tiled1.moments - vae->encode(x1).moments).abs().max().item<double>() <= 1e-6);
    // Tiling off is the plain path whatever the size.
    const Tensor big = torch::randn({1, 4, 20, 20});
    CHECK(torch::equal(vae_decode(*vae, big, VaeTiling{}), vae->decode(big)));
}

TEST_CASE("VAE tiling options: size a multiple of the VAE factor, overlap at least 0 and under 1 that tiles evenly",
          "[sd][vae][vae_tiling]") {
    auto field_of = [](const VaeTiling& t, int f) -> std::string {
        try {
            t.validate(f);
        } catch (const ParamError& e) {
            return e.field();
        }
        return "";
    };
    VaeTiling t;
    CHECK(field_of(t, 8).empty()); // 512, 0.25
    t.tile_sample_size = 500;
    CHECK(field_of(t, 8) == "vae_tile_size");
    t.tile_sample_size = 0;
    CHECK(field_of(t, 8) == "vae_tile_size");
    t.tile_sample_size = 256;
    for (double bad : {1.0, -0.1, 1.5, std::nan("")}) {
        t.overlap = bad;
        CHECK(field_of(t, 8) == "vae_tile_overlap");
    }
    t.overlap = 0.3; // 32 latents x 0.3 = 9.6: the kept parts would not add up to the image
    CHECK(field_of(t, 8) == "vae_tile_overlap");
    for (double ok : {0.0, 0.125, 0.25, 0.5, 0.75}) {
        t.overlap = ok;
        CHECK(field_of(t, 8).empty());
    }
}

TEST_CASE("anchor-sd --vae-tiling: txt2img and img2img run tiled; bad values exit 2 naming the option",
          "[sd][vae_tiling][cli]") {
    const auto out = test::scratch_dir("vae_tiling_cli");
    const std::string m = "assets/models/sd15-tiny-random", png = out + "/t.png";
    // The tiny model's VAE factor is 2: a 64x64 image is 32x32 latents, four tiles of 16 with --vae-tile-size 32.
    auto r = test::run_program(test::sd_bin(), {"-m", m, "-p", "a", "--steps", "2", "-W", "64", "-H", "64",
                                                "--vae-tile-size", "32", "-o", png, "--overwrite"});
    INFO(r.output);
    CHECK(r.exit_code == 0);
    CHECK(std::filesystem::exists(png));
    {
        std::ifstream f(png + ".json");
        const std::string rec((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
        CHECK(rec.find("\"vae_tiling\"") != std::string::npos); // the sidecar says how it was decoded
        CHECK(rec.find("\"tile_size\": 32") != std::string::npos);
    }
    r = test::run_program(test::sd_bin(),
                          {"-m", m, "-p", "a", "--steps", "2", "-i", test::golden("sd/img2img_tiny/init_image.png"),
                           "--vae-tiling", "--vae-tile-size", "16", "-o", out + "/i.png", "--overwrite"});
    INFO(r.output);
    CHECK(r.exit_code == 0);
    const std::vector<std::pair<std::vector<std::string>, std::vector<std::string>>> bad = {
        {{"--vae-tile-size", "17"}, {"--vae-tile-size", "multiple of 2", "got 17"}},
        {{"--vae-tiling", "--vae-tile-overlap", "1"}, {"--vae-tile-overlap", "[0, 1)", "got 1"}},
        {{"--vae-tile-overlap", "-0.5"}, {"--vae-tile-overlap", "got -0.5"}},
        {{"--vae-tile-size", "abc"}, {"--vae-tile-size", "abc"}},
    };
    for (const auto& [args, want] : bad) {
        std::vector<std::string> a = {"-m", m, "-p", "a", "--steps", "1", "-o", out + "/bad.png"};
        a.insert(a.end(), args.begin(), args.end());
        const auto e = test::run_program(test::sd_bin(), a);
        INFO(e.output);
        CHECK(e.exit_code == 2);
        for (const auto& s : want) CHECK(e.output.find(s) != std::string::npos);
        CHECK_FALSE(std::filesystem::exists(out + "/bad.png"));
    }
}
