// img2img and inpainting inputs, prepared as diffusers 0.27.2 does (pipelines/stable_diffusion/
// pipeline_stable_diffusion_img2img.py, pipeline_stable_diffusion_inpaint.py, image_processor.py; see
// tests/golden/sd/img2img_tiny/README.md and inpaint_tiny/README.md): the images as PIL hands them to the
// VaeImageProcessor (convert("RGB") / convert("L"), Image.resize with Lanczos when the size changes), [-1, 1]
// pixels, the binarised mask and its nearest-neighbour latent-size copy, and get_timesteps' strength rule.
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

namespace anchor::unet {

// The init images (and masks) of an img2img / inpaint run; none = txt2img. ParamError fields: "init_image", "mask",
// "strength".
//
// A batch (diffusers' `image=[...]`, `mask_image=[...]`): either one init image for every image of the batch or
// several, and likewise the masks, each count dividing the batch (prompts x images_per_prompt). diffusers encodes the
// N given images as one VAE batch (one posterior draw of shape [N, 4, h, w] from the generator) and tiles the result
// to the batch, cat([latents] * (batch / N)) in prepare_latents and repeat(batch / N) in the inpaint pipeline: image b
// of the batch starts from init image b mod N (not b / (batch / N)); a mask count other than the images' broadcasts
// against them the same way before the masked image is made.
struct Img2ImgParams {
    std::vector<std::string> init_images; // image files (PNG exact; JPEG decoded by stb, which may round differently)
    std::vector<std::string> masks; // image files, greyed like PIL's convert("L"); >= 128 (white) = repaint, < 128 keep
    // How far the init image is noised, in (0, 1]: diffusers' strength. The loop runs the last
    // min(int(steps * strength), steps) of the `steps` timesteps; 1 starts an inpaint run with a 9-channel UNet
    // from pure noise, every other run from the noised init image.
    double strength = 0.75;
    // Decoded pixels instead of the files (a server, the golden checks): uint8 [H, W, 3] or [N, H, W, 3] RGB and
    // [H, W] or [N, H, W] grey.
    torch::Tensor init_pixels, mask_pixels;
    // Or init latents [N, C, h, w] (diffusers' 4-channel `image`, the hires fix's latent upscale): used as the VAE
    // encoding (no encode, no posterior draw); the output is h x w times the VAE factor. Not with a mask.
    torch::Tensor init_latents;

    bool enabled() const { return !init_images.empty() || init_pixels.defined() || init_latents.defined(); }
    bool inpaint() const { return !masks.empty() || mask_pixels.defined(); }
    // How many init images / masks are given (0 without).
    int64_t image_count() const;
    int64_t mask_count() const;
    // The init images' width and height (the first file's header, or the pixels' shape); ParamError naming the file.
    std::pair<int, int> size() const;
    // What needs no model: a mask only with an init image, strength in (0, 1] leaving >= 1 of `steps` to run, the
    // files readable as images (headers only), all of one size, pixel tensors shaped, the masks of the init images'
    // size (refused otherwise), and, with `batch` > 0, each count dividing the batch. Returns the init images' width
    // and height ({0, 0} without one). ParamError naming the field.
    std::pair<int, int> validate(int steps, int64_t batch = 0) const;
    // The init images as uint8 [N, H, W, 3] and the masks as uint8 [M, H, W] (read from the files when not given as
    // pixels).
    torch::Tensor rgb_batch() const;
    torch::Tensor grey_batch() const;
};

// Image files as PIL gives them: convert("RGB") (grey replicated, alpha dropped) -> uint8 [H, W, 3];
// convert("L") (ITU-R 601-2 luma, PIL's fixed point: (19595 R + 38470 G + 7471 B + 2^15) >> 16) -> uint8 [H, W].
// ParamError(field) naming the file when it cannot be read or decoded.
torch::Tensor read_image_rgb(const std::string& path, const std::string& field = "init_image");
torch::Tensor read_image_grey(const std::string& path, const std::string& field = "mask");
// Width and height of an image file from its header (no decoding); ParamError(field) naming the file.
std::pair<int, int> image_file_size(const std::string& path, const std::string& field);

// PIL's Image.resize(size, Image.LANCZOS) of an 8-bit image, uint8 [H, W] or [H, W, C]: separable, horizontal
// pass first, coefficients in 22-bit fixed point (Pillow's Resample.c); the same image when the size is unchanged.
torch::Tensor resize_lanczos(const torch::Tensor& u8, int width, int height);

// VaeImageProcessor.preprocess(image, height, width): each image resized to width x height when that differs, / 255
// in float32, 2x - 1 -> [N, 3, H, W] float (uint8 [H, W, 3] gives N = 1).
torch::Tensor preprocess_image(const torch::Tensor& rgb_u8, int width, int height);
// The mask processor (do_normalize False, do_binarize True, do_convert_grayscale True): resized, / 255, < 0.5 -> 0,
// >= 0.5 -> 1 -> [N, 1, H, W] float (uint8 [H, W] gives N = 1).
torch::Tensor preprocess_mask(const torch::Tensor& grey_u8, int width, int height);
// prepare_mask_latents: F.interpolate(mask, size=(H / f, W / f)), mode nearest.
torch::Tensor latent_mask(const torch::Tensor& mask_condition, int vae_factor);

// get_timesteps: init_timestep = min(int(steps * strength), steps) (int() truncates the float64 product),
// t_start = steps - init_timestep; the loop starts at loop step t_start * Scheduler::order().
struct StrengthSchedule {
    int init_timestep = 0, t_start = 0;
};
// ParamError("strength") outside (0, 1] or when no step would run (int(steps * strength) == 0).
StrengthSchedule strength_schedule(int steps, double strength);

// SHA-256 of init image / mask k as given: the file's bytes, or the pixel bytes of row k when given as a tensor.
std::string init_image_sha256(const Img2ImgParams& p, int64_t k = 0);
std::string mask_sha256(const Img2ImgParams& p, int64_t k = 0);
// The file name of init image / mask k ("" when given as pixels).
std::string init_image_file(const Img2ImgParams& p, int64_t k = 0);
std::string mask_file(const Img2ImgParams& p, int64_t k = 0);

} // namespace anchor::unet
