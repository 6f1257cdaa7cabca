// A GPT-2 as the text programs load it: the model (folder, file or index), its tokenizer and the decode weights.
#pragma once

#include "cache/io/enum_table.h"
#include "text/gpt2/gpt2_model.h"
#include "text/gpt2/gpt2_tokenizer.h"

#include <string>

namespace anchor::text {

// The weights one-token steps read (Gpt2ModelImpl::set_decode_weights): "f32", "f16", "q8_0", "q4_0".
const EnumTable<DecodeWeights>& decode_weight_table();

struct Gpt2ModelParams {
    std::string model;  // folder (config.json + any *.safetensors), .safetensors file or *.safetensors.index.json
    std::string vocab;  // tokenizer folder; "": the model folder when it has one, else Gpt2Tokenizer::default_dir()
    int64_t n_head = 0; // head count when the model has no config.json (0: n_embd / 64)
    DecodeWeights decode_weights = DecodeWeights::F32;
    Placement placement; // --device / --dtype (Gpt2ModelImpl::place); decode copies need CPU float32
    void validate() const; // ParamError naming the field
};

// load_gpt2 with the placement and the decode weights applied.
LoadedGpt2 load_gpt2_model(const Gpt2ModelParams& p);
// The tokenizer of `p` for the loaded model `m` (see Gpt2ModelParams::vocab).
Gpt2Tokenizer load_gpt2_tokenizer(const Gpt2ModelParams& p, const LoadedGpt2& m);

} // namespace anchor::text
