// Upscaling images with an ESRGAN (unet/model/esrgan.h), in tiles for large images, and the same after txt2img
// (`anchor-sd --upscale-model`) with the infotext A1111's Extras tab writes.
//
// Tiles are cut as basicsr's RealESRGANer.tile_process does: the image is split into tile x tile squares, each run
// with `overlap` more input pixels on every side (clipped at the image's edges), and only the output of its own square
// is kept (cropped, not blended). The output of a pixel depends on the input within the network's receptive field
// (1 + 15 nb + 1 convolutions at the input resolution, a few more after upsampling), so with an overlap at least that
// wide the tiled image equals the untiled one up to float rounding; with less (the published 23-block models reach
// ~350 input pixels) the seams differ slightly from the untiled image, as they do in every tiled ESRGAN.
#pragma once

#include "cache/io/png_text.h"
#include "unet/model/esrgan.h"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace anchor::unet {

struct UpscaleTiling {
    int64_t tile = 192;   // input pixels per tile side (A1111's ESRGAN tile); <= 0: the whole image at once
    int64_t overlap = 16; // input pixels of context on every side of a tile (basicsr's tile_pad)
};

// rgb01: [N,3,H,W] float32 in [0,1]; returns [N,3,H*scale,W*scale] float32, clamped to [0,1]. ParamError naming
// `tiling.tile` / `tiling.overlap` for negative values; anchor::Error for an image of another shape.
at::Tensor esrgan_upscale(const EsrganModel& model, const at::Tensor& rgb01, const UpscaleTiling& tiling = {});

// uint8 [H, W, 3] (a decoded PNG) -> upscaled uint8 [H*scale, W*scale, 3]: x/255, the network, clamp, round(255 y)
// (A1111's and spandrel's conversions).
at::Tensor esrgan_upscale_uint8(const EsrganModel& model, const at::Tensor& rgb_hwc, const UpscaleTiling& tiling = {});

// `anchor-sd upscale`: the image file `in` (any format read_image_rgb reads; ParamError naming `field` when it
// cannot be read) upscaled into the PNG `out`, written atomically (temp + rename; an existing `out` is an anchor::Error
// unless `overwrite`). A PNG's text chunks are kept (its `parameters`, our record) and A1111's `postprocessing` chunk
// says the upscale, as A1111's Extras tab does. Returns the output's width and height.
std::pair<int64_t, int64_t> upscale_image_file(const EsrganModel& model, const std::string& in, const std::string& out,
                                               const UpscaleTiling& tiling, bool overwrite,
                                               const std::string& field = "upscale_image");

// An upscale after generation (txt2img's --upscale-model): the model and its tiling.
struct PostUpscale {
    std::shared_ptr<const EsrganModel> model; // null: none
    UpscaleTiling tiling;
};
// A1111's Extras text for an upscale by `model`: "Postprocess upscale by: 4, Postprocess upscaler: 4x-UltraSharp"
// (the PNG chunk A1111 names "postprocessing").
std::string postprocess_infotext(const EsrganModel& model);
// An image of a job upscaled (uint8 [H, W, 3] in place) and its record's "postprocess_upscale" entry (model file,
// name, scale, tiling, input and output size). Without a model: nothing changes.
void apply_post_upscale(const PostUpscale& up, at::Tensor& rgb_hwc, nlohmann::json& record);
// A1111's `postprocessing` text chunk after the others (`parameters` keeps the generation's own Size, as A1111's
// Extras leaves it). Without a model: nothing changes.
void add_postprocess_chunk(const PostUpscale& up, std::vector<PngTextChunk>& chunks);

// A1111's Upscaler.upscale (the Extras tab's "Scale by"): the target is floor(side x scale / 8) x 8 pixels; the
// network runs (up to three times) until the image reaches it, then PIL's Lanczos resize (resize_lanczos) to exactly
// that size. uint8 [H, W, 3] in and out.
at::Tensor a1111_upscale_by(const EsrganModel& model, const at::Tensor& rgb_hwc, double scale,
                            const UpscaleTiling& tiling = {});
// Python's str() of a float (2.0 -> "2.0", 1.5 -> "1.5"): how A1111 writes a request's upscaling_resize.
std::string python_float_str(double v);

// The upscalers of a folder (the server's --upscaler-dir), by file stem as A1111 lists them; each loaded at its first
// use and kept, shared by requests (read-only once loaded).
class UpscalerLibrary {
public:
    explicit UpscalerLibrary(std::string dir);
    const std::string& dir() const { return dir_; }
    std::vector<std::string> names() const; // the stems of the folder's .pth/.pt/.safetensors files, sorted
    // ParamError(field) naming the name and the choices for a name the folder does not have; anchor::Error naming
    // the file for a file that is not an RRDBNet.
    std::shared_ptr<const EsrganModel> get(const std::string& name, const std::string& field);

private:
    std::string dir_;
    std::mutex mu_;
    std::map<std::string, std::shared_ptr<const EsrganModel>> loaded_;
};

} // namespace anchor::unet
