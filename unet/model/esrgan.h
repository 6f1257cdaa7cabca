// ESRGAN's generator, RRDBNet (Wang et al. 2018, "ESRGAN: Enhanced Super-Resolution Generative Adversarial
// Networks", Fig. 4: residual-in-residual dense blocks, no batch norm, residual scaling 0.2), as the upscalers users
// download ship it: the original ESRGAN layout (`model.0`, `model.1.sub.N.RDB1.conv1.0`, ...: 4x-UltraSharp and most
// community models), the basicsr / Real-ESRGAN layout (`conv_first`, `body.N.rdb1.conv1`, `conv_body`, `conv_up1`,
// `conv_hr`, `conv_last`), BSRGAN's (`RRDB_trunk`, `trunk_conv`, `upconv1`, `HRconv`) and basicsr's `params_ema` /
// `params` wrappers, from a torch.save file (the restricted unpickler, cache/io/torch_checkpoint.h) or .safetensors.
// Real-ESRGAN x2plus / x1 put a pixel-unshuffle in front (Wang et al. 2021, "Real-ESRGAN", Sec. 4.4): a first
// convolution with 4x or 16x the output channels says so.
//
// Every size (nf, nb, gc, channels, the number of 2x upsamplings, the unshuffle factor) is read from the tensors'
// shapes. A file that is not an RRDBNet is one anchor::Error naming the file and every missing or unexpected tensor.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace anchor::unet {

struct EsrganConv {
    at::Tensor weight, bias; // float32 [out, in, 3, 3] and [out]
};

struct EsrganModel {
    std::string path; // the file it came from
    std::string name; // the file's stem: the upscaler's name in A1111's infotext ("4x-UltraSharp")
    int64_t in_channels = 3, out_channels = 3; // of the image (the network's first conv sees in * shuffle^2)
    int64_t nf = 0, nb = 0, gc = 0;            // features, RRDB blocks, growth channels of the dense blocks
    int64_t shuffle = 1;                       // pixel-unshuffle factor in front (1: none)
    int64_t upsamplings = 0;                   // nearest 2x + conv + LeakyReLU stages
    int64_t scale = 0;                         // output pixels per input pixel: 2^upsamplings / shuffle
    EsrganConv conv_first, conv_body, conv_hr, conv_last;
    std::vector<EsrganConv> conv_up;                        // one per upsampling
    std::vector<std::vector<std::vector<EsrganConv>>> rrdb; // [nb][3 dense blocks][5 convs]

    // The network on x [N, in_channels, H, W] float32: [N, out_channels, H * scale, W * scale], not clamped. H and W
    // that are not multiples of the unshuffle factor are padded by reflection and the output cropped (spandrel's
    // rule, so any size works).
    at::Tensor forward(const at::Tensor& x) const;
    // The network after the padding: H and W multiples of `shuffle` (tiles of upscale.h call this).
    at::Tensor forward_aligned(const at::Tensor& x) const;
    // "RRDBNet 4x (nf 64, nb 23, gc 32)" and the unshuffle factor when there is one.
    std::string describe() const;
};

// Reads `path` (.pth/.pt/.ckpt/.bin: torch.save; .safetensors), whatever its extension says. anchor::Error naming
// the file for a missing file, a corrupt one, or one that is not an RRDBNet.
EsrganModel load_esrgan(const std::string& path);
// The same from named tensors (any of the layouts above); `label` names the source in errors.
EsrganModel esrgan_from_tensors(const std::map<std::string, at::Tensor>& tensors, const std::string& label);

} // namespace anchor::unet
