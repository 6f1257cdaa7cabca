// Tiled ESRGAN upscaling (basicsr's tile_process: crop, no blending) and the upscale after txt2img.
#include "unet/pipeline/upscale.h"

#include "cache/io/error.h"
#include "unet/pipeline/img2img.h"
#include "unet/pipeline/infotext.h"
#include "unet/pipeline/pipeline.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>

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

at::Tensor a1111_upscale_by(const EsrganModel& model, const at::Tensor& rgb_hwc, double scale,
                            const UpscaleTiling& tiling) {
    if (!(scale > 0)) throw ParamError("upscaling_resize", "expected a scale > 0, got " + python_float_str(scale));
    at::Tensor img = rgb_hwc;
    const auto dest_w = int64_t(std::floor(double(img.size(1)) * scale / 8.0) * 8.0);
    const auto dest_h = int64_t(std::floor(double(img.size(0)) * scale / 8.0) * 8.0);
    if (dest_w < 1 || dest_h < 1)
        throw ParamError("upscaling_resize", "an image of " + std::to_string(img.size(1)) + "x" +
                                                 std::to_string(img.size(0)) + " scaled by " + python_float_str(scale) +
                                                 " is smaller than 8 pixels (A1111 rounds the size down to 8)");
    for (int i = 0; i < 3; ++i) {
        if (img.size(1) >= dest_w && img.size(0) >= dest_h && (i > 0 || scale != 1.0)) break;
        const auto before = img.sizes().vec();
        img = esrgan_upscale_uint8(model, img, tiling);
        if (img.sizes().vec() == before) break; // a 1x model: once
    }
    if (img.size(1) != dest_w || img.size(0) != dest_h) img = resize_lanczos(img, int(dest_w), int(dest_h));
    return img;
}

std::string python_float_str(double v) {
    char buf[64];
    if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 1e16) {
        std::snprintf(buf, sizeof buf, "%.1f", v);
        return buf;
    }
    for (int prec = 1; prec <= 17; ++prec) { // the shortest text that reads back as v (repr)
        std::snprintf(buf, sizeof buf, "%.*g", prec, v);
        if (std::strtod(buf, nullptr) == v) break;
    }
    return buf;
}

UpscalerLibrary::UpscalerLibrary(std::string dir) : dir_(std::move(dir)) {}

std::vector<std::string> UpscalerLibrary::names() const {
    namespace fs = std::filesystem;
    std::vector<std::string> out;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(dir_, ec)) {
        const auto ext = e.path().extension().string();
        if (e.is_regular_file() && (ext == ".pth" || ext == ".pt" || ext == ".safetensors"))
            out.push_back(e.path().stem().string());
    }
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    return out;
}

std::shared_ptr<const EsrganModel> UpscalerLibrary::get(const std::string& name, const std::string& field) {
    namespace fs = std::filesystem;
    std::lock_guard<std::mutex> lock(mu_);
    if (const auto it = loaded_.find(name); it != loaded_.end()) return it->second;
    std::string file;
    for (const char* ext : {".safetensors", ".pth", ".pt"}) // safetensors first: nothing to unpickle
        if (name.find('/') == std::string::npos && name != "." && name != ".." &&
            fs::is_regular_file(fs::path(dir_) / (name + ext))) {
            file = (fs::path(dir_) / (name + ext)).string();
            break;
        }
    if (file.empty()) {
        std::string have;
        for (const auto& n : names()) have += (have.empty() ? "" : ", ") + n;
        throw ParamError(field, "'" + name + "' is not an upscaler of the upscaler folder (" +
                                    (have.empty() ? std::string("it has none") : "it has: " + have) + ")");
    }
    auto m = std::make_shared<const EsrganModel>(load_esrgan(file));
    loaded_[name] = m;
    return m;
}

} // namespace anchor::unet
