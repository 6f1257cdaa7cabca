// Golden checkers for the Stable Diffusion models (tests/golden/sd): tokenizer cases, CLIP text encoder, UNet and
// VAE forwards with every stored intermediate, and the original single-file checkpoint. Folders are claimed by their
// files (config.json class, tokenizer_golden.json, single-file checkpoint + key_map.json), never by folder names.
#include "cache/io/error.h"
#include "cache/io/weight_map.h"
#include "tests/golden_runner/runner.h"
#include "tests/sdxl_golden.h"
#include "unet/model/checkpoint.h"

#include <nlohmann/json.hpp>

#include <fstream>
#include <regex>

namespace anchor::golden {
namespace {

using namespace anchor::unet;


nlohmann::json read_json(const fs::path& p) {
    std::ifstream f(p);
    if (!f) throw Error("cannot open '" + p.string() + "'");
    return nlohmann::json::parse(f);
}

// The BPE vocabulary: a `*.txt.gz` in a `vocab/` sibling of an ancestor, or the bundled one.
std::string find_vocab(const fs::path& dir) {
    for (fs::path p = dir; !p.empty() && p != p.parent_path(); p = p.parent_path()) {
        for (const auto& cand : {p / "bpe_simple_vocab_16e6.txt.gz", p / "vocab" / "bpe_simple_vocab_16e6.txt.gz"})
            if (fs::exists(cand)) return cand.string();
    }
    return ClipTokenizer::bundled_vocab_path();
}

void check_unet_outputs(UNet2DConditionModelImpl& unet, const fs::path& dir, Stats& st, bool features) {
    auto in = WeightMap::load((dir / "golden_inputs.safetensors").string());
    auto out = WeightMap::load((dir / "golden_outputs.safetensors").string());
    UNetFeatures fa, fb;
    fa.record_inner = true;
    st.check("a.out", unet.forward(in.get("sample"), in.get("timesteps_a"), in.get("encoder_hidden_states"), &fa),
             out.get("a.out"), kAtol, kRtol);
    st.check("b.out", unet.forward(in.get("sample"), in.get("timestep_b"), in.get("encoder_hidden_states"), &fb),
             out.get("b.out"), kAtol, kRtol);
    if (!features || !fs::exists(dir / "golden_features.safetensors")) return;
    auto feats = WeightMap::load((dir / "golden_features.safetensors").string());
    for (const auto& name : feats.names()) {
        const auto dot = name.find('.');
        const std::string call = name.substr(0, dot), key = name.substr(dot + 1);
        auto& f = call == "a" ? fa : fb;
        if (!f.named.count(key)) {
            st.fail("feature " + name + " not produced by the forward");
            continue;
        }
        st.check(name, f.named.at(key), feats.get(name), kAtol, kRtol);
    }
}

void check_vae_outputs(AutoencoderKLImpl& vae, const fs::path& dir, Stats& st, bool features) {
    auto in = WeightMap::load((dir / "golden_inputs.safetensors").string());
    auto out = WeightMap::load((dir / "golden_outputs.safetensors").string());
    FeatureMap f;
    st.check("decode.image", vae.decode(in.get("latent"), &f, "decode."), out.get("decode.image"), kAtol, kRtol);
    auto d = vae.encode(in.get("image"), &f, "encode.");
    st.check("encode.moments", d.moments, out.get("encode.moments"), kAtol, kRtol);
    st.check("encode.mean", d.mean, out.get("encode.mean"), kAtol, kRtol);
    st.check("encode.logvar", d.logvar, out.get("encode.logvar"), kAtol, kRtol);
    st.check("encode.std", d.std, out.get("encode.std"), kAtol, kRtol);
    if (out.has("encode.sample")) {
        // The generator's seed as golden.json records it ("... manual_seed(23) ..."); without it the case cannot be
        // reproduced and FAILs.
        int64_t seed = -1;
        if (fs::exists(dir / "golden.json")) {
            const auto j = read_json(dir / "golden.json");
            if (j.contains("encode.sample") && j["encode.sample"].is_string()) {
                static const std::regex re(R"(manual_seed\(\s*(\d+)\s*\))");
                std::smatch m;
                const std::string text = j["encode.sample"].get<std::string>();
                if (std::regex_search(text, m, re)) seed = std::stoll(m[1].str());
            }
        }
        if (seed < 0) {
            st.fail("encode.sample: golden.json gives no \"encode.sample\" generator seed (manual_seed(N))");
        } else {
            auto gen = at::detail::createCPUGenerator(uint64_t(seed));
            st.check("encode.sample", d.sample(&gen), out.get("encode.sample"), kAtol, kRtol);
        }
    }
    if (!features || !fs::exists(dir / "golden_features.safetensors")) return;
    auto feats = WeightMap::load((dir / "golden_features.safetensors").string());
    for (const auto& name : feats.names()) {
        if (!f.count(name)) {
            st.fail("feature " + name + " not produced");
            continue;
        }
        st.check(name, f.at(name), feats.get(name), kAtol, kRtol);
    }
}

void check_clip_outputs(ClipTextModelImpl& te, const fs::path& dir, Stats& st) {
    auto in = WeightMap::load((dir / "golden_inputs.safetensors").string());
    auto out = WeightMap::load((dir / "golden_outputs.safetensors").string());
    torch::NoGradGuard ng;
    auto ids = in.get("input_ids");
    auto r = te.forward(ids);
    st.check("last_hidden_state", r.last_hidden_state, out.get("last_hidden_state"), kAtol, kRtol);
    for (size_t i = 0; i < r.hidden_states.size(); ++i) {
        const std::string n = "hidden_states." + std::to_string(i);
        if (out.has(n)) st.check(n, r.hidden_states[i], out.get(n), kAtol, kRtol);
    }
    for (int k = 1; k < te.config().num_hidden_layers; ++k) {
        const std::string n = "clip_skip_" + std::to_string(k);
        if (out.has(n)) st.check(n, te.encode(ids, k), out.get(n), kAtol, kRtol);
    }
}

bool is_single_file_case(const fs::path& dir) {
    if (!has_file(dir, "key_map.json")) return false;
    for (const auto& e : fs::directory_iterator(dir))
        if (e.path().extension() == ".safetensors") return true;
    return false;
}

const bool registered_sd_tok = register_checker(
    {"sd-clip-tokenizer", [](const fs::path& d) { return has_file(d, "tokenizer_golden.json"); },
     [](const fs::path& dir, const Context& ctx) {
         return std::vector<CaseResult>{guarded(relative_name(dir, ctx) + ":tokenizer", [&](Stats& st) {
             auto j = read_json(dir / "tokenizer_golden.json");
             auto tok = ClipTokenizer::from_bpe_file(find_vocab(dir));
             // The window: the case's max_length, else the folder's tokenizer_config.json model_max_length.
             int max_len = j.value("max_length", -1);
             if (max_len < 0 && has_file(dir, "tokenizer_config.json"))
                 max_len = read_json(dir / "tokenizer_config.json").value("model_max_length", -1);
             if (max_len < 0 || !j.contains("pad_token_id"))
                 throw Error(
                     "tokenizer_golden.json needs \"pad_token_id\" and \"max_length\" (or a tokenizer_config.json "
                     "with model_max_length)");
             tok.set_pad_id(j["pad_token_id"].get<int64_t>());
             for (const auto& [key, id] : {std::pair<const char*, int64_t>{"bos_token_id", ClipTokenizer::kBos},
                                           {"eos_token_id", ClipTokenizer::kEos}})
                 if (j.contains(key))
                     st.check_true(key, j[key].get<int64_t>() == id,
                                   "the case says " + j[key].dump() + ", CLIP's vocabulary has " + std::to_string(id));
             int i = 0;
             for (const auto& c : j["cases"]) {
                 const std::string prompt = c["prompt"].get<std::string>();
                 auto t = tok.tokenize(prompt, max_len);
                 const std::string tag = "case " + std::to_string(i++);
                 st.check_equal(tag + " input_ids", torch::tensor(t.ids),
                                torch::tensor(c["input_ids"].get<std::vector<int64_t>>()));
                 if (c.contains("bpe_ids"))
                     st.check_equal(tag + " bpe_ids", torch::tensor(tok.encode(prompt), torch::kLong),
                                    torch::tensor(c["bpe_ids"].get<std::vector<int64_t>>(), torch::kLong));
                 if (c.contains("truncated"))
                     st.check_true(tag + " truncated", t.truncated == c["truncated"].get<bool>());
             }
         })};
     }});

const bool registered_sd_clip = register_checker(
    {"sd-clip-text",
     [](const fs::path& d) { return config_class(d) == "CLIPTextModel" && has_file(d, "golden_outputs.safetensors"); },
     [](const fs::path& dir, const Context& ctx) {
         return std::vector<CaseResult>{guarded(relative_name(dir, ctx), [&](Stats& st) {
             auto te = load_text_encoder_folder(dir.string());
             check_clip_outputs(*te, dir, st);
         })};
     }});

const bool registered_sd_unet =
    register_checker({"sd-unet",
                      [](const fs::path& d) {
                          return config_class(d) == "UNet2DConditionModel" && has_file(d, "golden_outputs.safetensors");
                      },
                      [](const fs::path& dir, const Context& ctx) {
                          return std::vector<CaseResult>{guarded(relative_name(dir, ctx), [&](Stats& st) {
                              auto unet = load_unet_folder(dir.string());
                              check_unet_outputs(*unet, dir, st, true);
                          })};
                      }});

const bool registered_sd_vae = register_checker(
    {"sd-vae",
     [](const fs::path& d) { return config_class(d) == "AutoencoderKL" && has_file(d, "golden_outputs.safetensors"); },
     [](const fs::path& dir, const Context& ctx) {
         return std::vector<CaseResult>{guarded(relative_name(dir, ctx), [&](Stats& st) {
             auto vae = load_vae_folder(dir.string());
             check_vae_outputs(*vae, dir, st, true);
         })};
     }});

const bool registered_sd_single = register_checker(
    {"sd-single-file", is_single_file_case, [](const fs::path& dir, const Context& ctx) {
         std::vector<CaseResult> out;
         const std::string base = relative_name(dir, ctx);
         std::string ckpt;
         for (const auto& e : fs::directory_iterator(dir))
             if (e.path().extension() == ".safetensors") ckpt = e.path().string();
         SDModels m;
         out.push_back(guarded(base + ":load+name-table", [&](Stats& st) {
             m = load_sd_models(ckpt);
             auto km = read_json(dir / "key_map.json")["diffusers_to_single_file"];
             for (auto it = km.begin(); it != km.end(); ++it) {
                 const std::string key = it.key();
                 const auto colon = key.find(':');
                 const std::string comp = key.substr(0, colon), name = key.substr(colon + 1);
                 std::string got;
                 if (comp == "text_encoder_2") { // OpenCLIP names, rows of in_proj / the transposed projection
                     got = "conditioner.embedders.1.model." +
                           open_clip_source(name, m.text_encoder_2->config().hidden_size).describe();
                 } else {
                     const Component c = comp == "unet"  ? Component::Unet
                                         : comp == "vae" ? Component::Vae
                                                         : Component::TextEncoder;
                     got = ldm_name(c, name, m.unet->config(), m.vae->config(), m.family);
                 }
                 st.check_true(key, got == it.value().get<std::string>(), got);
             }
         }));
         if (!m.unet) return out;
         // SDXL: config.json "source" = "<folder>/ (...)", an SDXL golden folder next to this one whose comparisons
         // all apply to the converted weights.
         if (has_file(dir, "config.json") && m.family == SdFamily::SDXL) {
             const auto j = read_json(dir / "config.json");
             const std::string src = j.value("source", std::string());
             const fs::path golden = dir.parent_path() / src.substr(0, src.find_first_of(" /"));
             if (src.empty() || !sdgolden::is_sdxl_golden_folder(golden)) {
                 CaseResult r;
                 r.name = base + ":sdxl";
                 r.stats.fail("config.json \"source\" names no SDXL golden folder next to this one");
                 out.push_back(r);
                 return out;
             }
             for (auto& r : check_sdxl_models(m, golden, base)) out.push_back(r);
             return out;
         }
         // The goldens of the source folders apply (config.json "sources": component -> folder next to this one).
         nlohmann::json sources;
         if (has_file(dir, "config.json"))
             sources = read_json(dir / "config.json").value("sources", nlohmann::json::object());
         auto src = [&](const char* k) { return dir.parent_path() / sources.value(k, std::string()); };
         if (sources.contains("unet"))
             out.push_back(
                 guarded(base + ":unet", [&](Stats& st) { check_unet_outputs(*m.unet, src("unet"), st, false); }));
         if (sources.contains("vae"))
             out.push_back(
                 guarded(base + ":vae", [&](Stats& st) { check_vae_outputs(*m.vae, src("vae"), st, false); }));
         if (sources.contains("text_encoder"))
             out.push_back(guarded(base + ":text_encoder",
                                   [&](Stats& st) { check_clip_outputs(*m.text_encoder, src("text_encoder"), st); }));
         return out;
     }});

} // namespace
} // namespace anchor::golden
