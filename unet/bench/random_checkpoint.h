// A single-file checkpoint of random weights with a model family's real shapes, in the original (LDM / SGM) names the
// loader reads: the memory and speed of models nobody can download here (an SDXL base file, fp16, is 6.9 GB) are
// measured on it. Also the smallest way for a test to get a checkpoint of any family's layout.
#pragma once

#include "unet/bench/mmdit_bench.h"
#include "unet/model/sd_family.h"

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace anchor::unet {

struct RandomCheckpointParams {
    SdFamily family = SdFamily::SDXL; // sd1 (SD 1.5: CLIP ViT-L) or sdxl (SDXL base: CLIP ViT-L + OpenCLIP bigG)
    torch::ScalarType dtype = torch::kHalf;
    int64_t seed = 0;
    double stddev = 0.02; // weights ~ N(0, stddev); norm weights 1, biases 0
    std::string output;
    bool overwrite = false;
    // SD 3.5 Medium / Large instead of `family`: the transformer in Stability's single-file names
    // (model.diffusion_model.joint_blocks.N...), SD 3's VAE (first_stage_model.*) and, with text_encoders, CLIP-L,
    // OpenCLIP bigG and T5-XXL under text_encoders.{clip_l,clip_g,t5xxl}.transformer.* (as
    // sd3_medium_incl_clips_t5xxlfp16.safetensors). Sizes in bf16: Medium 5 GB, with the text encoders 16 GB; Large
    // 16 GB (32 GB with them).
    std::optional<Sd3Variant> sd3;
    bool text_encoders = false;
    void validate() const; // ParamError naming the field
};

// The SD 3 single file of `write_random_checkpoint` for given configs (tests use tiny ones); null configs leave that
// part out.
struct RandomSd3Parts {
    SD3TransformerConfig transformer;
    std::optional<VaeConfig> vae;
    std::optional<ClipTextConfig> clip_l, clip_g;
    std::optional<T5EncoderConfig> t5;
};
int64_t write_random_sd3_checkpoint(const RandomCheckpointParams& p, const RandomSd3Parts& parts,
                                    const std::function<void(const std::string&)>& log);

// Stability's single-file name of a diffusers SD3Transformer2DModel tensor (without model.diffusion_model.), the
// inverse of sd3_transformer_weights_from_single_file: q, k and v of one attention map to the same fused `qkv`
// tensor (rows q, k, v). Throws for names the table lacks.
std::string sd3_single_file_name(const std::string& diffusers_name);

// Writes the checkpoint (streamed; one component in memory at a time) and returns its tensor bytes; `log` gets one
// line per component.
int64_t write_random_checkpoint(const RandomCheckpointParams& p, const std::function<void(const std::string&)>& log);

} // namespace anchor::unet
