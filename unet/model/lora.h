// LoRA files merged into the loaded weights (Hu et al. 2021, "LoRA: Low-Rank Adaptation"): for every target weight W
// and every LoRA j with multiplier m_j, W' = W + sum_j m_j * (alpha_j / rank_j) * (up_j @ down_j), in float32, as the
// reference merges them (tests/golden/sd/lora_sd15_tiny/README.md, "Merge rule"). Two layouts are read:
//
//   kohya/sd-scripts: `lora_unet_<module>` / `lora_te_<module>` (SDXL: `lora_te1_`, `lora_te2_`) with the module
//     path's `.` written `_`, then `.lora_down.weight`, `.lora_up.weight` and an optional 0-dim `.alpha`; LoCon conv
//     modules have a [r, in, kh, kw] down and a [out, r, 1, 1] up. UNet modules may also be spelled in the original
//     LDM/SGM layout (`input_blocks_4_1_...`, `middle_block_...`, `output_blocks_...`), named through
//     unet/model/name_conversion.h.
//   diffusers/PEFT: `unet.<module>.lora_A.weight` (down) / `.lora_B.weight` (up), `text_encoder.` /
//     `text_encoder_2.`; no alpha in the file means alpha = rank (what diffusers 0.27.2 does for such files).
//   SD 3 / 3.5 (unet/model/lora_sd3.h): PEFT `transformer.<module>`, kohya/sd-scripts `lora_unet_<module>` in
//     diffusers' or Stability's single-file names (`joint_blocks_N_x_block_attn_qkv`: one module over the fused
//     q, k, v rows), `lora_te1_` / `lora_te2_` / `lora_te3_` (CLIP-L, CLIP-G, T5).
//
// Module names contain `_` themselves (`transformer_blocks`, `to_q`), so a kohya name is never turned back into a
// path: the kohya name of every weight of the model is built from the model's own parameter names and the file's keys
// are looked up in that table (as sd-scripts and A1111 match them). Every tensor of a file must match; all that do
// not are reported at once, naming the file.
#pragma once

#include "cache/io/enum_table.h"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

