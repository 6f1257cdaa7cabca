// Control-image preprocessors (`--control-preprocess`, the A1111 API unit's `module`): what sd-webui-controlnet's
// annotators do to a photo before the ControlNet sees it. Canny: OpenCV's cv2.Canny(img, low, high) on the RGB image
// (the gradient of the strongest channel, L1 norm, 3x3 Sobel, as the extension calls it), edges 255 on 0, the one
// channel repeated to RGB (its HWC3). Needs a build with OpenCV (ANCHOR_HAVE_OPENCV); without it a ParamError.
#pragma once

#include "cache/io/enum_table.h"

#include <torch/torch.h>

#include <string>

namespace anchor::unet {

enum class ControlPreprocess { None, Canny };
const EnumTable<ControlPreprocess>& control_preprocess_table(); // "none", "canny"

struct ControlPreprocessSpec {
    ControlPreprocess kind = ControlPreprocess::None;
    double low = 100, high = 200; // A1111's defaults (threshold_a, threshold_b)
    // "none", "canny" or "canny:LOW:HIGH"; ParamError(field) naming the forms.
    static ControlPreprocessSpec parse(const std::string& text, const std::string& field);
};

// uint8 [H, W, 3] (or [N, H, W, 3]) RGB -> the preprocessed image, the same shape and dtype.
torch::Tensor preprocess_control_image(const torch::Tensor& rgb_u8, const ControlPreprocessSpec& spec,
                                       const std::string& field = "control_preprocess");

} // namespace anchor::unet
