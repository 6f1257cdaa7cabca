// Random-weight GGUF models of the published shapes (dlm_random.h).
#include "text/diffusion/families/dlm_random.h"

#include "cache/io/error.h"
#include "text/io/gguf.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cstdio>

namespace anchor::text {

const std::vector<std::string>& dlm_random_presets() {
    static const std::vector<std::string> p = {"llada-8b", "dream-7b", "llada-tiny", "dream-tiny"};
    return p;
}

DlmConfig dlm_random_preset(const std::string& name) {
    DlmConfig c;
    if (name == "llada-8b" || name == "llada-tiny") {
        // GSAI-ML/LLaDA-8B-Base config.json: d_model 4096, 32 layers and heads, mlp_hidden_size 12288, rope_theta 5e5.
        c.family = DlmFamily::Llada;
        c.shift = false, c.qkv_bias = false, c.rope_theta = 500000.0, c.norm_eps = 1e-5;
        if (name == "llada-8b") {
            c.hidden_size = 4096, c.n_layers = 32, c.n_heads = 32, c.n_kv_heads = 32, c.intermediate_size = 12288;
            c.vocab_size = 126464, c.max_positions = 4096, c.mask_token_id = 126336, c.eos_token_ids = {126081};
        } else {
            c.hidden_size = 64, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = 4, c.intermediate_size = 96;
            c.vocab_size = 512, c.max_positions = 256, c.mask_token_id = 500, c.eos_token_ids = {501};
        }
    } else if (name == "dream-7b" || name == "dream-tiny") {
        // Dream-org/Dream-v0-Base-7B (Qwen2.5-7B): hidden 3584, 28 layers, 28 heads over 4 K/V heads, ffn 18944.
        c.family = DlmFamily::Dream;
        c.shift = true, c.qkv_bias = true, c.rope_theta = 1000000.0, c.norm_eps = 1e-6;
        if (name == "dream-7b") {
            c.hidden_size = 3584, c.n_layers = 28, c.n_heads = 28, c.n_kv_heads = 4, c.intermediate_size = 18944;
            c.vocab_size = 152064, c.max_positions = 131072, c.mask_token_id = 151666, c.eos_token_ids = {151643};
        } else {
            c.hidden_size = 64, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = 2, c.intermediate_size = 96;
            c.vocab_size = 512, c.max_positions = 256, c.mask_token_id = 500, c.eos_token_ids = {501};
        }
    } else {
        std::string all;
        for (const auto& p : dlm_random_presets()) all += (all.empty() ? "" : ", ") + p;
        throw Error("unknown random model preset '" + name + "' (choices: " + all + ")");
    }
    c.validate();
    return c;
}

namespace {

GgmlType dlm_random_ggml_type(kernels::QWeightType t) {
    switch (t) {
    case kernels::QWeightType::F32: return GgmlType::F32;
    case kernels::QWeightType::F16: return GgmlType::F16;
    case kernels::QWeightType::BF16: return GgmlType::BF16;
    case kernels::QWeightType::Q8_0: return GgmlType::Q8_0;
    case kernels::QWeightType::Q4_0: return GgmlType::Q4_0;
    }
    return GgmlType::F32;
}

// The vocabulary llama.cpp's SPM tokenizer reads: <unk>, <s>, </s>, 256 byte tokens, fillers; special ids as control.
std::vector<GgufKv> dlm_random_vocab(const DlmConfig& c) {
    nlohmann::json tokens = nlohmann::json::array(), scores = nlohmann::json::array(),
                   types = nlohmann::json::array();
    for (int64_t i = 0; i < c.vocab_size; ++i) {
        std::string t;
        int type = 1; // normal
        if (i == 0) {
            t = "<unk>", type = 2;
        } else if (i == 1 || i == 2) {
            t = i == 1 ? "<s>" : "</s>", type = 3;
        } else if (i < 3 + 256) {
            char b[8];
            std::snprintf(b, sizeof(b), "<0x%02X>", int(i - 3));
            t = b, type = 6;
        } else {
            t = "\xE2\x96\x81w" + std::to_string(i); // "▁w<i>"
        }
        if (i == c.mask_token_id) t = "<|mdm_mask|>", type = 3;
        if (std::count(c.eos_token_ids.begin(), c.eos_token_ids.end(), i)) t = "<|end_" + std::to_string(i) + "|>", type = 3;
        tokens.push_back(t), scores.push_back(0.0f), types.push_back(type);
    }
    using T = GgufValueType;
    return {{"tokenizer.ggml.model", T::String, "llama"},
            {"tokenizer.ggml.tokens", T::Array, tokens, T::String},
            {"tokenizer.ggml.scores", T::Array, scores, T::F32},
            {"tokenizer.ggml.token_type", T::Array, types, T::I32},
            {"tokenizer.ggml.bos_token_id", T::U32, 1},
            {"tokenizer.ggml.eos_token_id", T::U32, c.eos_token_ids.empty() ? 2 : c.eos_token_ids.front()},
            {"tokenizer.ggml.mask_token_id", T::U32, c.mask_token_id},
            {"tokenizer.ggml.add_bos_token", T::Bool, false}};
}

} // namespace

void write_random_dlm_gguf(const std::string& path, const DlmConfig& c, kernels::QWeightType weights, uint64_t seed) {
    c.validate();
    if (c.family == DlmFamily::DiffuGpt) throw Error("random GGUF models are LLaDA or Dream (DiffuGPT is read from folders)");
    const std::string arch = c.family == DlmFamily::Llada ? "llada" : "dream";
    const int64_t D = c.hidden_size, F = c.intermediate_size, KVD = c.n_kv_heads * c.head_dim(), V = c.vocab_size;
    using T = GgufValueType;
    std::vector<GgufKv> kv = {{"general.architecture", T::String, arch},
                              {"general.name", T::String, "random " + arch},
                              {arch + ".context_length", T::U32, c.max_positions},
                              {arch + ".embedding_length", T::U32, D},
                              {arch + ".block_count", T::U32, c.n_layers},
                              {arch + ".feed_forward_length", T::U32, F},
                              {arch + ".attention.head_count", T::U32, c.n_heads},
                              {arch + ".attention.head_count_kv", T::U32, c.n_kv_heads},
                              {arch + ".rope.dimension_count", T::U32, c.head_dim()},
                              {arch + ".rope.freq_base", T::F32, c.rope_theta},
                              {arch + ".attention.layer_norm_rms_epsilon", T::F32, c.norm_eps},
                              {arch + ".vocab_size", T::U32, V},
                              {"diffusion.shift_logits", T::Bool, c.shift}};
    for (auto& e : dlm_random_vocab(c)) kv.push_back(std::move(e));

    const GgmlType wt = dlm_random_ggml_type(weights);
    std::vector<GgufWriter::Tensor> tensors = {{"token_embd.weight", {V, D}, wt}};
    for (int64_t i = 0; i < c.n_layers; ++i) {
        const std::string b = "blk." + std::to_string(i) + ".";
        tensors.push_back({b + "attn_norm.weight", {D}, GgmlType::F32});
        tensors.push_back({b + "attn_q.weight", {D, D}, wt});
        tensors.push_back({b + "attn_k.weight", {KVD, D}, wt});
        tensors.push_back({b + "attn_v.weight", {KVD, D}, wt});
        if (c.qkv_bias) {
            tensors.push_back({b + "attn_q.bias", {D}, GgmlType::F32});
            tensors.push_back({b + "attn_k.bias", {KVD}, GgmlType::F32});
            tensors.push_back({b + "attn_v.bias", {KVD}, GgmlType::F32});
        }
        tensors.push_back({b + "attn_output.weight", {D, D}, wt});
        tensors.push_back({b + "ffn_norm.weight", {D}, GgmlType::F32});
        tensors.push_back({b + "ffn_gate.weight", {F, D}, wt});
        tensors.push_back({b + "ffn_up.weight", {F, D}, wt});
        tensors.push_back({b + "ffn_down.weight", {D, F}, wt});
    }
    tensors.push_back({"output_norm.weight", {D}, GgmlType::F32});
    if (!c.tie_embeddings) tensors.push_back({"output.weight", {V, D}, wt});

    GgufWriter w(path, kv, tensors);
    auto gen = at::detail::createCPUGenerator(seed);
    torch::NoGradGuard ng;
    while (const auto* t = w.current()) {
        const int64_t cols = t->shape.back();
        int64_t rows = 1;
        for (size_t i = 0; i + 1 < t->shape.size(); ++i) rows *= t->shape[i];
        const bool norm = t->name.find("_norm.") != std::string::npos;
        // Slabs of at most ~4M values: the generator's memory stays a few tens of MB whatever the model size.
        const int64_t slab = std::max<int64_t>(1, (int64_t(1) << 22) / cols);
        for (int64_t r0 = 0; r0 < rows; r0 += slab) {
            const int64_t n = std::min(slab, rows - r0);
            auto v = norm ? torch::ones({n, cols}, torch::kFloat32)
                          : torch::randn({n, cols}, gen, torch::kFloat32).mul_(0.02).contiguous();
            w.append(v.data_ptr<float>(), n * cols);
        }
    }
    w.finish();
}

} // namespace anchor::text
