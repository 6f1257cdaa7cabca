// SD 3 / 3.5 LoRA targets (see unet/model/lora_sd3.h).
#include "unet/model/lora_sd3.h"

#include "cache/io/error.h"
#include "cache/util/strings.h"
#include "unet/model/name_conversion.h"
#include "unet/pipeline/sd3_pipeline.h"

#include <algorithm>

namespace anchor::unet {

namespace {

std::string sd3_lora_underscored(std::string s) {
    std::replace(s.begin(), s.end(), '.', '_');
    return s;
}

// The transformer's weights under Stability's single-file module names (`_` for `.`, no suffix): each original
// module's rows, from the diffusers weights it was split into, in the original's row order.
std::map<std::string, std::vector<LoraPiece>> sd3_original_modules(const LoraTargets::Part& part, int64_t width,
                                                                  int num_layers) {
    struct Rows {
        int64_t begin;
        LoraPiece piece;
    };
    std::map<std::string, std::vector<Rows>> by_original;
    for (const auto& [name, t] : part.weights) {
        if (!ends_with(name, ".weight") || (t.dim() != 2 && t.dim() != 4)) continue;
        const Sd3Source src = sd3_source(name, width, num_layers);
        const std::string stem = src.name.substr(0, src.name.size() - 7); // without ".weight"
        by_original[sd3_lora_underscored(stem)].push_back({std::max<int64_t>(src.row_begin, 0), {name, src.swap_halves}});
    }
    std::map<std::string, std::vector<LoraPiece>> out;
    for (auto& [key, rows] : by_original) {
        std::sort(rows.begin(), rows.end(), [](const Rows& a, const Rows& b) { return a.begin < b.begin; });
        for (const auto& r : rows) out[key].push_back(r.piece);
    }
    return out;
}

} // namespace

LoraTargets sd3_lora_targets(SD3Models& m) {
    LoraTargets t;
    auto add = [&](torch::nn::Module& mod, LoraComponent c) {
        LoraTargets::Part p{c, {}, nullptr, {}, {}};
        for (const auto& np : mod.named_parameters(true)) p.weights[np.key()] = np.value();
        t.parts.push_back(std::move(p));
    };
    if (m.transformer) {
        add(*m.transformer, LoraComponent::Transformer);
        auto& p = t.parts.back();
        const auto& c = m.transformer->config();
        p.grouped = sd3_original_modules(p, c.inner_dim(), c.num_layers);
        // sd-scripts / ComfyUI write lora_unet_, OneTrainer lora_transformer_ (diffusers' module names).
        p.kohya_prefixes = {"lora_unet_", "lora_transformer_"};
    }
    if (m.text_encoder) add(*m.text_encoder, LoraComponent::TextEncoder);
    if (m.text_encoder_2) add(*m.text_encoder_2, LoraComponent::TextEncoder2);
    if (m.text_encoder_3) add(*m.text_encoder_3, LoraComponent::TextEncoder3);
    if (!m.text_encoder)
        for (const char* pre : {"text_encoder.", "lora_te1_"}) t.absent[pre] = "the CLIP-L text encoder is not loaded";
    if (!m.text_encoder_2)
        for (const char* pre : {"text_encoder_2.", "lora_te2_"}) t.absent[pre] = "the CLIP-G text encoder is not loaded";
    if (!m.text_encoder_3)
        for (const char* pre : {"text_encoder_3.", "lora_te3_"})
            t.absent[pre] = "T5 (text_encoder_3) is not loaded: --no-t5 or no text_encoder_3/";
    return t;
}

std::vector<LoraApplied> apply_sd3_loras(SD3Models& m, const std::vector<LoraSpec>& loras) {
    if (!m.transformer) throw Error("SD 3 LoRA: the model '" + m.source + "' has no transformer loaded");
    auto applied = merge_loras(sd3_lora_targets(m), loras);
    m.loras.insert(m.loras.end(), applied.begin(), applied.end());
    return applied;
}

} // namespace anchor::unet
