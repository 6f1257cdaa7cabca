// Golden checks of the published masked-diffusion LM families (tests/golden/text/dlm/generate/generate_dlm.py):
// a folder with dlm_case.json + dlm_case.safetensors next to the model. Every parameter comes from the case: the
// family, the [MASK] id, the tolerances, each forward's ids, each generation's sampler settings and the reference's
// random draws (replayed in order; a sampler asking for more or fewer draws than recorded fails the case).
#include "cache/io/error.h"
#include "cache/io/weight_map.h"
#include "tests/golden_runner/runner.h"
#include "text/diffusion/families/dlm_chat.h"
#include "text/diffusion/families/dlm_model.h"
#include "text/diffusion/families/dlm_sampler.h"
#include "text/io/gguf.h"

#include <nlohmann/json.hpp>

namespace anchor::golden {
namespace {

using namespace anchor::text;

std::map<std::string, torch::Tensor> dlm_case_tensors(const fs::path& f) {
    std::map<std::string, torch::Tensor> out;
    const WeightMap w = WeightMap::load_files({f.string()}); // alive while its file-backed tensors are copied
    for (const auto& [n, t] : w.all()) out[n] = t.clone();
    return out;
}

torch::Tensor dlm_need(const std::map<std::string, torch::Tensor>& t, const std::string& n) {
    auto it = t.find(n);
    if (it == t.end()) throw Error("dlm_case.safetensors has no tensor '" + n + "'");
    return it->second;
}

std::vector<CaseResult> run_dlm_case(const fs::path& dir, const Context& ctx) {
    const std::string base = relative_name(dir, ctx);
    const auto j = nlohmann::json::parse(read_text(dir / "dlm_case.json"));
    const auto tensors = dlm_case_tensors(dir / "dlm_case.safetensors");
    const std::string fam_name = j.at("family").get<std::string>();
    const DlmFamily fam = enum_from_string(dlm_family_table(), fam_name, "family");
    LoadedDlm loaded = load_dlm(dir.string(), fam, j.at("mask_token_id").get<int64_t>());
    auto& model = *loaded.model;
    const double atol = j.value("logits_atol", kAtol), rtol = j.value("logits_rtol", kRtol);
    std::vector<CaseResult> out;
    out.push_back(guarded(base + " [dlm-config]", [&](Stats& s) {
        const auto& c = model.config();
        s.check_true("shift", c.shift == j.at("shift").get<bool>(),
                     "the case says shift=" + std::to_string(j.at("shift").get<bool>()));
        s.check_true("mask id", c.mask_token_id == j.at("mask_token_id").get<int64_t>());
    }));
    for (const auto& f : j.value("forward", nlohmann::json::array())) {
        const std::string n = f.at("name").get<std::string>();
        out.push_back(guarded(base + " [" + n + "]", [&](Stats& s) {
            auto ids = dlm_need(tensors, n + ".input_ids").to(torch::kLong);
            s.check("logits", model.logits(ids), dlm_need(tensors, n + ".logits"), atol, rtol);
            // The cached range forward (Fast-dLLM's prefix/dual steps) over the same ids equals the full one.
            const int64_t L = ids.size(1);
            if (L >= 4) {
                DlmKvCache kv;
                model.forward(ids, 0, L, &kv);
                auto part = model.forward(ids, L / 2, L - 1, &kv);
                s.check("logits rows from the K/V cache", part,
                        dlm_need(tensors, n + ".logits").narrow(1, L / 2, L - 1 - L / 2), atol, rtol);
            }
        }));
    }
    // The same weights from llama.cpp-layout GGUF files (f32, q8_0): logits against the reference decoder run on each
    // file's (dequantised) weights.
    for (const auto& gg : j.value("gguf", nlohmann::json::array())) {
        const std::string file = gg.at("file").get<std::string>(), prefix = gg.at("logits_prefix").get<std::string>();
        out.push_back(guarded(base + " [" + file + "]", [&](Stats& s) {
            LoadedDlm lg = load_dlm((dir / file).string(), fam, -1);
            // The reference multiplies the dequantised weights in float32: the f32 products, not the default int8
            // ones (whose activation rounding is outside these tolerances; tests/test_dlm_families.cpp bounds it).
            lg.model->set_qgemm(kernels::QGemmArithmetic::F32);
            s.check_true("mask id from the GGUF", lg.model->config().mask_token_id == j.at("mask_token_id").get<int64_t>());
            s.check_true("shift from the GGUF", lg.model->config().shift == j.at("shift").get<bool>());
            for (const auto& f : j.value("forward", nlohmann::json::array())) {
                const std::string n = f.at("name").get<std::string>();
                s.check(n + " logits", lg.model->logits(dlm_need(tensors, n + ".input_ids").to(torch::kLong)),
                        dlm_need(tensors, prefix + n + ".logits"), gg.at("logits_atol").get<double>(),
                        gg.at("logits_rtol").get<double>());
            }
        }));
    }
    for (const auto& g : j.value("generate", nlohmann::json::array())) {
        const std::string n = g.at("name").get<std::string>();
        out.push_back(guarded(base + " [" + n + "]", [&](Stats& s) {
            const int64_t recorded = g.at("draws").get<int64_t>();
            int64_t used = 0;
            DlmDraws replay = [&](const std::vector<int64_t>& shape, torch::ScalarType dt) {
                if (used >= recorded) throw Error("the sampler asks for more random draws than the reference made");
                auto u = dlm_need(tensors, n + ".draw" + std::to_string(used++));
                if (u.sizes().vec() != shape || u.scalar_type() != dt)
                    throw Error("draw " + std::to_string(used - 1) + ": the sampler asks for another shape/dtype " +
                                "than the reference drew");
                return u;
            };
            const std::string sampler = g.at("sampler").get<std::string>();
            const int64_t steps = g.at("steps").get<int64_t>();
            torch::Tensor got;
            if (sampler == "diffugpt") {
                got = diffugpt_sample(model, dlm_need(tensors, n + ".input_ids"), dlm_need(tensors, n + ".src_mask"),
                                      steps, g.at("logits_temp").get<double>(), g.at("top_p").get<double>(), replay);
            } else if (sampler == "llada") {
                got = llada_sample(model, dlm_need(tensors, n + ".prompt_ids").to(torch::kLong), steps,
                                   g.at("gen_length").get<int64_t>(), g.at("block_length").get<int64_t>(),
                                   g.at("temperature").get<double>(),
                                   enum_from_string(dlm_remask_table(), g.at("remasking").get<std::string>(), "remasking"),
                                   replay);
            } else if (sampler == "dream") {
                std::optional<double> top_p;
                std::optional<int64_t> top_k;
                if (g.contains("top_p")) top_p = g["top_p"].get<double>();
                if (g.contains("top_k")) top_k = g["top_k"].get<int64_t>();
                got = dream_sample(model, dlm_need(tensors, n + ".prompt_ids").to(torch::kLong),
                                   g.at("gen_length").get<int64_t>(), steps, g.at("eps").get<double>(),
                                   g.at("temperature").get<double>(), top_p, top_k,
                                   enum_from_string(dlm_remask_table(), g.at("alg").get<std::string>(), "alg"), replay,
                                   g.at("alg_temp").get<double>());
            } else {
                throw Error("unknown sampler '" + sampler + "'");
            }
            s.check_equal("output_ids", got, dlm_need(tensors, n + ".output_ids").to(torch::kLong));
            s.check_true("draws", used == recorded,
                         "the sampler used " + std::to_string(used) + " of " + std::to_string(recorded) + " draws");
        }));
    }
    return out;
}

// tokenizer.json byte-level BPE (LLaDA's / Dream's layout) against the `tokenizers` library's encodings.
std::vector<CaseResult> run_dlm_tokenizer(const fs::path& dir, const Context& ctx) {
    const std::string base = relative_name(dir, ctx);
    const auto j = nlohmann::json::parse(read_text(dir / "dlm_tokenizer_cases.json"));
    const auto tok = load_hf_bpe_tokenizer((dir / j.at("tokenizer").get<std::string>()).string());
    std::vector<CaseResult> out;
    int k = 0;
    for (const auto& c : j.at("cases")) {
        out.push_back(guarded(base + " [tokenizer " + std::to_string(k++) + "]", [&](Stats& s) {
            const auto want = c.at("ids").get<std::vector<int64_t>>();
            const auto got = tok->encode_with_specials(c.at("text").get<std::string>());
            s.check_equal("ids", torch::tensor(got, torch::kLong), torch::tensor(want, torch::kLong));
            s.check_true("decode", tok->decode(want) == c.at("decoded_skip_special").get<std::string>(),
                         "decoded '" + tok->decode(want) + "'");
        }));
    }
    return out;
}

// GGUF container and dequantisation (text/io/gguf.h) against llama.cpp's gguf-py: header, metadata of every value
// type, tensor shapes/types, and each tensor's dequantised values; the quantisation error against the originals.
std::vector<CaseResult> run_gguf_case(const fs::path& dir, const Context& ctx) {
    const std::string base = relative_name(dir, ctx);
    const auto j = nlohmann::json::parse(read_text(dir / "gguf_case.json"));
    const auto tensors = dlm_case_tensors(dir / "gguf_case.safetensors");
    const auto g = GgufFile::open((dir / j.at("file").get<std::string>()).string());
    std::vector<CaseResult> out;
    out.push_back(guarded(base + " [gguf header]", [&](Stats& s) {
        s.check_true("version", g->version() == j.at("version").get<uint32_t>());
        s.check_true("alignment", g->alignment() == j.at("alignment").get<uint64_t>());
        s.check_true("tensor count", g->tensors().size() == j.at("tensors").size());
        for (const auto& [k, v] : j.at("metadata").items()) {
            const bool ok = g->metadata().contains(k) &&
                            (v.is_number_float() ? std::abs(g->metadata()[k].get<double>() - v.get<double>()) <= 0
                                                 : g->metadata()[k] == v);
            s.check_true("metadata " + k, ok, g->metadata().contains(k) ? g->metadata()[k].dump() : "absent");
        }
    }));
    for (const auto& [name, spec] : j.at("tensors").items()) {
        out.push_back(guarded(base + " [gguf " + name + "]", [&](Stats& s) {
            const auto& info = g->info(name);
            const std::string type = spec.at("type").get<std::string>();
            s.check_true("type", ggml_type_name(info.type) == type, ggml_type_name(info.type));
            s.check_true("shape", info.shape == spec.at("shape").get<std::vector<int64_t>>());
            auto got = g->dequantize(name);
            s.check("dequantized", got, dlm_need(tensors, "dequantized." + name), 0.0, 0.0);
            auto orig = dlm_need(tensors, "original." + name);
            const double rel = j.at("quantization_rel_error").at(type).get<double>();
            const double err = (got - orig).abs().max().item<double>(), scale = orig.abs().max().item<double>();
            s.check_true("quantization error", err <= rel * scale,
                         std::to_string(err) + " > " + std::to_string(rel) + " x " + std::to_string(scale));
        }));
    }
    return out;
}

const bool registered_dlm = [] {
    register_checker({"gguf-file", [](const fs::path& d) { return has_file(d, "gguf_case.json"); }, run_gguf_case});
    register_checker({"text-diffusion-tokenizer", [](const fs::path& d) { return has_file(d, "dlm_tokenizer_cases.json"); },
                      run_dlm_tokenizer});
    register_checker({"text-diffusion-family",
                      [](const fs::path& d) {
                          return has_file(d, "dlm_case.json") && has_file(d, "dlm_case.safetensors");
                      },
                      run_dlm_case});
    return true;
}();

} // namespace
} // namespace anchor::golden
