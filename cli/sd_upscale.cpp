// `anchor-sd upscale -i IN --model FILE -o OUT.png [--tile N] [--tile-overlap N] [--overwrite]`: an image through
// an ESRGAN upscaler (unet/pipeline/upscale.h), in tiles for large images.
#include "cache/io/error.h"
#include "cli/common.h"
#include "cli/sd_commands.h"
#include "unet/pipeline/img2img.h"
#include "unet/pipeline/upscale.h"

#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>

namespace anchor::cli {

namespace {

struct UpscaleArgs {
    std::string input, model, output;
    unet::UpscaleTiling tiling;
    bool overwrite = false;
};

int run_upscale(const UpscaleArgs& a) {
    namespace fs = std::filesystem;
    // Output checks before the model is read: nothing is replaced without --overwrite, never a folder.
    if (fs::is_directory(a.output)) throw UsageError("-o/--output: '" + a.output + "' is a folder; name a PNG file");
    if (fs::exists(a.output) && !a.overwrite)
        throw UsageError("-o/--output: '" + a.output + "' exists; add --overwrite to replace it");
    (void)unet::image_file_size(a.input, "upscale_image"); // a missing or unreadable image before the model
    const auto t0 = std::chrono::steady_clock::now();
    const auto model = unet::load_esrgan(a.model);
    std::fprintf(stderr, "upscaler %s: %s\n", model.name.c_str(), model.describe().c_str());
    const auto [w, h] = unet::upscale_image_file(model, a.input, a.output, a.tiling, a.overwrite);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::fprintf(stderr, "saved %s (%lldx%lld, %.1fs)\n", a.output.c_str(), (long long)w, (long long)h, s);
    return 0;
}

} // namespace

void add_sd_upscale_command(CLI::App& app, SdRunners& runners) {
    auto* cmd = app.add_subcommand("upscale", "upscale an image with an ESRGAN model (RRDBNet: ESRGAN, Real-ESRGAN, "
                                              "4x-UltraSharp; .pth or .safetensors)");
    cmd->fallthrough();
    auto a = std::make_shared<UpscaleArgs>();
    bind_field("upscale_image", "-i/--input");
    cmd->add_option("-i,--input", a->input, "the image to upscale (PNG, JPEG, ...)")->required();
    cmd->add_option("--model", a->model, "the upscaler: an RRDBNet .pth or .safetensors")->required();
    cmd->add_option("-o,--output", a->output, "the PNG to write")->required();
    cmd->add_option("--tile", a->tiling.tile, "input pixels per tile side (0: the whole image at once)")
        ->check(in_range(0, 65536))
        ->capture_default_str();
    cmd->add_option("--tile-overlap", a->tiling.overlap,
                    "input pixels of context around each tile; the tile's own part is kept (basicsr's tile_pad)")
        ->check(in_range(0, 65536))
        ->capture_default_str();
    cmd->add_flag("--overwrite", a->overwrite, "replace an existing output file");
    runners.emplace_back(cmd, [a]() { return run_upscale(*a); });
}

} // namespace anchor::cli
