#include "text/gpt2/gpt2_load.h"

#include "cache/io/error.h"
#include "text/params.h"

#include <fstream>
#include <sstream>

namespace anchor::text {

const EnumTable<DecodeWeights>& decode_weight_table() {
    static const EnumTable<DecodeWeights> t = {
        {"f32", DecodeWeights::F32}, {"f16", DecodeWeights::F16}, {"q8_0", DecodeWeights::Q8_0}, {"q4_0", DecodeWeights::Q4_0}};
    return t;
}

void Gpt2ModelParams::validate() const {
    if (model.empty()) throw ParamError("model", "is empty: a GPT-2 folder, .safetensors file or index is needed");
    if (n_head < 0) throw ParamError("n_head", "must be >= 0, got " + std::to_string(n_head));
    placement.validate();
}

LoadedGpt2 load_gpt2_model(const Gpt2ModelParams& p) {
    p.validate();
    auto loaded = load_gpt2(p.model, p.n_head);
    loaded.model->place(p.placement);
    loaded.model->set_decode_weights(p.decode_weights);
    return loaded;
}

Gpt2Tokenizer load_gpt2_tokenizer(const Gpt2ModelParams& p, const LoadedGpt2& m) {
    if (!p.vocab.empty()) return Gpt2Tokenizer::from_dir(p.vocab);
    if (!m.folder.empty() && Gpt2Tokenizer::dir_has_vocab(m.folder)) return Gpt2Tokenizer::from_dir(m.folder);
    return Gpt2Tokenizer::load_default();
}

} // namespace anchor::text
