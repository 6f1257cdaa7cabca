// Tiled VAE coding, diffusers 0.27 AutoencoderKL.tiled_decode / tiled_encode (see vae_tiling.h).
//
// diffusers keeps every output tile, blends them in place in raster order and concatenates the kept parts. A tile's
// blend reads only the last `blend` rows of the (already blended) tile above and the last `blend` columns of the
// (already blended) tile to its left, so the same numbers come from a single pass that keeps just those edges of the
// previous row and the previous tile, and writes each kept part straight into the output: the resident memory is
// one tile's coder activations, the edges and the output, never all tiles nor a second copy of the image.
#include "unet/model/vae_tiling.h"

#include "cache/io/error.h"
#include "cache/util/heap.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>

namespace anchor::unet {

using torch::Tensor;

namespace {

std::string num(double v) {
    std::string s = std::to_string(v);
    while (s.size() > 1 && s.back() == '0') s.pop_back();
    if (!s.empty() && s.back() == '.') s.pop_back();
    return s;
}

// The coder's output size for an input tile side of n: the decoder doubles per up level; the encoder's downsamplers
// (pad right/bottom by 1, 3x3 stride-2 convolution) give (n - 2) / 2 + 1 per level.
int64_t coded_size(int64_t n, int levels, bool decoder) {
    for (int i = 0; i + 1 < levels; ++i) n = decoder ? n * 2 : (n < 2 ? 0 : (n - 2) / 2 + 1);
    return n;
}

// The output extent along one axis: the sum of the tiles' kept parts (diffusers' torch.cat of them).
std::vector<int64_t> kept_sizes(const TileAxis& a, int levels, bool decoder) {
    std::vector<int64_t> k;
    for (const int64_t s : a.sizes) k.push_back(std::min(coded_size(s, levels, decoder), a.keep));
    return k;
}

int64_t sum(const std::vector<int64_t>& v) {
    int64_t s = 0;
    for (const int64_t x : v) s += x;
    return s;
}

// The tile loop shared by decode and encode: `code` maps one input tile to its output tile.
Tensor run_tiles(const Tensor& x, int64_t tile_in, int64_t tile_out, double overlap, int levels, bool decoder,
                 const std::function<Tensor(const Tensor&)>& code) {
    if (x.dim() != 4) throw Error("tiled VAE: expected a [B, C, H, W] input, got " + std::to_string(x.dim()) + " dims");
    const TileAxis rows = plan_tile_axis(x.size(2), tile_in, tile_out, overlap);
    const TileAxis cols = plan_tile_axis(x.size(3), tile_in, tile_out, overlap);
    const auto kh = kept_sizes(rows, levels, decoder), kw = kept_sizes(cols, levels, decoder);
    Tensor out;
    std::vector<Tensor> above(cols.starts.size()); // the last rows of each tile of the previous tile row
    int64_t oy = 0;
    for (size_t i = 0; i < rows.starts.size(); ++i) {
        Tensor left; // the last columns of the previous tile of this row
        int64_t ox = 0;
        for (size_t j = 0; j < cols.starts.size(); ++j) {
            Tensor t =
                code(x.narrow(2, rows.starts[i], rows.sizes[i]).narrow(3, cols.starts[j], cols.sizes[j]).contiguous());
            const int64_t want_h = coded_size(rows.sizes[i], levels, decoder),
                          want_w = coded_size(cols.sizes[j], levels, decoder);
            if (t.size(2) != want_h || t.size(3) != want_w)
                throw Error("tiled VAE: a " + std::to_string(rows.sizes[i]) + "x" + std::to_string(cols.sizes[j]) +
                            " tile coded to " + std::to_string(t.size(2)) + "x" + std::to_string(t.size(3)) +
                            ", expected " + std::to_string(want_h) + "x" + std::to_string(want_w));
            t = t.contiguous();
            if (i > 0) blend_edge(above[j], t, rows.blend, 2);
            if (j > 0) blend_edge(left, t, cols.blend, 3);
            // Copies, so the tile's storage goes when the next one is coded.
            above[j] =
                t.narrow(2, t.size(2) - std::min(t.size(2), rows.blend), std::min(t.size(2), rows.blend)).clone();
            left = t.narrow(3, t.size(3) - std::min(t.size(3), cols.blend), std::min(t.size(3), cols.blend)).clone();
            if (!out.defined()) out = torch::empty({t.size(0), t.size(1), sum(kh), sum(kw)}, t.options());
            out.narrow(2, oy, kh[i]).narrow(3, ox, kw[j]).copy_(t.narrow(2, 0, kh[i]).narrow(3, 0, kw[j]));
            ox += kw[j];
        }
        oy += kh[i];
    }
    return out;
}

bool larger_than_tile(const Tensor& x, int64_t tile) {
    return x.size(-1) > tile || x.size(-2) > tile;
}

} // namespace

void VaeTiling::validate(int vae_factor) const {
    if (tile_sample_size <= 0 || tile_sample_size % vae_factor != 0)
        throw ParamError("vae_tile_size", "must be a positive multiple of " + std::to_string(vae_factor) +
                                              " (the VAE factor of this model), got " +
                                              std::to_string(tile_sample_size));
    if (!(overlap >= 0.0 && overlap < 1.0))
        throw ParamError("vae_tile_overlap", "must be in [0, 1), got " + num(overlap));
    const TileSizes t = TileSizes::of(*this, vae_factor);
    if (int64_t(double(t.latent) * (1.0 - overlap)) < 1)
        throw ParamError("vae_tile_overlap", "leaves no stride between tiles of " + std::to_string(t.latent) +
                                                 " latent pixels, got " + num(overlap));
    // The kept part of a decoded tile must be the image span of the latent stride (and the kept part of an encoded
    // tile the latent span of the image stride), else the concatenated parts are not the image's size.
    const TileAxis d = plan_tile_axis(t.latent, t.latent, t.sample, overlap);
    const TileAxis e = plan_tile_axis(t.sample, t.sample, t.latent, overlap);
    if (d.keep != d.stride * vae_factor || e.keep * vae_factor != e.stride)
        throw ParamError("vae_tile_overlap", "with tiles of " + std::to_string(tile_sample_size) + " px the overlap " +
                                                 num(overlap) + " does not tile the image evenly: the latent tile (" +
                                                 std::to_string(t.latent) +
                                                 ") x overlap must be a whole number, e.g. " + num(0.25));
}

TileSizes TileSizes::of(const VaeTiling& t, int vae_factor) {
    TileSizes s;
    s.sample = t.tile_sample_size;
    s.latent = t.tile_sample_size / vae_factor; // diffusers: int(sample_size / 2 ** (levels - 1))
    s.overlap = t.overlap;
    return s;
}

TileAxis plan_tile_axis(int64_t length, int64_t tile_in, int64_t tile_out, double overlap) {
    TileAxis a;
    // The same double arithmetic as diffusers' int(size * (1 - factor)) / int(size * factor).
    a.stride = int64_t(double(tile_in) * (1.0 - overlap));
    a.blend = int64_t(double(tile_out) * overlap);
    a.keep = tile_out - a.blend;
    if (a.stride < 1)
        throw Error("tiled VAE: a tile of " + std::to_string(tile_in) + " with overlap " + num(overlap) +
                    " has no stride (int(tile * (1 - overlap)) = 0)");
    for (int64_t s = 0; s < length; s += a.stride) {
        a.starts.push_back(s);
        a.sizes.push_back(std::min(tile_in, length - s));
    }
    return a;
}

std::vector<double> blend_weights(int64_t extent) {
    std::vector<double> w;
    for (int64_t y = 0; y < extent; ++y) w.push_back(double(y) / double(extent));
    return w;
}

void blend_edge(const Tensor& tail, Tensor& b, int64_t extent, int64_t dim) {
    const int64_t e = std::min({tail.size(dim), b.size(dim), extent});
    if (e <= 0) return;
    const auto w = blend_weights(e);
    std::vector<double> keep_prev;
    for (const double x : w) keep_prev.push_back(1.0 - x);
    // diffusers multiplies by Python scalars, which torch rounds to the tensor's float type first.
    std::vector<int64_t> shape(size_t(b.dim()), 1);
    shape[size_t(dim)] = e;
    const auto o = b.options();
    const Tensor wb = torch::tensor(w, torch::kDouble).to(o).view(shape);
    const Tensor wa = torch::tensor(keep_prev, torch::kDouble).to(o).view(shape);
    Tensor head = b.narrow(dim, 0, e);
    head.copy_(tail.narrow(dim, tail.size(dim) - e, e) * wa + head * wb);
}

Tensor decode_tiled(AutoencoderKLImpl& vae, const Tensor& z, const TileSizes& t) {
    c10::InferenceMode guard(!vae.is_training());
    util::HeapScope heap; // the tiles' activations reuse one another's blocks
    const int levels = int(vae.config().block_out_channels.size());
    return run_tiles(z, t.latent, t.sample, t.overlap, levels, true,
                     [&](const Tensor& tile) { return vae.decode(tile); });
}

LatentDistribution encode_tiled(AutoencoderKLImpl& vae, const Tensor& image, const TileSizes& t) {
    c10::InferenceMode guard(!vae.is_training());
    util::HeapScope heap;
    const int levels = int(vae.config().block_out_channels.size());
    return latent_distribution(run_tiles(image, t.sample, t.latent, t.overlap, levels, false,
                                         [&](const Tensor& tile) { return vae.encode(tile).moments; }));
}

Tensor vae_decode(AutoencoderKLImpl& vae, const Tensor& z, const TileSizes& t) {
    return larger_than_tile(z, t.latent) ? decode_tiled(vae, z, t) : vae.decode(z);
}

LatentDistribution vae_encode(AutoencoderKLImpl& vae, const Tensor& image, const TileSizes& t) {
    return larger_than_tile(image, t.sample) ? encode_tiled(vae, image, t) : vae.encode(image);
}

Tensor vae_decode(AutoencoderKLImpl& vae, const Tensor& z, const VaeTiling& t) {
    if (!t.enabled) return vae.decode(z);
    return vae_decode(vae, z, TileSizes::of(t, vae.config().spatial_factor()));
}

LatentDistribution vae_encode(AutoencoderKLImpl& vae, const Tensor& image, const VaeTiling& t) {
    if (!t.enabled) return vae.encode(image);
    return vae_encode(vae, image, TileSizes::of(t, vae.config().spatial_factor()));
}

} // namespace anchor::unet
