// A single-file checkpoint of random weights with a model family's real shapes, in the original (LDM / SGM) names the
// loader reads: the memory and speed of models nobody can download here (an SDXL base file, fp16, is 6.9 GB) are
// measured on it. Also the smallest way for a test to get a checkpoint of any family's layout.
#pragma once

#include "unet/model/sd_family.h"

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <string>

namespace anchor::unet {

struct RandomCheckpointParams {
    SdFamily family = SdFamily::SDXL; // sd1 (SD 1.5: CLIP ViT-L) or sdxl (SDXL base: CLIP ViT-L + OpenCLIP bigG)
    torch::ScalarType dtype = torch::kHalf;
    int64_t seed = 0;
    double stddev = 0.02; // weights ~ N(0, stddev); norm weights 1, biases 0
    std::string output;
    bool overwrite = false;
    void validate() const; // ParamError naming the field
};

// Writes the checkpoint (streamed; one component in memory at a time) and returns its tensor bytes; `log` gets one
// line per component.
int64_t write_random_checkpoint(const RandomCheckpointParams& p, const std::function<void(const std::string&)>& log);

} // namespace anchor::unet
