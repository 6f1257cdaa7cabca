// Golden checks of the GPT-2 path (tests/golden/text/README.md): tokenizer cases, evaluation-text re-encoding, tiny
// GPT-2 forward / KV-cache / hidden states / greedy generation, and attention-sink streaming variants.
// Folders are claimed by their files only; model weights are found whatever the file is called.
#include "cache/io/error.h"
#include "cache/io/safetensors.h"
#include "cache/sink_rolling_kv.h"
#include "tests/golden_runner/runner.h"
#include "text/gpt2/gpt2_model.h"
#include "text/gpt2/gpt2_tokenizer.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <map>

namespace anchor::golden {
namespace {

// README sec. 5: logits / log-probs 1e-4 absolute, hidden states 2e-4, mean_nll 1e-5, ids exact.
constexpr double kLogitTol = 1e-4, kHiddenTol = 2e-4, kMeanNllTol = 1e-5, kArgmaxMinGap = 1e-4;

using text::Gpt2Tokenizer;

std::string from_hex(const std::string& h) {
    std::string out;
    for (size_t i = 0; i + 1 < h.size(); i += 2) out += static_cast<char>(std::stoi(h.substr(i, 2), nullptr, 16));
    return out;
}

std::vector<int64_t> to_vec(const torch::Tensor& t) {
    auto c = t.to(torch::kLong).contiguous();
    return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

torch::Tensor ids_tensor(const std::vector<int64_t>& v) {
    return torch::tensor(v, torch::kLong);
}

// The vocabulary for a case folder: in it, in its vocab/gpt2, in a parent's vocab/gpt2, else the repository's copy.
Gpt2Tokenizer find_tokenizer(const fs::path& dir) {
    for (fs::path d = dir; !d.empty(); d = d.parent_path()) {
        if (Gpt2Tokenizer::dir_has_vocab(d.string())) return Gpt2Tokenizer::from_dir(d.string());
        if (Gpt2Tokenizer::dir_has_vocab((d / "vocab" / "gpt2").string()))
            return Gpt2Tokenizer::from_dir((d / "vocab" / "gpt2").string());
        if (d == d.parent_path()) break;
    }
    return Gpt2Tokenizer::load_default();
}

bool is_gpt2_config(const fs::path& dir) {
    if (!has_file(dir, "config.json")) return false;
    try {
        auto j = nlohmann::json::parse(read_text(dir / "config.json"));
        return j.value("model_type", std::string()) == "gpt2" || config_class(dir) == "GPT2LMHeadModel";
    } catch (...) {
        return false;
    }
}

// A safetensors file in `dir` holding all of `names`.
fs::path file_with_tensors(const fs::path& dir, const std::vector<std::string>& names) {
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) return {};
    std::vector<fs::path> files;
    for (const auto& e : fs::directory_iterator(dir))
        if (e.is_regular_file() && e.path().extension() == ".safetensors") files.push_back(e.path());
    std::sort(files.begin(), files.end());
    for (const auto& f : files) {
        try {
            auto st = SafeTensorsFile::open(f.string());
            bool all = true;
            for (const auto& n : names) all = all && st->has(n);
            if (all) return f;
        } catch (...) {
        }
    }
    return {};
}

// ---- tokenizer -----------------------------------------------------------------------------------------------------

std::vector<CaseResult> run_tokenizer(const fs::path& dir, const Context& ctx) {
    const std::string base = relative_name(dir, ctx);
    CaseResult enc{base + "/tokenizer_cases/encode", {}}, dec{base + "/tokenizer_cases/decode", {}};
    try {
        auto tok = find_tokenizer(dir);
        auto j = nlohmann::json::parse(read_text(dir / "tokenizer_cases.json"));
        int64_t n = 0, bad = 0;
        for (const auto& c : j.at("cases")) {
            const std::string text = from_hex(c.at("utf8_hex").get<std::string>());
            const auto ids = tok.encode(text);
            const bool ok = tok.pretokenize(text) == c.at("pretokens").get<std::vector<std::string>>() &&
                            ids == c.at("ids").get<std::vector<int64_t>>() &&
                            tok.decode(ids) == c.at("decoded").get<std::string>();
            ++n;
            if (!ok) {
                ++bad;
                enc.stats.fail("case " + c.value("id", std::string("?")) + ": pretokens/ids/decoded differ");
            }
        }
        enc.stats.check_true("encode cases", bad == 0, std::to_string(bad) + " of " + std::to_string(n) + " differ");
        for (const auto& c : j.at("decode_cases")) {
            const std::string got = tok.decode(c.at("ids").get<std::vector<int64_t>>());
            if (got != from_hex(c.at("decoded_utf8_hex").get<std::string>()))
                dec.stats.fail("decode case " + c.value("id", std::string("?")) + " differs");
        }
    } catch (const std::exception& e) {
        enc.stats.fail(e.what());
        dec.stats.fail("not run");
    }
    return {enc, dec};
}

// A `<name>_tokens.bin` (uint16 LE) next to `<name>_text.txt` that decodes to it: re-encoding must give the tokens.
std::vector<fs::path> token_text_pairs(const fs::path& dir) {
    std::vector<fs::path> out;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(dir, ec)) {
        const std::string n = e.path().filename().string();
        const std::string suffix = "_tokens.bin";
        if (n.size() > suffix.size() && n.compare(n.size() - suffix.size(), suffix.size(), suffix) == 0 &&
            has_file(dir, n.substr(0, n.size() - suffix.size()) + "_text.txt"))
            out.push_back(e.path());
    }
    std::sort(out.begin(), out.end());
    return out;
}

std::vector<CaseResult> run_eval_text(const fs::path& dir, const Context& ctx) {
    std::vector<CaseResult> out;
    for (const auto& bin : token_text_pairs(dir)) {
        const std::string stem = bin.filename().string().substr(0, bin.filename().string().size() - 11);
        CaseResult r{relative_name(dir, ctx) + "/" + stem + "_text_reencode", {}};
        try {
            auto tok = find_tokenizer(dir);
            const std::string raw = read_text(bin);
            std::vector<int64_t> want(raw.size() / 2);
            for (size_t i = 0; i < want.size(); ++i)
                want[i] = static_cast<unsigned char>(raw[2 * i]) | (static_cast<unsigned char>(raw[2 * i + 1]) << 8);
            const std::string text = read_text(dir / (stem + "_text.txt"));
            auto ids = tok.encode(text);
            r.stats.check_true("token count", ids.size() == want.size(),
                               std::to_string(ids.size()) + " vs " + std::to_string(want.size()));
            if (ids.size() == want.size()) r.stats.check_equal("tokens", ids_tensor(ids), ids_tensor(want));
            r.stats.check_true("decode(tokens) == text", tok.decode(want) == text);
        } catch (const std::exception& e) {
            r.stats.fail(e.what());
        }
        out.push_back(r);
    }
    return out;
}

// ---- tiny model: forward, KV cache, hidden states, generation ----------------------------------------------------

std::map<std::string, text::LoadedGpt2>& model_cache() {
    static std::map<std::string, text::LoadedGpt2> m;
    return m;
}

text::LoadedGpt2& load_model(const fs::path& dir) {
    auto& m = model_cache();
    auto it = m.find(dir.string());
    if (it == m.end()) it = m.emplace(dir.string(), text::load_gpt2(dir.string())).first;
    return it->second;
}

std::vector<CaseResult> run_model(const fs::path& dir, const Context& ctx) {
    const std::string base = relative_name(dir, ctx);
    std::vector<CaseResult> out;
    text::LoadedGpt2* m = nullptr;
    try {
        m = &load_model(dir);
    } catch (const std::exception& e) {
        CaseResult r{base + "/load", {}};
        r.stats.fail(e.what());
        return {r};
    }
    auto model = m->model;
    const fs::path fwd = file_with_tensors(dir, {"input_ids", "logits_last8", "incremental_argmax"});
    if (!fwd.empty()) {
        auto st = SafeTensorsFile::open(fwd.string());
        CaseResult f{base + "/forward", {}}, inc{base + "/incremental_kv", {}}, hid{base + "/hidden_states", {}};
        try {
            auto ids = st->tensor("input_ids");
            auto logits = model->forward(ids).logits[0];
            auto pos = to_vec(st->tensor("logits_last8_positions"));
            f.stats.check("logits_last8", logits.index_select(0, ids_tensor(pos)), st->tensor("logits_last8"),
                          kLogitTol, 0);
            f.stats.check_equal("argmax_all", logits.argmax(-1), st->tensor("argmax_all"));
            f.stats.check("logprob_selected",
                          torch::log_softmax(logits, -1).index_select(1, st->tensor("selected_ids").to(torch::kLong)),
                          st->tensor("logprob_selected"), kLogitTol, 0);

            text::Gpt2Stream s(model, text::KvSpec::parse("full"), text::PositionMode::Absolute);
            std::vector<torch::Tensor> steps;
            for (auto t : to_vec(ids)) steps.push_back(s.feed(t));
            auto inc_logits = torch::stack(steps);
            inc.stats.check_equal("incremental_argmax", inc_logits.argmax(-1), st->tensor("incremental_argmax"));
            auto top = inc_logits.topk(5, -1);
            inc.stats.check_equal("incremental_top5_ids", std::get<1>(top), st->tensor("incremental_top5_ids"));
            inc.stats.check("incremental_top5_logits", std::get<0>(top), st->tensor("incremental_top5_logits"),
                            kLogitTol, 0);

            auto h = model->forward(st->tensor("hidden_input_ids"), true).hidden;
            const char* names[] = {"hidden_embed", "hidden_block_0", "hidden_block_1", "hidden_ln_f"};
            const size_t L = h.size();
            // hidden = embed, block 0..L-3, ln_f: golden names the first two blocks and the last.
            hid.stats.check_true("hidden count", L >= 4);
            if (L >= 4) {
                hid.stats.check(names[0], h[0][0], st->tensor(names[0]), kHiddenTol, 0);
                for (int b = 0; b < 2 && st->has(names[1 + b]); ++b)
                    hid.stats.check(names[1 + b], h[1 + b][0], st->tensor(names[1 + b]), kHiddenTol, 0);
                hid.stats.check(names[3], h[L - 1][0], st->tensor(names[3]), kHiddenTol, 0);
            }
        } catch (const std::exception& e) {
            f.stats.fail(e.what());
        }
        out.push_back(f);
        out.push_back(inc);
        out.push_back(hid);
    }
    if (has_file(dir, "generation.json")) {
        CaseResult g{base + "/generation_greedy", {}};
        try {
            auto tok = find_tokenizer(dir);
            auto j = nlohmann::json::parse(read_text(dir / "generation.json"));
            for (const auto& c : j.at("cases")) {
                auto prompt = c.at("prompt_ids").get<std::vector<int64_t>>();
                auto want = c.at("generated_ids").get<std::vector<int64_t>>();
                g.stats.check_true("prompt encoding", tok.encode(c.at("prompt").get<std::string>()) == prompt);
                text::Gpt2Stream s(model, text::KvSpec::parse("full"), text::PositionMode::Absolute);
                auto logits = s.feed(prompt);
                std::vector<int64_t> gen;
                for (size_t k = 0; k < want.size(); ++k) {
                    gen.push_back(logits.argmax().item<int64_t>());
                    if (k + 1 < want.size()) logits = s.feed(gen.back());
                }
                g.stats.check_equal("generated_ids", ids_tensor(gen), ids_tensor(want));
                if (c.contains("generated_text"))
                    g.stats.check_true("generated_text", tok.decode(gen) == c["generated_text"].get<std::string>());
            }
        } catch (const std::exception& e) {
            g.stats.fail(e.what());
        }
        out.push_back(g);
    }
    return out;
}

// ---- streaming -----------------------------------------------------------------------------------------------------

struct Variant {
    std::string name;
    std::string kv;
    text::PositionMode policy;
};

// README sec. 3 variants in terms of our KV modes, from the run's S and W.
std::vector<Variant> variants(int64_t S, int64_t W) {
    const std::string C = std::to_string(S + W);
    const std::string sw = "sink:" + std::to_string(S) + "," + std::to_string(W);
    return {{"sink_wrap", sw, text::PositionMode::Wrap},
            {"sink_cache", sw, text::PositionMode::Cache},
            {"recompute", "recompute:" + C, text::PositionMode::Wrap},
            {"nosink_wrap", "window:" + C, text::PositionMode::Wrap},
            {"nosink_cache", "window:" + C, text::PositionMode::Cache}};
}

std::vector<fs::path> streaming_files(const fs::path& dir) {
    std::vector<fs::path> out;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(dir, ec)) {
        if (!e.is_regular_file() || e.path().extension() != ".safetensors") continue;
        auto json = e.path();
        json.replace_extension(".json");
        if (!fs::is_regular_file(json)) continue;
        try {
            auto st = SafeTensorsFile::open(e.path().string());
            if (st->has("stream_ids") && st->has("sink_wrap.logprob_next")) out.push_back(e.path());
        } catch (...) {
        }
    }
    std::sort(out.begin(), out.end());
    return out;
}

