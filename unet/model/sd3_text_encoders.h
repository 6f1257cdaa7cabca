// The text encoders of an SD 3 / 3.5 original single file (sd3_medium_incl_clips_t5xxlfp16.safetensors and the like)
// or of a folder given next to one (--text-encoders DIR). Stability's files keep each encoder in Hugging Face names
// under one prefix per role (sd3_text_encoder_prefix below): CLIP-L
// (text_encoders.clip_l.transformer.*), OpenCLIP bigG (text_encoders.clip_g.transformer.*, with text_projection) and
// T5-XXL (text_encoders.t5xxl.transformer.*), as diffusers' single_file_utils and ComfyUI read them.
#pragma once

#include "unet/model/clip_text.h"
#include "unet/model/clip_tokenizer.h"
#include "unet/model/t5_encoder.h"
#include "unet/model/t5_tokenizer.h"

#include <torch/torch.h>

#include <string>
#include <vector>

namespace anchor {
class WeightMap;
}

namespace anchor::unet {

// The single-file name prefixes of the three roles (diffusers' single_file_utils, ComfyUI's sd3_clip): CLIP-L
// "text_encoders.clip_l.transformer.", OpenCLIP bigG "text_encoders.clip_g.transformer." (with text_projection),
// T5-XXL "text_encoders.t5xxl.transformer." (shared.weight, encoder.*). Below each, the Hugging Face names.
enum class Sd3TextRole { ClipL, ClipG, T5xxl };
std::string sd3_text_encoder_prefix(Sd3TextRole role);

struct SD3TextEncoders {
    ClipTokenizer tokenizer, tokenizer_2;
    ClipTextModel text_encoder{nullptr}, text_encoder_2{nullptr}; // null: neither the file nor the folder has it
    T5EncoderModel text_encoder_3{nullptr};                       // null: absent or not loaded (zeros stand in)
    T5Tokenizer tokenizer_3;
    std::vector<std::string> sources; // where each loaded encoder came from ("CLIP-L: file", ...), for logs
};

// Refuses what a single file may hold that this loader would read wrongly: ComfyUI's scaled fp8 weights (a
// `scaled_fp8` marker and per-tensor `.scale_weight`: the stored F8_E4M3 values are not the weights). Throws
// anchor::Error naming the file, the tensor and its dtype.
void check_sd3_single_file_weights(const WeightMap& file, const std::string& path);

// The three encoders for the single file `file` (read from `path`), each from the first place that has it:
// 1. the file, under its role's prefix; the config from `dir`'s text_encoder(_2, _3)/config.json when there is one
//    (as diffusers' from_single_file(config=...)), else from shapes (ClipTextConfig / T5EncoderConfig
//    ::detect_from_weights) with the role's activation (CLIP-L quick_gelu, bigG gelu). CLIP-L's projection is the
//    identity, whatever the file holds, as diffusers (torch.eye) and ComfyUI (the unprojected pooled output) use it;
// 2. `dir` as an SD 3 diffusers folder: text_encoder/, text_encoder_2/, text_encoder_3/;
// 3. `dir` as Stability's text_encoders/ folder: clip_l.safetensors, clip_g.safetensors, t5xxl*.safetensors (one).
// Tokenizers: `dir`'s tokenizer/, tokenizer_2/ (else the bundled CLIP vocabulary, tokenizer_2 padding with "!"),
// tokenizer_3/ or `dir` itself with spiece.model. Without either CLIP encoder both stay null (a transformer-only
// file); with only one of them, or T5 weights without a T5 tokenizer, throws anchor::Error saying what is missing and
// where it was looked for. Every encoder's missing / wrong-shape tensors are reported in one error. `load_t5` false
// leaves T5 unread. F8_E4M3 tensors arrive decoded to bfloat16 (cache/io/safetensors.h).
SD3TextEncoders load_sd3_text_encoders(const WeightMap& file, const std::string& path, const std::string& dir,
                                       torch::ScalarType dtype, bool load_t5);

} // namespace anchor::unet