namespace anchor::unet {

struct SDModels;
struct UNetConfig;

// One LoRA to merge: `path` to a .safetensors file, `multiplier` its weight m (A1111's <lora:name:m>, diffusers'
// lora_scale).
struct LoraSpec {
    std::string path;
    double multiplier = 1;
};

// "FILE[:MULTIPLIER]" (an existing file named with a ':' is taken whole). ParamError(field) for an empty file name or
// a multiplier that is not a finite number.
LoraSpec parse_lora_spec(const std::string& spec, const std::string& field = "loras");

// A1111's prompt tags `<lora:NAME>` / `<lora:NAME:MULTIPLIER>`: removed from every prompt (the prompts are encoded
// without them), NAME resolved to `lora_model_dir`/NAME.safetensors. ParamError("lora_model_dir") when a tag names
// a file that does not exist or no folder is given; ParamError("prompts") for a malformed tag or prompts of one job
// naming different LoRAs (they are merged once, at load).
struct PromptLoras {
    std::vector<std::string> prompts; // without the tags
    std::vector<LoraSpec> loras;      // in the order of the first prompt's tags
};
PromptLoras take_prompt_loras(const std::vector<std::string>& prompts, const std::string& lora_model_dir);

// The LoRAs of one run: every "FILE[:MULTIPLIER]" of `specs` (parse_lora_spec, field "loras"), then the <lora:...>
// tags of `prompts` (take_prompt_loras), which are removed from `prompts`.
std::vector<LoraSpec> run_loras(const std::vector<std::string>& specs, const std::string& lora_model_dir,
                                std::vector<std::string>& prompts);

// The model part a LoRA target belongs to, and its prefixes.
enum class LoraComponent { Unet, TextEncoder, TextEncoder2, Transformer, TextEncoder3 };
// "unet", "text_encoder", "text_encoder_2", "transformer", "text_encoder_3" (PEFT prefixes)
const EnumTable<LoraComponent>& lora_component_table();

// A module of a LoRA file that spans rows of several weights (a fused qkv of Stability's SD 3 layout): its output rows
// are the pieces' rows in order; `swap_halves` when the file's two halves of that piece are the weight's in the other
// order ((shift, scale) against diffusers' (scale, shift)).
struct LoraPiece {
    std::string weight;
    bool swap_halves = false;
};

// The weights a LoRA can change: parameter names (diffusers / HF, as the state dicts) -> tensors. The tensors of a
// loaded module are its parameters, merged in place.
struct LoraTargets {
    struct Part {
        LoraComponent component;
        std::map<std::string, torch::Tensor> weights;
        const UNetConfig* ldm = nullptr; // UNet: also accept the original-layout (LDM/SGM) kohya spellings
        // Further kohya module names (without `lora_..._`, with `_`) -> the rows of the weights they change, for
        // layouts whose modules are not one parameter each (SD 3's single-file names).
        std::map<std::string, std::vector<LoraPiece>> grouped;
        std::vector<std::string> kohya_prefixes; // empty: lora_unet_ / lora_te_ (lora_te1_, lora_te2_ for SDXL)
    };
    std::vector<Part> parts;
    // Tensor-name prefixes of model parts that exist but are not loaded (SD 3's T5 under --no-t5) -> why: such
    // tensors are skipped and counted, not reported as unmatched.
    std::map<std::string, std::string> absent;
};
// The UNet and text encoder of `models` (those loaded).
LoraTargets lora_targets(SDModels& models);

// The kohya spellings of every 2-D / 4-D `.weight` of a part: `lora_<unet|te|te1|te2>_<module with . -> _>`
// (diffusers path, and for the UNet with `ldm` also the original layout's), each to the parameter name. `te_prefix`:
// "te" for a model with one text encoder, "te1"/"te2" for SDXL's two.
std::map<std::string, std::string> kohya_names(const LoraTargets::Part& part, const std::string& te_prefix);

// One matched module of a LoRA file.
struct LoraModule {
    std::string key;         // the file's module stem (before .lora_down / .lora_A)
    LoraComponent component; // the part it changes
    std::string weight;      // the parameter name in that part
    torch::Tensor down, up;  // as stored (converted to float32 at merge)
    double alpha = 0;        // the stored alpha, else the rank
    bool alpha_stored = false;
    std::vector<LoraPiece> pieces; // when the module spans several weights (Part::grouped); `weight` is the first
    bool rslora = false;           // PEFT use_rslora: alpha / sqrt(rank)
    int64_t rank() const { return down.size(0); }
    double scale() const { return rslora ? alpha / std::sqrt(double(rank())) : alpha / double(rank()); }
};

struct LoraFile {
    std::string path;
    std::string format; // "kohya", "peft" (or "kohya+peft" for a file mixing both)
    std::vector<LoraModule> modules;
    std::vector<std::string> skipped; // tensors of parts that are not loaded (LoraTargets::absent)
};

// Reads `path` and matches every tensor to a weight of `targets` (names and shapes). Throws anchor::Error naming the
// file and listing every tensor that matches nothing, every module lacking its down or up, every shape that does
// not fit its weight.
LoraFile read_lora(const std::string& path, const LoraTargets& targets);

// (alpha / rank) * (up @ down) reshaped to `weight_shape`, float32: linear [out, r] @ [r, in]; 1x1 conv and LoCon
// conv [out, r, 1, 1] with [r, in, kh, kw] as (up.reshape(out, r) @ down.reshape(r, -1)).reshape(out, in, kh, kw).
torch::Tensor lora_delta(const LoraModule& m, const std::vector<int64_t>& weight_shape);

// What was merged, for logs and the JSON sidecar.
struct LoraApplied {
    std::string name; // file stem
    std::string path;
    std::string sha256;
    std::string format;
    double multiplier = 1;
    int modules = 0; // matched modules
    std::map<std::string, int> modules_per_component;
    int skipped = 0; // tensors of model parts that were not loaded (LoraTargets::absent)
    nlohmann::json to_json() const;
};

// Merges each LoRA in order into `targets` (W += m * delta, in float32, then back to the weight's dtype).
std::vector<LoraApplied> merge_loras(const LoraTargets& targets, const std::vector<LoraSpec>& loras);
// The same into the UNet and text encoder of `models`; appends to models.loras. ParamError("loras") for a file that
// does not exist.
std::vector<LoraApplied> apply_loras(SDModels& models, const std::vector<LoraSpec>& loras);

nlohmann::json lora_records_json(const std::vector<LoraApplied>& loras);

} // namespace anchor::unet