// The GPT-2 model a streaming run was made with: a GPT-2 folder next to the streaming folder (the one named in the
// JSON's "model" field when several).
fs::path find_stream_model(const fs::path& dir, const std::string& hint) {
    std::vector<fs::path> cands;
    for (const fs::path& root : {dir, dir.parent_path()}) {
        if (is_gpt2_config(root)) cands.push_back(root);
        std::error_code ec;
        for (const auto& e : fs::directory_iterator(root, ec))
            if (e.is_directory() && is_gpt2_config(e.path())) cands.push_back(e.path());
    }
    for (const auto& c : cands)
        if (!hint.empty() && hint.find(c.filename().string()) != std::string::npos) return c;
    if (cands.empty())
        throw Error("no GPT-2 model folder (config.json model_type gpt2) next to '" + dir.string() + "'");
    return cands.front();
}

std::vector<CaseResult> run_streaming(const fs::path& dir, const Context& ctx) {
    std::vector<CaseResult> out;
    for (const auto& file : streaming_files(dir)) {
        const std::string base = relative_name(dir, ctx) + "/" + file.stem().string();
        try {
            auto js = file;
            js.replace_extension(".json");
            auto j = nlohmann::json::parse(read_text(js));
            auto st = SafeTensorsFile::open(file.string());
            auto& m = load_model(find_stream_model(dir, j.value("model", std::string())));
            if (!j.contains("S") || !j.contains("W"))
                throw Error(js.string() + " gives no sink count \"S\" and window \"W\"");
            const int64_t S = j["S"].get<int64_t>(), W = j["W"].get<int64_t>();
            auto ids = to_vec(st->tensor("stream_ids"));
            std::vector<int64_t> probes;
            if (st->has("probe_steps")) probes = to_vec(st->tensor("probe_steps"));
            const auto known = variants(S, W);
            if (j.contains("variants"))
                for (const auto& item : j["variants"].items()) {
                    const std::string name = item.key(); // a named copy: C++17 lambdas cannot capture a binding
                    if (std::none_of(known.begin(), known.end(), [&](const Variant& v) { return v.name == name; })) {
                        CaseResult r{base + "/" + name, {}};
                        r.stats.fail("variant '" + name + "' (" + item.value().dump() +
                                     ") is not understood by this checker");
                        out.push_back(r);
                    }
                }
            for (const auto& v : known) {
                CaseResult r{base + "/" + v.name, {}};
                if (!st->has(v.name + ".logprob_next")) continue;
                try {
                    auto ev = text::evaluate_stream(m.model, ids, text::KvSpec::parse(v.kv), v.policy, probes);
                    r.stats.check("logprob_next", ev.logprob_next, st->tensor(v.name + ".logprob_next"), kLogitTol, 0);
                    // Argmax only where the reference's top-1/top-2 gap is clear (near-ties in long runs).
                    auto gap = st->tensor(v.name + ".top2_gap");
                    auto clear = gap >= kArgmaxMinGap;
                    r.stats.check_equal("argmax (gap >= 1e-4)", ev.argmax.masked_select(clear),
                                        st->tensor(v.name + ".argmax").masked_select(clear));
                    if (st->has(v.name + ".probe_logits"))
                        r.stats.check("probe_logits", torch::stack(ev.probe_logits),
                                      st->tensor(v.name + ".probe_logits"), kLogitTol, 0);
                    if (j.contains("stats") && j["stats"].contains(v.name)) {
                        const double want = j["stats"][v.name].at("mean_nll").get<double>();
                        const double err = std::abs(ev.mean_nll - want);
                        r.stats.check_true("mean_nll", err <= kMeanNllTol,
                                           "got " + std::to_string(ev.mean_nll) + ", golden " + std::to_string(want));
                    }
                } catch (const std::exception& e) {
                    r.stats.fail(e.what());
                }
                out.push_back(r);
            }
        } catch (const std::exception& e) {
            CaseResult r{base, {}};
            r.stats.fail(e.what());
            out.push_back(r);
        }
    }
    return out;
}

bool claims_model(const fs::path& dir) {
    return is_gpt2_config(dir) &&
           (has_file(dir, "generation.json") ||
            !file_with_tensors(dir, {"input_ids", "logits_last8", "incremental_argmax"}).empty());
}

const bool registered_text = [] {
    register_checker(
        {"gpt2-tokenizer", [](const fs::path& d) { return has_file(d, "tokenizer_cases.json"); }, run_tokenizer});
    register_checker({"gpt2-eval-text", [](const fs::path& d) { return !token_text_pairs(d).empty(); }, run_eval_text});
    register_checker({"gpt2-model", claims_model, run_model});
    register_checker({"gpt2-streaming", [](const fs::path& d) { return !streaming_files(d).empty(); }, run_streaming});
    return true;
}();

} // namespace
} // namespace anchor::golden
