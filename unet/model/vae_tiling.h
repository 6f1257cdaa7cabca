// Tiled VAE decode and encode with diffusers 0.27 AutoencoderKL.enable_tiling() semantics (tiled_decode /
// tiled_encode): the input is cut into overlapping square tiles, each tile goes through the coder alone, and each
// output tile's first rows / columns are blended linearly with the last ones of the tile above / to the left before
// its top-left row_limit x row_limit part is kept. A tile's activations are what is resident, not the image's, so the
// peak memory follows the tile size, not the image size.
//
// The rule (the tile grid, the blend weights) is kept apart from the work (plan_tile_axis, blend_weights) so it can
// be checked with hand-computed numbers; docs/sd.md "VAE tiling" explains the options.
#pragma once

#include "unet/model/vae.h"

#include <torch/torch.h>

#include <cstdint>
#include <vector>

namespace anchor::unet {

// The user's choice (anchor-sd --vae-tiling, --vae-tile-size, --vae-tile-overlap; the server's "vae_tiling").
struct VaeTiling {
    bool enabled = false;
    // Image pixels per tile side (diffusers' tile_sample_min_size, there the VAE config's sample_size: 512 for SD
    // 1.x); a multiple of the VAE factor. The latent tile is tile_sample_size / factor (tile_latent_min_size).
    int tile_sample_size = 512;
    // diffusers' tile_overlap_factor, in [0, 1): the share of a tile that overlaps its neighbour.
    double overlap = 0.25;
    // ParamError naming vae_tile_size / vae_tile_overlap: the size is not a positive multiple of `vae_factor`, the
    // overlap is outside [0, 1), or the two give a grid whose kept parts do not add up to the image (diffusers then
    // returns an image of another size: tile_latent * overlap must be a whole number).
    void validate(int vae_factor) const;
};

// Tile sizes of one coder call: `sample` image pixels and `latent` latent pixels per tile side.
struct TileSizes {
    int64_t sample = 512, latent = 64;
    double overlap = 0.25;
    static TileSizes of(const VaeTiling& t, int vae_factor);
};

// One axis of a tile grid (the grid is the same rule on both axes). Input tiles start every `stride` pixels from 0
// while a start lies inside `length`; each covers `tile_in` pixels (the last ones fewer). Output tile k is blended
// over its first min(blend, previous, own size) pixels and keeps its first `keep` pixels (diffusers' row_limit).
struct TileAxis {
    int64_t stride = 0, blend = 0, keep = 0;
    std::vector<int64_t> starts, sizes; // per tile, in input pixels
};
// diffusers: stride = int(tile_in * (1 - overlap)), blend = int(tile_out * overlap), keep = tile_out - blend.
// decode: tile_in = latent, tile_out = sample; encode: the reverse. Throws when the stride is 0.
TileAxis plan_tile_axis(int64_t length, int64_t tile_in, int64_t tile_out, double overlap);

// The weight of the current tile on its blended pixel y of `extent` (y / extent); the other tile's is 1 - that.
std::vector<double> blend_weights(int64_t extent);

// diffusers' blend_v (dim 2) / blend_h (dim 3): b's first e = min(extent, tail's, b's size along dim) pixels become
// tail_e * (1 - y/e) + b * (y/e) in place, where tail_e is the last e pixels of `tail` along dim (float32 products
// of the weights rounded to b's dtype, as torch does with a Python scalar).
void blend_edge(const torch::Tensor& tail, torch::Tensor& b, int64_t extent, int64_t dim);

// The tiled paths themselves (whatever the input size).
torch::Tensor decode_tiled(AutoencoderKLImpl& vae, const torch::Tensor& z, const TileSizes& t);
// The moments of the tiled encode, and the posterior of them.
LatentDistribution encode_tiled(AutoencoderKLImpl& vae, const torch::Tensor& image, const TileSizes& t);

// diffusers' decode / encode with tiling on: the tiled path only when the input is larger than a tile in either
// side, else the plain one; with tiling off, the plain one.
torch::Tensor vae_decode(AutoencoderKLImpl& vae, const torch::Tensor& z, const VaeTiling& t);
LatentDistribution vae_encode(AutoencoderKLImpl& vae, const torch::Tensor& image, const VaeTiling& t);
torch::Tensor vae_decode(AutoencoderKLImpl& vae, const torch::Tensor& z, const TileSizes& t);
LatentDistribution vae_encode(AutoencoderKLImpl& vae, const torch::Tensor& image, const TileSizes& t);

} // namespace anchor::unet
