// img2img / inpaint inputs (diffusers 0.27.2 VaeImageProcessor and get_timesteps semantics, see img2img.h).
#include "unet/pipeline/img2img.h"

#include "cache/io/error.h"
#include "cache/util/strings.h"
#include "cache/io/sha256.h"

#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wsign-compare"
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#endif
#define STB_IMAGE_STATIC
#define STB_IMAGE_IMPLEMENTATION
#include <stb_image.h>
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <vector>

namespace anchor::unet {

using torch::Tensor;

namespace {

// The decoded file with its own channel count (1 grey, 2 grey + alpha, 3 RGB, 4 RGBA), as stb reads it.
struct Decoded {
    std::unique_ptr<unsigned char, void (*)(void*)> px{nullptr, stbi_image_free};
    int w = 0, h = 0, c = 0;
};

// stb_image's failure reasons are single words ("outofdata"); say what they mean for the user's file.
std::string stb_reason() {
    const char* r = stbi_failure_reason();
    const std::string why = r ? r : "";
    if (why == "outofdata" || why == "bad zlib header" || why == "bad huffman code" || why == "no IDAT" ||
        why == "not enough pixels" || why == "corrupt")
        return "the file is truncated or corrupt (stb_image: " + why + ")";
    if (why == "unknown image type" || why.empty())
        return "not an image format this reads (PNG, JPEG, BMP, TGA, GIF, PSD, PIC, PNM)";
    return why;
}

// The path names a readable regular file, or the error says what it is instead.
void check_image_path(const std::string& path, const std::string& field) {
    if (path.empty()) throw ParamError(field, "no image file given");
    std::error_code ec;
    if (std::filesystem::is_directory(path, ec))
        throw ParamError(field, "'" + path + "' is a folder, not an image file");
    std::ifstream probe(path, std::ios::binary);
    if (!probe) throw ParamError(field, "cannot open image file '" + path + "'");
}

Decoded decode(const std::string& path, const std::string& field) {
    check_image_path(path, field);
    Decoded d;
    d.px.reset(stbi_load(path.c_str(), &d.w, &d.h, &d.c, 0));
    if (!d.px) throw ParamError(field, "cannot decode image file '" + path + "': " + stb_reason());
    return d;
}

// PIL's L = R * 299/1000 + G * 587/1000 + B * 114/1000 in its 16-bit fixed point (Convert.c, L24).
uint8_t pil_luma(uint8_t r, uint8_t g, uint8_t b) {
    return uint8_t((uint32_t(r) * 19595u + uint32_t(g) * 38470u + uint32_t(b) * 7471u + 0x8000u) >> 16);
}

// Pillow's Lanczos kernel (Resample.c): sinc(x) sinc(x / 3) on [-3, 3).
double sinc(double x) {
    if (x == 0.0) return 1.0;
    x *= M_PI;
    return std::sin(x) / x;
}
double lanczos(double x) {
    return (-3.0 <= x && x < 3.0) ? sinc(x) * sinc(x / 3.0) : 0.0;
}

constexpr int kPrecisionBits = 32 - 8 - 2;

// Pillow's precompute_coeffs + normalize_coeffs_8bpc for one axis: for output pixel o, the source window
// [bounds[2o], bounds[2o] + bounds[2o + 1]) and its fixed-point weights (ksize per pixel).
struct Coeffs {
    int ksize = 0;
    std::vector<int> bounds;
    std::vector<int32_t> k;
};

Coeffs precompute(int in_size, int out_size) {
    const double scale = double(in_size) / out_size;
    const double filterscale = std::max(scale, 1.0);
    const double support = 3.0 * filterscale;
    Coeffs c;
    c.ksize = int(std::ceil(support)) * 2 + 1;
    c.bounds.resize(size_t(out_size) * 2);
    c.k.assign(size_t(out_size) * size_t(c.ksize), 0);
    std::vector<double> w(size_t(c.ksize));
    for (int xx = 0; xx < out_size; ++xx) {
        const double center = (xx + 0.5) * scale;
        const double ss = 1.0 / filterscale;
        int xmin = int(center - support + 0.5);
        if (xmin < 0) xmin = 0;
        int xmax = int(center + support + 0.5);
        if (xmax > in_size) xmax = in_size;
        xmax -= xmin;
        double ww = 0.0;
        for (int x = 0; x < xmax; ++x) {
            w[size_t(x)] = lanczos((x + xmin - center + 0.5) * ss);
            ww += w[size_t(x)];
        }
        for (int x = 0; x < c.ksize; ++x) {
            double v = x < xmax ? (ww != 0.0 ? w[size_t(x)] / ww : w[size_t(x)]) : 0.0;
            c.k[size_t(xx) * size_t(c.ksize) + size_t(x)] =
                int32_t(v < 0 ? -0.5 + v * (1 << kPrecisionBits) : 0.5 + v * (1 << kPrecisionBits));
        }
        c.bounds[size_t(xx) * 2] = xmin;
        c.bounds[size_t(xx) * 2 + 1] = xmax;
    }
    return c;
}

uint8_t clip8(int32_t v) {
    const int32_t s = v >> kPrecisionBits; // arithmetic shift, as Pillow's lookup index
    return uint8_t(s < 0 ? 0 : s > 255 ? 255 : s);
}

// One separable pass over `src` [rows, cols, C] along `axis` (1 = columns: horizontal, 0 = rows: vertical).
std::vector<uint8_t> pass(const std::vector<uint8_t>& src, int rows, int cols, int C, const Coeffs& co, int out,
                          bool horizontal) {
    const int orows = horizontal ? rows : out, ocols = horizontal ? out : cols;
    std::vector<uint8_t> dst(size_t(orows) * size_t(ocols) * size_t(C));
    for (int y = 0; y < orows; ++y)
        for (int x = 0; x < ocols; ++x) {
            const int o = horizontal ? x : y;
            const int lo = co.bounds[size_t(o) * 2], n = co.bounds[size_t(o) * 2 + 1];
            const int32_t* k = &co.k[size_t(o) * size_t(co.ksize)];
            for (int ch = 0; ch < C; ++ch) {
                int32_t acc = 1 << (kPrecisionBits - 1);
                for (int j = 0; j < n; ++j) {
                    const int sy = horizontal ? y : lo + j, sx = horizontal ? lo + j : x;
                    acc += int32_t(src[(size_t(sy) * size_t(cols) + size_t(sx)) * size_t(C) + size_t(ch)]) * k[j];
                }
                dst[(size_t(y) * size_t(ocols) + size_t(x)) * size_t(C) + size_t(ch)] = clip8(acc);
            }
        }
    return dst;
}

std::string fmt_g(double v) {
    std::ostringstream os;
    os << v;
    return os.str();
}

std::string hash_pixels(const Tensor& t) {
    auto c = t.to(torch::kUInt8).contiguous();
    return sha256_hex(std::string(reinterpret_cast<const char*>(c.data_ptr<uint8_t>()), size_t(c.numel())));
}

} // namespace

Tensor read_image_rgb(const std::string& path, const std::string& field) {
    auto d = decode(path, field);
    auto out = torch::empty({d.h, d.w, 3}, torch::kUInt8);
    uint8_t* o = out.data_ptr<uint8_t>();
    const unsigned char* s = d.px.get();
    for (int64_t i = 0; i < int64_t(d.w) * d.h; ++i) {
        const unsigned char* p = s + i * d.c;
        if (d.c >= 3) { // RGB, RGBA: alpha dropped (PIL convert("RGB") does not composite)
            o[i * 3] = p[0], o[i * 3 + 1] = p[1], o[i * 3 + 2] = p[2];
        } else { // L, LA
            o[i * 3] = o[i * 3 + 1] = o[i * 3 + 2] = p[0];
        }
    }
    return out;
}

Tensor read_image_grey(const std::string& path, const std::string& field) {
    auto d = decode(path, field);
    auto out = torch::empty({d.h, d.w}, torch::kUInt8);
    uint8_t* o = out.data_ptr<uint8_t>();
    const unsigned char* s = d.px.get();
    for (int64_t i = 0; i < int64_t(d.w) * d.h; ++i) {
        const unsigned char* p = s + i * d.c;
        o[i] = d.c >= 3 ? pil_luma(p[0], p[1], p[2]) : p[0];
    }
    return out;
}

std::pair<int, int> image_file_size(const std::string& path, const std::string& field) {
    check_image_path(path, field);
    int w = 0, h = 0, c = 0;
    if (!stbi_info(path.c_str(), &w, &h, &c))
        throw ParamError(field, "cannot read image file '" + path + "': " + stb_reason());
    return {w, h};
}

Tensor resize_lanczos(const Tensor& u8, int width, int height) {
    TORCH_CHECK(u8.scalar_type() == torch::kUInt8 && (u8.dim() == 2 || u8.dim() == 3),
                "resize_lanczos expects uint8 [H, W] or [H, W, C]");
    TORCH_CHECK(width > 0 && height > 0, "resize_lanczos: size must be positive");
    const int h = int(u8.size(0)), w = int(u8.size(1)), C = u8.dim() == 3 ? int(u8.size(2)) : 1;
    if (w == width && h == height) return u8.clone(); // Image.resize returns a copy for the same size
    auto src_t = u8.contiguous();
    std::vector<uint8_t> img(src_t.data_ptr<uint8_t>(), src_t.data_ptr<uint8_t>() + src_t.numel());
    int rows = h, cols = w;
    // Pillow resizes horizontally first, over the source rows the vertical pass uses (all of them here, since the
    // box is the whole image), then vertically; each pass only when its size changes.
    if (width != w) {
        img = pass(img, rows, cols, C, precompute(w, width), width, true);
        cols = width;
    }
    if (height != h) {
        img = pass(img, rows, cols, C, precompute(h, height), height, false);
        rows = height;
    }
    auto out = torch::from_blob(img.data(), {rows, cols, C}, torch::kUInt8).clone();
    return u8.dim() == 2 ? out.squeeze(2) : out;
}

Tensor preprocess_image(const Tensor& rgb_u8, int width, int height) {
    if (rgb_u8.dim() == 4) { // a batch: each image on its own, as the processor's list of PIL images
        std::vector<Tensor> rows;
        for (int64_t k = 0; k < rgb_u8.size(0); ++k) rows.push_back(preprocess_image(rgb_u8[k], width, height));
        return torch::cat(rows, 0);
    }
    auto r = resize_lanczos(rgb_u8, width, height);
    // pil_to_numpy: float32 / 255; numpy_to_pt: NHWC -> NCHW; normalize: 2x - 1.
    auto x = r.to(torch::kFloat).div(255.0).permute({2, 0, 1}).unsqueeze(0).contiguous();
    return 2.0 * x - 1.0;
}

Tensor preprocess_mask(const Tensor& grey_u8, int width, int height) {
    if (grey_u8.dim() == 3) {
        std::vector<Tensor> rows;
        for (int64_t k = 0; k < grey_u8.size(0); ++k) rows.push_back(preprocess_mask(grey_u8[k], width, height));
        return torch::cat(rows, 0);
    }
    auto r = resize_lanczos(grey_u8, width, height);
    auto x = r.to(torch::kFloat).div(255.0).unsqueeze(0).unsqueeze(0).contiguous();
    return (x >= 0.5).to(torch::kFloat); // binarize: < 0.5 -> 0, >= 0.5 -> 1
}

Tensor latent_mask(const Tensor& mask_condition, int vae_factor) {
    namespace F = torch::nn::functional;
    const int64_t h = mask_condition.size(2) / vae_factor, w = mask_condition.size(3) / vae_factor;
    return F::interpolate(mask_condition,
                          F::InterpolateFuncOptions().size(std::vector<int64_t>{h, w}).mode(torch::kNearest));
}

StrengthSchedule strength_schedule(int steps, double strength) {
    if (!(strength > 0.0 && strength <= 1.0)) throw ParamError("strength", "must be in (0, 1], got " + fmt_g(strength));
    StrengthSchedule s;
    s.init_timestep = std::min(int(double(steps) * strength), steps);
    s.t_start = std::max(steps - s.init_timestep, 0);
    if (s.init_timestep < 1)
        throw ParamError("strength", "strength " + fmt_g(strength) + " with " + std::to_string(steps) +
                                         " steps runs no denoising step (int(steps * strength) = 0); raise the "
                                         "strength or the steps");
    return s;
}

int64_t Img2ImgParams::image_count() const {
    if (init_latents.defined()) return init_latents.size(0);
    if (init_pixels.defined()) return init_pixels.dim() == 4 ? init_pixels.size(0) : 1;
    return int64_t(init_images.size());
}

int64_t Img2ImgParams::mask_count() const {
    if (mask_pixels.defined()) return mask_pixels.dim() == 3 ? mask_pixels.size(0) : 1;
    return int64_t(masks.size());
}

namespace {


// The size shared by the images of one field (files by their headers, pixels by their shape); a file of another size
// than the first is refused, naming both.
std::pair<int, int> common_size(const std::vector<std::string>& files, const Tensor& px, const std::string& field) {
    if (px.defined()) {
        const int64_t d = px.dim();
        return {int(px.size(d - (field == "mask" ? 1 : 2))), int(px.size(d - (field == "mask" ? 2 : 3)))};
    }
    std::pair<int, int> first{0, 0};
    for (size_t k = 0; k < files.size(); ++k) {
        const auto wh = image_file_size(files[k], field);
        if (k == 0) {
            first = wh;
        } else if (wh != first) {
            throw ParamError(field, "'" + files[k] + "' is " + wxh(wh.first, wh.second) + ", '" + files[0] + "' is " +
                                        wxh(first.first, first.second) + ": the images of a batch need one size");
        }
    }
    return first;
}

void check_count(const std::string& field, int64_t n, int64_t batch) {
    if (batch > 0 && (n > batch || batch % n != 0))
        throw ParamError(field, std::to_string(n) + " " + (field == "mask" ? "masks" : "init images") +
                                    " for a batch of " + std::to_string(batch) +
                                    " images: give one, or a count that divides the batch (one per image)");
}

} // namespace

std::pair<int, int> Img2ImgParams::validate(int steps, int64_t batch) const {
    if (!enabled()) {
        if (inpaint()) throw ParamError("mask", "a mask needs an init image (init_image)");
        return {0, 0};
    }
    (void)strength_schedule(steps, strength);
    if (init_pixels.defined() && ((init_pixels.dim() != 3 && init_pixels.dim() != 4) ||
                                  init_pixels.size(-1) != 3 || init_pixels.scalar_type() != torch::kUInt8 ||
                                  init_pixels.numel() == 0))
        throw ParamError("init_image", "init pixels must be uint8 [H, W, 3] or [N, H, W, 3], got " +
                                           std::string(c10::toString(init_pixels.scalar_type())) + " " +
                                           c10::str(init_pixels.sizes()));
    const auto [iw, ih] = common_size(init_images, init_pixels, "init_image");
    check_count("init_image", image_count(), batch);
    if (!inpaint()) return {iw, ih};
    if (mask_pixels.defined() && ((mask_pixels.dim() != 2 && mask_pixels.dim() != 3) ||
                                  mask_pixels.scalar_type() != torch::kUInt8 || mask_pixels.numel() == 0))
        throw ParamError("mask", "mask pixels must be uint8 [H, W] or [N, H, W], got " +
                                     std::string(c10::toString(mask_pixels.scalar_type())) + " " +
                                     c10::str(mask_pixels.sizes()));
    const auto [mw, mh] = common_size(masks, mask_pixels, "mask");
    check_count("mask", mask_count(), batch);
    // The masked image is init image * mask, broadcast over the batch dimension as torch does in diffusers.
    const int64_t ni = image_count(), nm = mask_count();
    if (ni != nm && ni != 1 && nm != 1)
        throw ParamError("mask", std::to_string(nm) + " masks for " + std::to_string(ni) +
                                     " init images: give one mask, or one per init image");
    // diffusers stretches image and mask to the output size independently; a mask of another size was drawn for
    // another image, so it is refused rather than stretched.
    const std::string mname = mask_file(*this), iname = init_image_file(*this);
    if (mw != iw || mh != ih)
        throw ParamError("mask", "the mask" + (mname.empty() ? std::string() : " '" + mname + "'") + " is " +
                                     wxh(mw, mh) + ", the init image" +
                                     (iname.empty() ? std::string() : " '" + iname + "'") + " is " + wxh(iw, ih) +
                                     ": give a mask of the init image's size");
    return {iw, ih};
}

std::pair<int, int> Img2ImgParams::size() const {
    if (init_pixels.defined())
        return init_pixels.dim() >= 3 ? std::pair<int, int>{int(init_pixels.size(-2)), int(init_pixels.size(-3))}
                                      : std::pair<int, int>{0, 0};
    return init_images.empty() ? std::pair<int, int>{0, 0} : image_file_size(init_images[0], "init_image");
}

Tensor Img2ImgParams::rgb_batch() const {
    if (init_pixels.defined()) return init_pixels.dim() == 4 ? init_pixels : init_pixels.unsqueeze(0);
    std::vector<Tensor> rows;
    for (const auto& f : init_images) rows.push_back(read_image_rgb(f, "init_image"));
    return torch::stack(rows, 0);
}

Tensor Img2ImgParams::grey_batch() const {
    if (mask_pixels.defined()) return mask_pixels.dim() == 3 ? mask_pixels : mask_pixels.unsqueeze(0);
    std::vector<Tensor> rows;
    for (const auto& f : masks) rows.push_back(read_image_grey(f, "mask"));
    return torch::stack(rows, 0);
}

std::string init_image_file(const Img2ImgParams& p, int64_t k) {
    return p.init_images.empty() ? "" : p.init_images.at(size_t(k % int64_t(p.init_images.size())));
}

std::string mask_file(const Img2ImgParams& p, int64_t k) {
    return p.masks.empty() ? "" : p.masks.at(size_t(k % int64_t(p.masks.size())));
}

std::string init_image_sha256(const Img2ImgParams& p, int64_t k) {
    if (p.init_pixels.defined()) {
        const int64_t n = p.image_count();
        return hash_pixels(p.init_pixels.dim() == 4 ? p.init_pixels[k % n] : p.init_pixels);
    }
    return sha256_file(init_image_file(p, k));
}

std::string mask_sha256(const Img2ImgParams& p, int64_t k) {
    if (!p.inpaint()) return "";
    if (p.mask_pixels.defined()) {
        const int64_t n = p.mask_count();
        return hash_pixels(p.mask_pixels.dim() == 3 ? p.mask_pixels[k % n] : p.mask_pixels);
    }
    return sha256_file(mask_file(p, k));
}

} // namespace anchor::unet
