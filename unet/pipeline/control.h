// ControlNet in the sampling loop, as diffusers 0.27.2's StableDiffusionControlNetPipeline (pipelines/controlnet/
// pipeline_controlnet.py; see docs/controlnet.md): the control image prepared like its control_image_processor
// (resized to the output size with PIL's Lanczos, [0, 1], no normalisation), repeated for the batch and the CFG rows,
// each ControlNet's scale switched off outside [start, end) of the loop (controlnet_keep), guess mode's ControlNet
// run on the conditional rows only with zeros for the unconditional ones, several ControlNets' residuals added.
//
// The residuals are computed lazily, per UNet call (UNetCond::control, a ResidualSource): the ControlNet runs exactly
// the part of itself whose output the UNet consumes. A full UNet step runs the whole ControlNet; a DeepCache / freq
// shallow step runs only the ControlNet layers producing the skips the shallow path consumes (their residuals are
// added there; the deeper ones are in the reused feature, made at a full step with that step's control); a step the
// UNet does not evaluate runs no ControlNet either.
#pragma once

#include "unet/model/checkpoint.h"
#include "unet/model/controlnet.h"

#include <nlohmann/json_fwd.hpp>
#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

namespace anchor::unet {

// One ControlNet of a run (Txt2ImgParams::control). ParamError fields: "control_net", "control_image",
// "control_scale", "control_start", "control_end".
struct ControlParams {
    ControlNetModel net{nullptr};
    std::string source;      // the ControlNet's file or folder (messages)
    std::string image;       // the control image file
    torch::Tensor pixels;    // or its decoded pixels, uint8 [H, W, 3] or one per prompt [N, H, W, 3]
    double scale = 1.0;      // controlnet_conditioning_scale
    double start = 0.0;      // control_guidance_start: the share of the loop before the ControlNet acts
    double end = 1.0;        // control_guidance_end: the share after which it stops
    bool guess_mode = false; // diffusers' guess_mode (forced by a global_pool_conditions model)
};

// The control image(s) as uint8 [N, H, W, 3] RGB (read from the file when not given as pixels).
torch::Tensor control_image_rgb(const ControlParams& c);
// Width and height of the control image (header only for a file).
std::pair<int, int> control_image_size(const ControlParams& c);

// diffusers' prepare_image: each image resized to width x height (PIL Lanczos) when that differs, / 255 in float32,
// NCHW; one image repeated for the `batch` images, or one per prompt each repeated images_per_prompt times.
torch::Tensor prepare_control_image(const torch::Tensor& rgb_u8, int width, int height, int64_t batch,
                                    int images_per_prompt);

// controlnet_keep[i] of diffusers: 0 when i / n < start or (i + 1) / n > end, else 1.
double control_keep(int i, int n, double start, double end);

// Everything checked before a model runs: the ControlNet fits the UNet (controlnet_mismatch), the image readable and
// its count 1 or the number of prompts, scale finite, 0 <= start < end <= 1. `prompts` = number of prompts.
void validate_control(const std::vector<ControlParams>& control, const UNetConfig& unet, int64_t prompts);

// The ControlParams of a command line: ControlNet k (loaded with load_controlnet in `dtype`) with control image k; the
// scales, starts and ends each empty (the defaults 1, 0, 1), one for every ControlNet, or one per ControlNet.
// ParamError("control_image" / "control_scale" / "control_start" / "control_end") for other counts, naming both.
std::vector<ControlParams> make_control_params(const std::vector<std::string>& nets,
                                               const std::vector<std::string>& images,
                                               const std::vector<double>& scales, const std::vector<double>& starts,
                                               const std::vector<double>& ends, bool guess_mode,
                                               torch::ScalarType dtype = torch::kFloat);

// A ControlNet given the arithmetic of the UNet it feeds: its attention kernel, GEMM backend and device (the same
// kernels on both sides keep the residuals consistent with the UNet's own features), in eval mode.
void match_controlnet_to_unet(ControlNetModel& net, const SDModels& models);

// The ControlNets of a run made ready against the loaded models: `preprocess` applied to each control image (their
// pixels from here on), everything checked (validate_control, with `prompts` prompts), then each ControlNet matched
// to the UNet (match_controlnet_to_unet).
void prepare_control(std::vector<ControlParams>& control, const SDModels& models, const std::string& preprocess,
                     int64_t prompts);

// What the image sidecar records of the ControlNets (one object each): the model as given, the control image's file
// and SHA-256 (of the file, or of the pixels given), scale, start, end, guess mode.
nlohmann::json control_records_json(const std::vector<ControlParams>& control);

// The control of one sampling loop: the prepared images, per loop step the UNetCond with the ControlNets attached.
class ControlRun {
public:
    ControlRun() = default;
    // `width` x `height` the output size, `batch` images (prompts x images_per_prompt), `cfg` the UNet batch holds
    // [uncond; cond] rows, `steps` the loop steps that run.
    ControlRun(const std::vector<ControlParams>& control, int width, int height, int64_t batch, int images_per_prompt,
               bool cfg, int steps);
    bool active() const { return !units_.empty(); }
    // `base` with the ControlNets of loop step k (0-based among the steps that run) attached.
    UNetCond at(const UNetCond& base, int k) const;

private:
    struct Unit {
        ControlNetModel net{nullptr};
        torch::Tensor image; // rows as the UNet batch
        double scale = 1.0, start = 0.0, end = 1.0;
        bool guess = false;
    };
    std::vector<Unit> units_;
    int64_t batch_ = 0;
    bool cfg_ = false;
    int steps_ = 0;
};

} // namespace anchor::unet
