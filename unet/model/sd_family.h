// Stable Diffusion model families, told apart by tensor shapes only (as stable-diffusion.cpp's get_sd_version()):
// one rule for every layout, fed with the shapes that layout shows.
#pragma once

#include "cache/io/enum_table.h"

#include <cstdint>
#include <string>
#include <vector>

namespace anchor {
class WeightMap;
}

namespace anchor::unet {

enum class SdFamily { SD1, SD2, SDXL, SDXLRefiner, SD3 };
// "sd1", "sd2", "sdxl", "sdxl-refiner", "sd3" (SD 3 / 3.5: an MMDiT transformer, unet/model/mmdit.h)
const EnumTable<SdFamily>& sd_family_table();

// What the family is decided from.
struct SdShapes {
    int64_t text_width = 0;                // hidden size of the (first) text encoder; 0 when there is none
    bool open_clip_text = false;           // the text encoder is in OpenCLIP layout (SD 2.x single files)
    int64_t second_text_width = 0;         // hidden size of a second text encoder (SDXL); 0 when there is none
    int64_t cross_attention_dim = 0;       // the UNet's cross-attention width
    bool linear_projection = false;        // Transformer2D proj_in/proj_out are Linear (SD 2.x, SDXL)
    bool added_conditioning = false;       // the UNet has text/time added conditioning (SDXL: add_embedding, label_emb)
    std::string added_conditioning_tensor; // the tensor that showed it (for messages)
    // The denoiser is an MMDiT with joint text/image blocks (SD 3 / 3.5): diffusers' transformer_blocks.N.attn.add_q_proj
    // or the original single file's model.diffusion_model.joint_blocks.N.
    bool joint_blocks = false;
};

// SD1: CLIP ViT-L text (768) and 1x1-conv projections; SD2: OpenCLIP ViT-H text (1024, or the OpenCLIP layout) or
// linear projections with a 1024-wide context; SDXL: added conditioning with two text encoders; the SDXL refiner:
// added conditioning with the second (OpenCLIP bigG) encoder only; SD3: joint transformer blocks, whatever the text
// encoders.
SdFamily sd_family(const SdShapes& s);

// The shapes of an original single-file checkpoint (model.diffusion_model.*, cond_stage_model.* / conditioner.*).
SdShapes sd_shapes_of_single_file(const WeightMap& file);

// Attention heads per UNet level when the config does not say (single files, shape-only detection): SD 1.x has 8
// heads everywhere, SD 2.x and SDXL heads of 64 channels.
std::vector<int> default_unet_heads(const std::vector<int>& block_out_channels, bool heads_of_64);

} // namespace anchor::unet
