// LoRA on Stable Diffusion 3 / 3.5 (unet/model/lora.h's merge rule, W' = W + m (alpha / rank) up @ down, on the MMDiT
// and its text encoders). The file layouts users download:
//   diffusers/PEFT: `transformer.<module>.lora_A.weight` / `.lora_B.weight` (diffusers' SD3LoraLoaderMixin), the CLIP
//     encoders' `text_encoder.` / `text_encoder_2.`, T5's `text_encoder_3.`; alpha from a `.alpha` tensor, else from
//     the LoraConfig diffusers writes into the header (`lora_adapter_metadata`: lora_alpha, alpha_pattern,
//     use_rslora), else alpha = rank (what diffusers does without either);
//   kohya/sd-scripts (and ComfyUI): `lora_unet_<module>` with `.lora_down` / `.lora_up` / `.alpha`, the module in
//     Stability's single-file names (`joint_blocks_N_x_block_attn_qkv`: one module over the fused q, k, v rows;
//     `..._adaLN_modulation_1` of the last context block and `final_layer_adaLN_modulation_1` in (shift, scale)
//     order) or in diffusers' names, OneTrainer's `lora_transformer_<diffusers module>`, and `lora_te1_` /
//     `lora_te2_` / `lora_te3_` for CLIP-L, CLIP-G and T5.
// The single-file names go through the one name conversion (sd3_source in unet/model/name_conversion.h).
#pragma once

#include "unet/model/lora.h"

#include <string>
#include <vector>

namespace anchor::unet {

struct SD3Models;

// The weights of `m` a LoRA can change (the transformer and the loaded text encoders). The text-encoder tensors of a
// LoRA whose encoder is not loaded (T5 under --no-t5, a transformer-only folder) are skipped and counted.
LoraTargets sd3_lora_targets(SD3Models& m);

// Merges each LoRA in order into `m` (read and matched first, so a bad file leaves the weights as loaded; an
// anchor::Error names the file and every tensor that does not fit) and appends the records to m.loras.
// ParamError("loras") for a file that does not exist.
std::vector<LoraApplied> apply_sd3_loras(SD3Models& m, const std::vector<LoraSpec>& loras);

} // namespace anchor::unet
