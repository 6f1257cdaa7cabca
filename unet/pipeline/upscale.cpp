// Tiled ESRGAN upscaling (basicsr's tile_process: crop, no blending) and the upscale after txt2img.
#include "unet/pipeline/upscale.h"

#include "cache/io/error.h"
#include "unet/pipeline/img2img.h"
#include "unet/pipeline/infotext.h"
#include "unet/pipeline/pipeline.h"

#include <cstdio>

namespace anchor::unet {

namespace F = torch::nn::functional;

namespace {

int64_t ups_round_up(int64_t v, int64_t m) {
    return (v + m - 1) / m * m;
}

} // namespace

at::Tensor esrgan_upscale(const EsrganModel& model, const at::Tensor& rgb01, const UpscaleTiling& tiling) {
    if (tiling.overlap < 0)
        throw ParamError("tiling.overlap", "expected >= 0 input pixels, got " + std::to_string(tiling.overlap));
    if (tiling.tile < 0)
        throw ParamError("tiling.tile", "expected >= 0 input pixels (0: untiled), got " + std::to_string(tiling.tile));
    if (rgb01.dim() != 4 || rgb01.size(1) != model.in_channels || !rgb01.is_floating_point())
        throw Error("upscale model '" + model.name + "': expected a float image batch [N, " +
                    std::to_string(model.in_channels) + ", H, W], got " + shape_str(rgb01.sizes().vec()));
    torch::NoGradGuard ng;
    const auto x = rgb01.to(torch::kFloat).contiguous();
    const int64_t h = x.size(2), w = x.size(3), s = model.shuffle, sc = model.scale;
    // The unshuffle groups s x s pixels from the image's corner: pad the whole image once (reflection, spandrel's
    // rule) and cut tiles at multiples of s, so every tile groups the pixels the untiled pass groups.
    const int64_t ph = (s - h % s) % s, pw = (s - w % s) % s;
    if (ph >= h || pw >= w)
        throw Error("upscale model '" + model.name + "': an image of " + std::to_string(w) + "x" + std::to_string(h) +
                    " is too small for its pixel-unshuffle by " + std::to_string(s));
    const auto xp = ph || pw ? F::pad(x, F::PadFuncOptions({0, pw, 0, ph}).mode(torch::kReflect)) : x;
    const int64_t hp = xp.size(2), wp = xp.size(3);
    at::Tensor y;
    if (tiling.tile <= 0 || (hp <= tiling.tile && wp <= tiling.tile)) {
        y = model.forward_aligned(xp);
    } else {
        const int64_t tile = ups_round_up(tiling.tile, s), ov = ups_round_up(tiling.overlap, s);
        y = torch::empty({x.size(0), model.out_channels, hp * sc, wp * sc}, torch::kFloat);
        for (int64_t y0 = 0; y0 < hp; y0 += tile)
            for (int64_t x0 = 0; x0 < wp; x0 += tile) {
                const int64_t y1 = std::min(y0 + tile, hp), x1 = std::min(x0 + tile, wp);
                const int64_t iy0 = std::max<int64_t>(y0 - ov, 0), iy1 = std::min(y1 + ov, hp);
                const int64_t ix0 = std::max<int64_t>(x0 - ov, 0), ix1 = std::min(x1 + ov, wp);
                const auto part = model.forward_aligned(xp.narrow(2, iy0, iy1 - iy0).narrow(3, ix0, ix1 - ix0));
                y.narrow(2, y0 * sc, (y1 - y0) * sc)
                    .narrow(3, x0 * sc, (x1 - x0) * sc)
                    .copy_(part.narrow(2, (y0 - iy0) * sc, (y1 - y0) * sc).narrow(3, (x0 - ix0) * sc, (x1 - x0) * sc));
            }
    }
    if (ph || pw) y = y.narrow(2, 0, h * sc).narrow(3, 0, w * sc);
    return y.clamp(0.0, 1.0).contiguous();
}

at::Tensor esrgan_upscale_uint8(const EsrganModel& model, const at::Tensor& rgb_hwc, const UpscaleTiling& tiling) {
    if (rgb_hwc.dim() != 3 || rgb_hwc.size(2) != 3 || rgb_hwc.scalar_type() != torch::kUInt8)
        throw Error("upscale: expected an RGB uint8 image [H, W, 3], got " + shape_str(rgb_hwc.sizes().vec()));
    const auto x = rgb_hwc.permute({2, 0, 1}).unsqueeze(0).to(torch::kFloat) / 255.0;
    const auto y = esrgan_upscale(model, x, tiling);
    return (y[0] * 255.0).round().to(torch::kUInt8).permute({1, 2, 0}).contiguous();
}

std::string postprocess_infotext(const EsrganModel& model) {
    return "Postprocess upscale by: " + std::to_string(model.scale) +
           ", Postprocess upscaler: " + infotext_quote(model.name);
}

std::pair<int64_t, int64_t> upscale_image_file(const EsrganModel& model, const std::string& in, const std::string& out,
                                               const UpscaleTiling& tiling, bool overwrite, const std::string& field) {
    const auto rgb = read_image_rgb(in, field);
    std::vector<PngTextChunk> chunks;
    try { // a PNG's own text chunks travel with it (A1111's Extras keeps the generation's parameters)
        for (auto& c : read_png_text_chunks(in))
            if (c.keyword != "postprocessing") chunks.push_back(std::move(c));
    } catch (const Error&) { // not a PNG (JPEG, BMP, ...): nothing to keep
    }
    const auto y = esrgan_upscale_uint8(model, rgb, tiling);
    chunks.push_back(png_text("postprocessing", postprocess_infotext(model)));
    write_png(out, y, overwrite, chunks);
    return {y.size(1), y.size(0)};
}

void apply_post_upscale(const PostUpscale& up, at::Tensor& rgb_hwc, nlohmann::json& record) {
    if (!up.model) return;
    const int64_t h = rgb_hwc.size(0), w = rgb_hwc.size(1);
    rgb_hwc = esrgan_upscale_uint8(*up.model, rgb_hwc, up.tiling);
    record["postprocess_upscale"] = {{"model", up.model->path},
                                     {"upscaler", up.model->name},
                                     {"scale", up.model->scale},
                                     {"tile", up.tiling.tile},
                                     {"tile_overlap", up.tiling.overlap},
                                     {"size_before", {w, h}},
                                     {"size", {rgb_hwc.size(1), rgb_hwc.size(0)}}};
}

void add_postprocess_chunk(const PostUpscale& up, std::vector<PngTextChunk>& chunks) {
    if (up.model) chunks.push_back(png_text("postprocessing", postprocess_infotext(*up.model)));
}

} // namespace anchor::unet
