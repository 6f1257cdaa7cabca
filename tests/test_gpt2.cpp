// GPT-2 tokenizer, model, KV cache and streaming against tests/golden/text (README there gives the semantics).
#include "tests/test_util.h"
#include "text/gpt2/gpt2_load.h"
#include "text/gpt2/gpt2_tokenizer.h"
#include "text/params.h"

#include "cache/io/error.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <c10/util/Half.h>

#include <cmath>
#include <fstream>
#include <sstream>

using namespace anchor;
using namespace anchor::text;

namespace {

std::string slurp(const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    std::ostringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

std::string from_hex(const std::string& h) {
    std::string out;
    for (size_t i = 0; i + 1 < h.size(); i += 2) out += static_cast<char>(std::stoi(h.substr(i, 2), nullptr, 16));
    return out;
}

const Gpt2Tokenizer& tokenizer() {
    static Gpt2Tokenizer tok = Gpt2Tokenizer::from_dir(test::golden("text/vocab/gpt2"));
    return tok;
}

} // namespace

TEST_CASE("GPT-2 tokenizer matches every golden case", "[gpt2][tokenizer]") {
    auto j = nlohmann::json::parse(slurp(test::golden("text/tokenizer_cases.json")));
    const auto& tok = tokenizer();
    REQUIRE(tok.vocab_size() == 50257);
    REQUIRE(tok.n_merges() == 50000);
    int failures = 0;
    for (const auto& c : j["cases"]) {
        const std::string text = from_hex(c["utf8_hex"].get<std::string>());
        auto pre = tok.pretokenize(text);
        auto ids = tok.encode(text);
        auto want_pre = c["pretokens"].get<std::vector<std::string>>();
        auto want_ids = c["ids"].get<std::vector<int64_t>>();
        const std::string dec = tok.decode(ids);
        const std::string want_dec = c["decoded"].get<std::string>();
        bool ok = pre == want_pre && ids == want_ids && dec == want_dec;
        if (!ok) {
            ++failures;
            UNSCOPED_INFO("case " << c["id"].get<std::string>() << " pre_ok=" << (pre == want_pre)
                                  << " ids_ok=" << (ids == want_ids) << " dec_ok=" << (dec == want_dec));
        }
    }
    for (const auto& c : j["decode_cases"]) {
        const std::string dec = tok.decode(c["ids"].get<std::vector<int64_t>>());
        const std::string want = from_hex(c["decoded_utf8_hex"].get<std::string>());
        if (dec != want) {
            ++failures;
            UNSCOPED_INFO("decode case " << c["id"].get<std::string>());
        }
    }
    CHECK(failures == 0);
}

TEST_CASE("GPT-2 tokenizer special token, invalid UTF-8 and streaming decode", "[gpt2][tokenizer]") {
    const auto& tok = tokenizer();
    CHECK(tok.encode("<|endoftext|>") == std::vector<int64_t>{27, 91, 437, 1659, 5239, 91, 29});
    CHECK(tok.encode("a<|endoftext|>b", true) ==
          std::vector<int64_t>{tok.encode("a")[0], Gpt2Tokenizer::kEndOfText, tok.encode("b")[0]});
    CHECK(tok.decode({Gpt2Tokenizer::kEndOfText}) == "<|endoftext|>");
    CHECK_THROWS_AS(tok.encode(std::string("ab\xC3", 3)), anchor::Error);
    CHECK_THROWS_AS(tok.encode(std::string("\xED\xA0\x80")), anchor::Error);
    CHECK_THROWS_AS(tok.decode({50257}), anchor::Error);
    // A 4-byte emoji split over tokens prints only once complete.
    Utf8StreamDecoder sd;
    CHECK(sd.push("a\xF0\x9F") == "a");
    CHECK(sd.push("\x98") == "");
    CHECK(sd.push("\x80!") == "\xF0\x9F\x98\x80!");
    CHECK(sd.push("\xF0\x9F") == "");
    CHECK(sd.flush() == "\xEF\xBF\xBD");
    CHECK(utf8_decode_replace("\xC0\xAF") == "\xEF\xBF\xBD\xEF\xBF\xBD");
    CHECK(utf8_decode_replace("\xF0\x9F\x98") == "\xEF\xBF\xBD");
}

TEST_CASE("GPT-2 tokenizer re-encodes the KJV evaluation text exactly", "[gpt2][tokenizer][slow]") {
    const std::string text = slurp(test::golden("text/eval/kjv_text.txt"));
    const std::string raw = slurp(test::golden("text/eval/kjv_tokens.bin"));
    REQUIRE(raw.size() == 400000);
    std::vector<int64_t> want(raw.size() / 2);
    for (size_t i = 0; i < want.size(); ++i)
        want[i] = static_cast<unsigned char>(raw[2 * i]) | (static_cast<unsigned char>(raw[2 * i + 1]) << 8);
    auto ids = tokenizer().encode(text);
    REQUIRE(ids.size() == want.size());
    size_t mismatches = 0;
    for (size_t i = 0; i < ids.size(); ++i) mismatches += ids[i] != want[i];
    CHECK(mismatches == 0);
    CHECK(tokenizer().decode(ids) == text);
}

// ---- model -----------------------------------------------------------------------------------------------------

#include "cache/io/safetensors.h"
#include "text/gpt2/gpt2_model.h"

namespace {

LoadedGpt2& tiny() {
    static LoadedGpt2 m = load_gpt2(test::golden("text/gpt2_tiny"));
    return m;
}

torch::Tensor golden_tensor(const std::string& file, const std::string& name) {
    static std::map<std::string, std::shared_ptr<SafeTensorsFile>> open;
    auto& f = open[file];
    if (!f) f = SafeTensorsFile::open(test::golden(file));
    return f->tensor(name);
}

std::vector<int64_t> to_vec(const torch::Tensor& t) {
    auto c = t.to(torch::kLong).contiguous();
    return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

// The logits of every token of `ids` fed one at a time through a full KV cache at absolute positions, [T, V].
torch::Tensor stream_logits(Gpt2Model& model, const std::vector<int64_t>& ids) {
    Gpt2Stream s(model, KvSpec::parse("full"), PositionMode::Absolute);
    std::vector<torch::Tensor> out;
    for (auto t : ids) out.push_back(s.feed(t));
    return torch::stack(out);
}

} // namespace

TEST_CASE("GPT-2 tiny: config, loader and full forward match the reference", "[gpt2][model]") {
    auto& m = tiny();
    CHECK(m.config.n_layer == 2);
    CHECK(m.config.n_head == 4);
    CHECK(m.config.n_embd == 64);
    CHECK(m.config.n_positions == 128);
    CHECK(m.weight_files.size() == 1); // forward.safetensors in the same folder is not taken for weights
    CHECK(m.model->lm_head_tied());
    const std::string F = "text/gpt2_tiny/forward.safetensors";
    auto ids = golden_tensor(F, "input_ids");
    auto out = m.model->forward(ids);
    auto logits = out.logits[0];
    double err = test::max_abs_diff(logits.narrow(0, 32, 8), golden_tensor(F, "logits_last8"));
    INFO("logits_last8 max abs err " << err);
    CHECK(err < 1e-4);
    CHECK(to_vec(logits.argmax(-1)) == to_vec(golden_tensor(F, "argmax_all")));
    auto sel = golden_tensor(F, "selected_ids");
    auto lp = torch::log_softmax(logits, -1).index_select(1, sel);
    CHECK(test::max_abs_diff(lp, golden_tensor(F, "logprob_selected")) < 1e-4);

    auto hid = m.model->forward(golden_tensor(F, "hidden_input_ids"), true).hidden;
    REQUIRE(hid.size() == 4);
    const char* names[] = {"hidden_embed", "hidden_block_0", "hidden_block_1", "hidden_ln_f"};
    for (int i = 0; i < 4; ++i) {
        double e = test::max_abs_diff(hid[i][0], golden_tensor(F, names[i]));
        INFO(names[i] << " max abs err " << e);
        CHECK(e < 2e-4);
    }
}

TEST_CASE("GPT-2 tiny: KV-cached incremental decoding matches the reference", "[gpt2][model][kv]") {
    auto& m = tiny();
    const std::string F = "text/gpt2_tiny/forward.safetensors";
    auto ids = to_vec(golden_tensor(F, "input_ids"));
    Gpt2Stream s(m.model, KvSpec::parse("full"), PositionMode::Absolute);
    std::vector<torch::Tensor> steps;
    for (auto t : ids) steps.push_back(s.feed(t));
    auto logits = torch::stack(steps);
    CHECK(to_vec(logits.argmax(-1)) == to_vec(golden_tensor(F, "incremental_argmax")));
    auto top = logits.topk(5, -1);
    CHECK(to_vec(std::get<1>(top)) == to_vec(golden_tensor(F, "incremental_top5_ids")));
    CHECK(test::max_abs_diff(std::get<0>(top), golden_tensor(F, "incremental_top5_logits")) < 1e-4);
    // A batched prompt prefill gives the same last logits as one token at a time.
    Gpt2Stream b(m.model, KvSpec::parse("sink:4,28"), PositionMode::Wrap);
    auto last = b.feed(ids); // 40 tokens: 32 batched, then 8 one by one with eviction
    Gpt2Stream one(m.model, KvSpec::parse("sink:4,28"), PositionMode::Wrap);
    torch::Tensor l1;
    for (auto t : ids) l1 = one.feed(t);
    CHECK(test::max_abs_diff(last, l1) < 1e-5);
    CHECK_THROWS_AS(s.feed(std::vector<int64_t>(100, 1)), anchor::Error); // past n_positions in full mode
}

TEST_CASE("GPT-2 tiny: --positions reencode equals a fresh forward over the kept tokens at every step", "[gpt2][kv]") {
    // sink:2,9 keeps the 2 first tokens and re-encodes them with the newest floor(9/2) = 4 when the 11 slots are full.
    auto& m = tiny();
    const int64_t S = 2, W = 9, C = S + W;
    auto ids = to_vec(golden_tensor("text/gpt2_tiny/forward.safetensors", "input_ids")); // 40 tokens
    Gpt2Stream s(m.model, KvSpec::parse("sink:2,9"), PositionMode::Reencode);
    std::vector<int64_t> sinks;
    std::deque<int64_t> rest;
    double worst = 0;
    for (size_t i = 0; i < ids.size(); ++i) {
        if (static_cast<int64_t>(sinks.size() + rest.size()) == C)
            while (static_cast<int64_t>(rest.size()) > W / 2) rest.pop_front();
        (static_cast<int64_t>(sinks.size()) < S ? sinks.push_back(ids[i]) : rest.push_back(ids[i]));
        std::vector<int64_t> ctx(sinks);
        ctx.insert(ctx.end(), rest.begin(), rest.end());
        CHECK(s.position_of(static_cast<int64_t>(i)) == static_cast<int64_t>(ctx.size()) - 1);
        auto got = s.feed(ids[i]);
        torch::NoGradGuard ng;
        auto want = m.model->forward(torch::tensor(ctx, torch::kLong), false, true).logits.reshape({-1});
        worst = std::max(worst, test::max_abs_diff(got, want));
    }
    INFO("max |logit difference| " << worst);
    CHECK(worst < 1e-4);
    // A batched feed takes the same path.
    Gpt2Stream b(m.model, KvSpec::parse("sink:2,9"), PositionMode::Reencode);
    Gpt2Stream one(m.model, KvSpec::parse("sink:2,9"), PositionMode::Reencode);
    torch::Tensor l1;
    for (auto t : ids) l1 = one.feed(t);
    CHECK(test::max_abs_diff(b.feed(ids), l1) < 1e-5);
    // Re-encoding is the stream's own position mode; the buffer policies are the other three.
    CHECK_FALSE(buffer_policy(PositionMode::Reencode).has_value());
    CHECK(buffer_policy(PositionMode::Cache) == cache::PositionPolicy::Cache);
    CHECK(enum_choices(position_mode_table(), "|") == "wrap|cache|absolute|reencode");
    CHECK_THROWS_AS(Gpt2Stream(m.model, KvSpec::parse("sink:4,200"), PositionMode::Reencode), ParamError);
}

TEST_CASE("GPT-2 tiny: greedy generation matches the reference tokens", "[gpt2][model]") {
    auto& m = tiny();
    auto j = nlohmann::json::parse(slurp(test::golden("text/gpt2_tiny/generation.json")));
    for (const auto& c : j["cases"]) {
        auto prompt = c["prompt_ids"].get<std::vector<int64_t>>();
        CHECK(tokenizer().encode(c["prompt"].get<std::string>()) == prompt);
        Gpt2Stream s(m.model, KvSpec::parse("full"), PositionMode::Absolute);
        auto logits = s.feed(prompt);
        std::vector<int64_t> gen;
        for (int k = 0; k < 64; ++k) {
            gen.push_back(logits.argmax().item<int64_t>());
            if (k < 63) logits = s.feed(gen.back());
        }
        CHECK(gen == c["generated_ids"].get<std::vector<int64_t>>());
        CHECK(tokenizer().decode(gen) == c["generated_text"].get<std::string>());
    }
}

TEST_CASE("GPT-2 tiny: attention-sink streaming variants match the reference (300 tokens)", "[gpt2][streaming]") {
    auto& m = tiny();
    const std::string F = "text/streaming/sink4_win28.safetensors";
    auto ids = to_vec(golden_tensor(F, "stream_ids"));
    auto probes = to_vec(golden_tensor(F, "probe_steps"));
    struct V {
        const char* name;
        const char* spec;
        PositionMode pol;
    };
    for (auto v :
         {V{"sink_wrap", "sink:4,28", PositionMode::Wrap}, V{"sink_cache", "sink:4,28", PositionMode::Cache},
          V{"recompute", "recompute:32", PositionMode::Wrap}, V{"nosink_wrap", "window:32", PositionMode::Wrap},
          V{"nosink_cache", "window:32", PositionMode::Cache}}) {
        auto ev = evaluate_stream(m.model, ids, KvSpec::parse(v.spec), v.pol, probes);
        const std::string n = v.name;
        double e = test::max_abs_diff(ev.logprob_next, golden_tensor(F, n + ".logprob_next"));
        INFO(n << " logprob_next max abs err " << e);
        CHECK(e < 1e-4);
        CHECK(to_vec(ev.argmax) == to_vec(golden_tensor(F, n + ".argmax")));
        if (n == "sink_wrap" || n == "sink_cache") {
            REQUIRE(ev.probe_logits.size() == 4);
            CHECK(test::max_abs_diff(torch::stack(ev.probe_logits), golden_tensor(F, n + ".probe_logits")) < 1e-4);
        }
    }
}

TEST_CASE("GPT-2 prefixed layout with explicit lm_head gives bit-identical logits", "[gpt2][model]") {
    auto& m = tiny();
    auto raw = SafeTensorsFile::open(test::golden("text/gpt2_tiny/model.safetensors"));
    NamedTensors named;
    for (const auto& info : raw->tensors()) named.emplace_back("transformer." + info.name, raw->tensor(info.name));
    named.emplace_back("lm_head.weight", raw->tensor("wte.weight"));
    for (int l = 0; l < 2; ++l) // old-checkpoint causal-mask buffers are ignored
        named.emplace_back("transformer.h." + std::to_string(l) + ".attn.bias", torch::ones({1, 1, 128, 128}));
    const std::string dir = test::scratch_dir("gpt2_prefixed");
    save_safetensors(dir + "/pytorch_weights_any_name.safetensors", named);
    auto p = load_gpt2(dir, 4); // no config.json: shapes + head hint
    CHECK(p.config.n_layer == 2);
    CHECK(p.config.n_positions == 128);
    auto ids = golden_tensor("text/gpt2_tiny/forward.safetensors", "input_ids");
    CHECK(torch::equal(p.model->forward(ids).logits, m.model->forward(ids).logits));
    // fp16 weights load (converted to float32) and stay close.
    NamedTensors half;
    for (const auto& info : raw->tensors()) half.emplace_back(info.name, raw->tensor(info.name).to(torch::kHalf));
    const std::string dir16 = test::scratch_dir("gpt2_fp16");
    save_safetensors(dir16 + "/model.safetensors", half);
    auto h = load_gpt2(dir16 + "/model.safetensors", 4);
    CHECK(test::max_abs_diff(h.model->forward(ids).logits, m.model->forward(ids).logits) < 5e-2);
}

TEST_CASE("GPT-2 loader and KV mode errors are clear", "[gpt2][model]") {
    const std::string dir = test::scratch_dir("gpt2_bad");
    auto raw = SafeTensorsFile::open(test::golden("text/gpt2_tiny/model.safetensors"));
    NamedTensors named;
    for (const auto& info : raw->tensors())
        if (info.name != "h.1.mlp.c_fc.bias" && info.name != "ln_f.weight")
            named.emplace_back(info.name, info.name == "wpe.weight" ? raw->tensor(info.name).narrow(1, 0, 32)
                                                                    : raw->tensor(info.name));
    save_safetensors(dir + "/model.safetensors", named);
    std::ifstream(test::golden("text/gpt2_tiny/config.json"));
    {
        std::ofstream c(dir + "/config.json");
        c << slurp(test::golden("text/gpt2_tiny/config.json"));
    }
    try {
        load_gpt2(dir);
        FAIL("expected an error");
    } catch (const anchor::Error& e) {
        const std::string w = e.what();
        CHECK(w.find("h.1.mlp.c_fc.bias") != std::string::npos);
        CHECK(w.find("ln_f.weight") != std::string::npos);
        CHECK(w.find("wpe.weight") != std::string::npos);
    }
    CHECK_THROWS_AS(load_gpt2(dir + "/nope"), anchor::Error);
    CHECK_THROWS_AS(load_gpt2(test::golden("text/streaming")), anchor::Error);
    for (const char* bad : {"ful", "sink:4", "sink:a,b", "window:", "window:0", "recompute:4,5", "full:3", "sink:4,"})
        CHECK_THROWS_AS(KvSpec::parse(bad), ParamError);
    CHECK(KvSpec::parse("sink:4,1020").str() == "sink:4,1020");
    CHECK_THROWS_AS(Gpt2Stream(tiny().model, KvSpec::parse("sink:4,200"), PositionMode::Absolute), ParamError);
}

// ---- decode kernel ---------------------------------------------------------------------------------------------

#include "kernels/gemv.h"
#include "kernels/gemv_packed.h"

TEST_CASE("gemv kernel matches the reference for f32 and f16 weights", "[gemv][kernels]") {
    torch::manual_seed(7);
    for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{
             {1, 1}, {7, 13}, {64, 256}, {768, 768}, {3072, 768}, {50257, 64}, {33, 1031}}) {
        auto w = torch::randn({rows, cols});
        auto x = torch::randn({cols});
        auto b = torch::randn({rows});
        auto want = torch::addmv(b.to(torch::kDouble), w.to(torch::kDouble), x.to(torch::kDouble));
        auto got = kernels::gemv(w, x, b);
        auto rel = [&](const torch::Tensor& g) {
            return ((g.to(torch::kDouble) - want).abs().max() / want.abs().max().clamp_min(1e-12)).item<double>();
        };
        INFO(rows << "x" << cols << " f32 rel err " << rel(got));
        CHECK(rel(got) < 1e-5);
        std::vector<float> y(rows);
        kernels::gemv_ref_f32(w.data_ptr<float>(), x.data_ptr<float>(), b.data_ptr<float>(), y.data(), rows, cols);
        CHECK(rel(torch::from_blob(y.data(), {rows}).clone()) < 1e-6);
        // f16 weights: compare with the same rounded weights in double.
        auto wh = w.to(torch::kHalf);
        auto want16 = torch::addmv(b.to(torch::kDouble), wh.to(torch::kDouble), x.to(torch::kDouble));
        auto got16 = kernels::gemv(wh, x, b);
        double e16 =
            ((got16.to(torch::kDouble) - want16).abs().max() / want16.abs().max().clamp_min(1e-12)).item<double>();
        INFO("f16 rel err " << e16);
        CHECK(e16 < 1e-5);
        CHECK(kernels::gemv(w, x).size(0) == rows); // no bias
    }
}

TEST_CASE("few-rows kernel matches the double-precision product on many shapes, on each SIMD path", "[gemv][kernels]") {
    torch::manual_seed(11);
    for (auto path : {kernels::SimdPath::Best, kernels::SimdPath::Avx2, kernels::SimdPath::Portable})
        // Row counts around the 4 x 4 tile (and its 1-3-row remainders), weight rows not a multiple of 4, columns
        // around the 16-wide vector and its masked tail.
        for (int64_t n : {1, 2, 3, 4, 5, 7, 8, 13, 32})
            for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{
                     {1, 1}, {3, 15}, {4, 16}, {5, 17}, {17, 100}, {64, 384}, {1152, 384}, {384, 1536}, {9, 1031}})
                for (bool bias : {true, false}) {
                    auto w = torch::randn({rows, cols});
                    auto x = torch::randn({n, cols});
                    auto b = bias ? torch::randn({rows}) : torch::Tensor();
                    auto want = torch::matmul(x.to(torch::kDouble), w.to(torch::kDouble).t());
                    if (bias) want += b.to(torch::kDouble);
                    // Relative to the sum of |w x| terms (a row of opposite terms cancels; its rounding does not).
                    auto scale = torch::matmul(x.abs().to(torch::kDouble), w.abs().to(torch::kDouble).t()) + 1.0;
                    std::vector<float> y(static_cast<size_t>(n * rows));
                    kernels::gemm_few_rows_f32(w.data_ptr<float>(), x.data_ptr<float>(),
                                               bias ? b.data_ptr<float>() : nullptr, y.data(), n, rows, cols, path);
                    auto got = torch::from_blob(y.data(), {n, rows}).to(torch::kDouble);
                    const double err = ((got - want).abs() / scale).max().item<double>();
                    INFO("path " << int(path) << ", " << n << " x " << cols << " -> " << rows << (bias ? " +bias" : "")
                                 << ": rel err " << err);
                    CHECK(err < 2e-6);
                }
    // The tensor form keeps leading dimensions and refuses what it does not cover.
    auto w = torch::randn({40, 24}), b = torch::randn({40}), x = torch::randn({1, 3, 24});
    CHECK(kernels::few_rows_linear_applies(x, w, 3) == kernels::gemv_uses_avx2());
    CHECK_FALSE(kernels::few_rows_linear_applies(x, w, 2));                      // more rows than allowed
    CHECK_FALSE(kernels::few_rows_linear_applies(x.to(torch::kDouble), w, 8));   // not float32
    CHECK_FALSE(kernels::few_rows_linear_applies(x, w.t(), 8));                  // not contiguous
    CHECK_FALSE(kernels::few_rows_linear_applies(x.requires_grad_(true), w, 8)); // training: LibTorch's op
    x = x.detach();
    auto got = kernels::few_rows_linear(x, w, b);
    CHECK(got.sizes() == torch::IntArrayRef({1, 3, 40}));
    CHECK(test::max_abs_diff(got, torch::nn::functional::linear(x, w, b)) < 1e-5);
    CHECK(test::max_abs_diff(kernels::few_rows_linear(x, w), torch::nn::functional::linear(x, w)) < 1e-5);
}

TEST_CASE("GPT-2 decode with the gemv kernel equals the torch reference path", "[gemv][gpt2]") {
    auto& m = tiny();
    auto ids = to_vec(golden_tensor("text/gpt2_tiny/forward.safetensors", "input_ids"));
    auto run = [&](bool fast) {
        set_fast_decode_kernel(fast);
        Gpt2Stream s(m.model, KvSpec::parse("sink:4,8"), PositionMode::Wrap);
        std::vector<torch::Tensor> out;
        for (auto t : ids) out.push_back(s.feed(t));
        set_fast_decode_kernel(true);
        return torch::stack(out);
    };
    CHECK(test::max_abs_diff(run(true), run(false)) < 2e-5);
}

TEST_CASE("GPT-2 decode with f16 decode weights stays within their rounding of the f32 path", "[gemv][gpt2]") {
    auto& m = tiny();
    auto ids = to_vec(golden_tensor("text/gpt2_tiny/forward.safetensors", "input_ids"));
    auto run = [&](DecodeWeights dw) {
        m.model->set_decode_weights(dw);
        return stream_logits(m.model, ids);
    };
    const int64_t f32_bytes = m.model->decode_weight_bytes();
    auto ref = run(DecodeWeights::F32);
    auto half = run(DecodeWeights::F16);
    CHECK(m.model->decode_weight_bytes() * 2 == f32_bytes);
    auto back = run(DecodeWeights::F32); // switching back drops the copies: bit-identical f32 path again
    CHECK(m.model->decode_weight_bytes() == f32_bytes);
    CHECK(torch::equal(back, ref));
    const double rel = test::max_abs_diff(half, ref) / ref.abs().max().item<double>();
    INFO("f16 decode weights: max |logit diff| / max |logit| = " << rel);
    CHECK(rel > 0.0);  // the copy is really used
    CHECK(rel < 5e-3); // f16 has 11 significant bits; the golden model's large weights amplify little beyond that
    // Batched forwards keep float32 weights.
    m.model->set_decode_weights(DecodeWeights::F16);
    auto batched = m.model->forward(torch::tensor(ids, torch::kInt64)).logits;
    m.model->set_decode_weights(DecodeWeights::F32);
    CHECK(torch::equal(batched, m.model->forward(torch::tensor(ids, torch::kInt64)).logits));
}

namespace {
// Rows of quantize_q8_0 as blocks.
const kernels::BlockQ8_0* q8_blocks(const torch::Tensor& wq) {
    return reinterpret_cast<const kernels::BlockQ8_0*>(wq.data_ptr<uint8_t>());
}
} // namespace

TEST_CASE("q8_0 quantisation follows the ggml block format and round trip", "[gemv][kernels][q8_0]") {
    torch::manual_seed(11);
    for (int64_t cols : {1, 5, 31, 32, 33, 64, 100, 768}) {
        auto w = torch::randn({3, cols}) * 2.0;
        auto wq = kernels::quantize_q8_0(w);
        const int64_t nb = kernels::q8_0_blocks(cols);
        REQUIRE(wq.size(1) == nb * 34);
        const auto* blk = q8_blocks(wq);
        // Dequantised: d * q; the error of each value is at most half a step (d / 2) plus the f16 rounding of d.
        auto wa = w.accessor<float, 2>();
        for (int64_t r = 0; r < 3; ++r)
            for (int64_t i = 0; i < nb; ++i) {
                const auto& b = blk[r * nb + i];
                const float d = static_cast<float>(c10::Half(b.d, c10::Half::from_bits()));
                float amax = 0.f;
                int maxq = 0;
                for (int64_t j = 0; j < 32; ++j) {
                    const int64_t c = i * 32 + j;
                    if (c >= cols) {
                        CHECK(b.q[j] == 0); // zero padding of the last block
                        continue;
                    }
                    amax = std::max(amax, std::fabs(wa[r][c]));
                    maxq = std::max(maxq, std::abs(int(b.q[j])));
                    CHECK(std::fabs(d * b.q[j] - wa[r][c]) <= d * 0.5f + std::fabs(wa[r][c]) * 2e-3f + 1e-6f);
                }
                CHECK(maxq == 127); // the largest value of a block maps to +-127
                CHECK(d == Approx(amax / 127.f).epsilon(1e-3));
            }
    }
    auto z = kernels::quantize_q8_0(torch::zeros({2, 40}));
    for (int64_t i = 0; i < z.numel(); ++i) CHECK(z.data_ptr<uint8_t>()[i] == 0); // d = 0 and q = 0, no NaN
}

TEST_CASE("q8_0 gemv matches quantise-then-reference on many shapes", "[gemv][kernels][q8_0]") {
    torch::manual_seed(12);
    for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{1, 1},
                                                                      {3, 7},
                                                                      {5, 32},
                                                                      {7, 33},
                                                                      {9, 95},
                                                                      {64, 256},
                                                                      {130, 768},
                                                                      {768, 3072},
                                                                      {2307, 768},
                                                                      {33, 1031},
                                                                      {50257, 64}}) {
        auto w = torch::randn({rows, cols});
        auto x = torch::randn({cols});
        auto b = torch::randn({rows});
        auto wq = kernels::quantize_q8_0(w);
        std::vector<float> want(rows), want_nob(rows);
        kernels::gemv_ref_q8_0(q8_blocks(wq), x.data_ptr<float>(), b.data_ptr<float>(), want.data(), rows, cols);
        kernels::gemv_ref_q8_0(q8_blocks(wq), x.data_ptr<float>(), nullptr, want_nob.data(), rows, cols);
        auto ref = torch::from_blob(want.data(), {rows}).to(torch::kDouble);
        auto got = kernels::gemv_q8_0(wq, x, b).to(torch::kDouble);
        const double scale = ref.abs().max().item<double>() + 1e-12;
        const double e = (got - ref).abs().max().item<double>() / scale;
        INFO(rows << "x" << cols << " q8_0 fast vs reference rel err " << e);
        // Both compute the same int32 block sums; only the float accumulation order differs.
        CHECK(e < 1e-5);
        auto got_nob = kernels::gemv_q8_0(wq, x).to(torch::kDouble);
        CHECK((got_nob - torch::from_blob(want_nob.data(), {rows}).to(torch::kDouble)).abs().max().item<double>() /
                  scale <
              1e-5);
        // And the quantised product stays near the float32 one: each of the two roundings is <= 1/254 of a block's
        // max per value, the errors independent, so the relative error of the dot shrinks like 1/sqrt(cols).
        auto exact = torch::addmv(b.to(torch::kDouble), w.to(torch::kDouble), x.to(torch::kDouble));
        const double eq = ((got - exact).abs().max() / exact.abs().max().clamp_min(1e-12)).item<double>();
        INFO("q8_0 vs exact f32 rel err " << eq);
        CHECK(eq < 3e-2);
    }
    CHECK_THROWS_AS(kernels::gemv_q8_0(torch::zeros({4, 34}, torch::kUInt8), torch::zeros({33})), anchor::Error);
}

namespace {
const kernels::BlockQ4_0* q4_blocks(const torch::Tensor& wq) {
    return reinterpret_cast<const kernels::BlockQ4_0*>(wq.data_ptr<uint8_t>());
}
float q4_scale(const kernels::BlockQ4_0& b) {
    return static_cast<float>(c10::Half(b.d, c10::Half::from_bits()));
}
// max |got - want| / max |want| (the fast-vs-reference measure of the gemv tests).
double gemv_max_rel_err(const std::vector<float>& got, const std::vector<float>& want) {
    double scale = 1e-12, e = 0;
    for (float w : want) scale = std::max(scale, double(std::fabs(w)));
    for (size_t i = 0; i < want.size(); ++i) e = std::max(e, std::fabs(double(got[i]) - want[i]) / scale);
    return e;
}
} // namespace

TEST_CASE("q4_0 quantisation follows the ggml block format, by hand", "[gemv][kernels][q4_0]") {
    // v_j = j - 16: the largest magnitude is v_0 = -16, so d = -16 / -8 = 2 and code_j = min(15, trunc(v_j / 2 +
    // 8.5)) = min(15, floor((j + 1) / 2)); byte j holds code_j | code_{j+16} << 4.
    std::vector<float> v(32);
    for (int j = 0; j < 32; ++j) v[size_t(j)] = float(j - 16);
    kernels::BlockQ4_0 b{};
    kernels::quantize_row_q4_0(v.data(), &b, 32);
    CHECK(b.d == 0x4000); // float16 2.0
    for (int j = 0; j < 16; ++j) {
        const int lo = std::min(15, (j + 1) / 2), hi = std::min(15, (j + 17) / 2);
        CHECK(int(b.qs[j]) == (lo | hi << 4));
    }
    std::vector<float> back(32);
    kernels::dequantize_row_q4_0(&b, back.data(), 32);
    CHECK(back[0] == -16.f);
    CHECK(back[1] == -14.f); // -15: code 1
    CHECK(back[31] == 14.f); // 15: code 16 clamps to 15 -> (15 - 8) * 2
    // A positive extreme: d = 8 / -8 = -1, so 8 -> code 0 -> 8 and -8 -> code 16 -> 15 -> -7 (clamped by one step).
    std::vector<float> p(32, 0.f);
    p[0] = 8.f, p[1] = 1.f, p[2] = -8.f;
    kernels::quantize_row_q4_0(p.data(), &b, 32);
    CHECK(q4_scale(b) == -1.f);
    kernels::dequantize_row_q4_0(&b, back.data(), 32);
    CHECK(back[0] == 8.f);
    CHECK(back[1] == 1.f);
    CHECK(back[2] == -7.f);
    CHECK(back[3] == 0.f); // zeros: code 8
    // A partial block is zero-padded (code 8 in both nibbles) and an all-zero block has d = 0, no NaN.
    kernels::BlockQ4_0 part[2]{};
    std::vector<float> five = {1.f, -2.f, 3.f, -4.f, 0.5f};
    kernels::quantize_row_q4_0(five.data(), part, 5);
    for (int j = 5; j < 16; ++j) CHECK(int(part[0].qs[j]) == 0x88);
    std::vector<float> zeros(40, 0.f);
    kernels::quantize_row_q4_0(zeros.data(), part, 40);
    CHECK(part[0].d == 0x8000); // d = 0 / -8 = -0, as ggml stores it
    CHECK(part[1].d == 0x8000);
    CHECK(int(part[1].qs[15]) == 0x88);
}

TEST_CASE("q4_0 round trip is within a step of each value", "[gemv][kernels][q4_0]") {
    torch::manual_seed(14);
    for (int64_t cols : {1, 5, 31, 32, 33, 64, 100, 768}) {
        auto w = torch::randn({3, cols}) * 2.0;
        auto wq = kernels::quantize_q4_0(w);
        const int64_t nb = kernels::q4_0_blocks(cols);
        REQUIRE(wq.size(1) == nb * 18);
        std::vector<float> back(size_t(nb * 32));
        auto wa = w.accessor<float, 2>();
        for (int64_t r = 0; r < 3; ++r) {
            kernels::dequantize_row_q4_0(q4_blocks(wq) + r * nb, back.data(), cols);
            for (int64_t c = 0; c < cols; ++c) {
                const float d = std::fabs(q4_scale(q4_blocks(wq)[r * nb + c / 32]));
                // Half a step from rounding, one step where the opposite extreme clamps at code 15, plus the float16
                // rounding of d times the code.
                CHECK(std::fabs(back[size_t(c)] - wa[r][c]) <= d + 8 * d * 1e-3f + 1e-6f);
            }
        }
    }
}

TEST_CASE("q4_0 gemv matches quantise-then-reference on many shapes", "[gemv][kernels][q4_0]") {
    torch::manual_seed(15);
    for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{
             {1, 1}, {3, 7}, {5, 32}, {7, 33}, {9, 95}, {64, 256}, {130, 768}, {768, 3072}, {2307, 768}, {33, 1031},
             {50257, 64}}) {
        auto w = torch::randn({rows, cols});
        auto x = torch::randn({cols});
        auto b = torch::randn({rows});
        auto wq = kernels::quantize_q4_0(w);
        std::vector<float> want(rows);
        kernels::gemv_ref_q4_0(q4_blocks(wq), x.data_ptr<float>(), b.data_ptr<float>(), want.data(), rows, cols);
        auto ref = torch::from_blob(want.data(), {rows}).to(torch::kDouble);
        auto got = kernels::gemv_q4_0(wq, x, b).to(torch::kDouble);
        const double scale = ref.abs().max().item<double>() + 1e-12;
        const double e = (got - ref).abs().max().item<double>() / scale;
        INFO(rows << "x" << cols << " q4_0 fast (" << kernels::gemv_isa() << ") vs reference rel err " << e);
        CHECK(e < 1e-5); // the same int32 block sums; only the float accumulation order differs
        // Against the dequantised weights times the unquantised input: only the activations' q8_0 rounding is left.
        std::vector<float> deq(size_t(rows * cols));
        const int64_t nb = kernels::q4_0_blocks(cols);
        for (int64_t r = 0; r < rows; ++r)
            kernels::dequantize_row_q4_0(q4_blocks(wq) + r * nb, deq.data() + r * cols, cols);
        auto wd = torch::from_blob(deq.data(), {rows, cols}).to(torch::kDouble);
        auto exact = torch::addmv(b.to(torch::kDouble), wd, x.to(torch::kDouble));
        const double ea = ((got - exact).abs().max() / exact.abs().max().clamp_min(1e-12)).item<double>();
        INFO("q4_0 vs its dequantised weights rel err " << ea);
        CHECK(ea < 3e-2);
    }
    CHECK_THROWS_AS(kernels::gemv_q4_0(torch::zeros({4, 18}, torch::kUInt8), torch::zeros({33})), anchor::Error);
}

TEST_CASE("packed q8_0 / q4_0 rows: the 512-bit kernel and the portable loop match the block reference",
          "[gemv][kernels][q8_0][q4_0]") {
    torch::manual_seed(16);
    // 256: one chunk of 8 blocks (the trailing half path alone); 512: one chunk of 16; 768: 16 + 8 (GPT-2's width);
    // 1280: 16 + 16 + 8; 3072: six chunks of 16.
    for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{
             {1, 256}, {3, 512}, {17, 768}, {130, 1280}, {64, 3072}, {2304, 768}, {768, 3072}, {5000, 256}}) {
        auto w = torch::randn({rows, cols}) * 0.5;
        auto x = torch::randn({cols}) * 3.0;
        auto b = torch::randn({rows});
        REQUIRE(kernels::packed_rows_apply(cols));
        auto w8 = kernels::quantize_q8_0(w), w4 = kernels::quantize_q4_0(w);
        auto p8 = kernels::pack_q8_0_rows(w8, cols), p4 = kernels::pack_q4_0_rows(w4, cols);
        CHECK(p8.sizes() == w8.sizes()); // the same bytes as the block format
        CHECK(p4.sizes() == w4.sizes());
        std::vector<float> want8(rows), want4(rows);
        kernels::gemv_ref_q8_0(q8_blocks(w8), x.data_ptr<float>(), b.data_ptr<float>(), want8.data(), rows, cols);
        kernels::gemv_ref_q4_0(q4_blocks(w4), x.data_ptr<float>(), b.data_ptr<float>(), want4.data(), rows, cols);
        for (auto path : {kernels::SimdPath::Best, kernels::SimdPath::Portable}) {
            for (bool with_bias : {true, false}) {
                std::vector<float> y8(rows), y4(rows), r8(want8), r4(want4);
                if (!with_bias) {
                    kernels::gemv_ref_q8_0(q8_blocks(w8), x.data_ptr<float>(), nullptr, r8.data(), rows, cols);
                    kernels::gemv_ref_q4_0(q4_blocks(w4), x.data_ptr<float>(), nullptr, r4.data(), rows, cols);
                }
                const float* bp = with_bias ? b.data_ptr<float>() : nullptr;
                kernels::gemv_q8_0_packed(p8.data_ptr<uint8_t>(), x.data_ptr<float>(), bp, y8.data(), rows, cols, path);
                kernels::gemv_q4_0_packed(p4.data_ptr<uint8_t>(), x.data_ptr<float>(), bp, y4.data(), rows, cols, path);
                const double e8 = gemv_max_rel_err(y8, r8), e4 = gemv_max_rel_err(y4, r4);
                INFO(rows << "x" << cols << (path == kernels::SimdPath::Best ? " best" : " portable") << " bias "
                          << with_bias << " (fast " << kernels::packed_rows_fast() << "): q8_0 " << e8 << " q4_0 "
                          << e4);
                // The same exact int32 block sums; only the float accumulation order differs.
                CHECK(e8 < 1e-5);
                CHECK(e4 < 1e-5);
            }
        }
    }
    // Zero weights (d = 0 and -0) give zero, not NaN.
    auto z8 = kernels::pack_q8_0_rows(kernels::quantize_q8_0(torch::zeros({2, 768})), 768);
    auto z4 = kernels::pack_q4_0_rows(kernels::quantize_q4_0(torch::zeros({2, 768})), 768);
    auto x = torch::randn({768});
    std::vector<float> y(2, 1.f);
    kernels::gemv_q8_0_packed(z8.data_ptr<uint8_t>(), x.data_ptr<float>(), nullptr, y.data(), 2, 768);
    CHECK(y[0] == 0.f);
    kernels::gemv_q4_0_packed(z4.data_ptr<uint8_t>(), x.data_ptr<float>(), nullptr, y.data(), 2, 768);
    CHECK(y[1] == 0.f);
    CHECK_FALSE(kernels::packed_rows_apply(0));
    CHECK_FALSE(kernels::packed_rows_apply(64));
    CHECK_FALSE(kernels::packed_rows_apply(769));
    CHECK_THROWS_AS(kernels::pack_q8_0_rows(kernels::quantize_q8_0(torch::zeros({2, 96})), 96), anchor::Error);
    CHECK_THROWS_AS(kernels::pack_q4_0_rows(torch::zeros({2, 10}, torch::kUInt8), 256), anchor::Error);
    CHECK_THROWS_AS(kernels::gemv_q8_0_packed(z8.data_ptr<uint8_t>(), x.data_ptr<float>(), nullptr, y.data(), 2, 100),
                    anchor::Error);
}

TEST_CASE("f32 / f16 gemv fast paths match the reference on ragged shapes", "[gemv][kernels]") {
    torch::manual_seed(13);
    for (int64_t rows : {1, 2, 3, 4, 5, 9, 17, 130}) {
        for (int64_t cols : {1, 3, 15, 16, 17, 31, 33, 100, 769}) {
            auto w = torch::randn({rows, cols});
            auto x = torch::randn({cols});
            auto b = torch::randn({rows});
            std::vector<float> y(rows), r(rows);
            kernels::gemv_f32(w.data_ptr<float>(), x.data_ptr<float>(), b.data_ptr<float>(), y.data(), rows, cols);
            kernels::gemv_ref_f32(w.data_ptr<float>(), x.data_ptr<float>(), b.data_ptr<float>(), r.data(), rows, cols);
            auto wh = w.to(torch::kHalf);
            const auto* wp = reinterpret_cast<const uint16_t*>(wh.data_ptr<at::Half>());
            std::vector<float> yh(rows), rh(rows);
            kernels::gemv_f16(wp, x.data_ptr<float>(), nullptr, yh.data(), rows, cols);
            kernels::gemv_ref_f16(wp, x.data_ptr<float>(), nullptr, rh.data(), rows, cols);
            const double e = gemv_max_rel_err(y, r), eh = gemv_max_rel_err(yh, rh);
            INFO(rows << "x" << cols << " (" << kernels::gemv_isa() << ") f32 " << e << " f16 " << eh);
            CHECK(e < 1e-5);
            CHECK(eh < 1e-5);
        }
    }
}

TEST_CASE("GPT-2 decode with q8_0 decode weights stays within their rounding of the f32 path", "[gemv][gpt2][q8_0]") {
    auto& m = tiny();
    auto ids = to_vec(golden_tensor("text/gpt2_tiny/forward.safetensors", "input_ids"));
    auto run = [&](DecodeWeights dw) {
        m.model->set_decode_weights(dw);
        return stream_logits(m.model, ids);
    };
    const int64_t f32_bytes = m.model->decode_weight_bytes();
    auto ref = run(DecodeWeights::F32);
    auto q8 = run(DecodeWeights::Q8_0);
    const int64_t q8_bytes = m.model->decode_weight_bytes();
    auto back = run(DecodeWeights::F32);
    CHECK(torch::equal(back, ref));
    // 34 bytes per 32 weights (rows padded to whole blocks).
    CHECK(q8_bytes < f32_bytes * 0.3);
    const double rel = test::max_abs_diff(q8, ref) / ref.abs().max().item<double>();
    INFO("q8_0 decode weights: max |logit diff| / max |logit| = " << rel);
    CHECK(rel > 0.0);
    // Unit roundoff of q8_0 is 1/254 of a block's largest value, for the weights and again for the activations, ~8x
    // f16's; the golden model amplifies its roundings ~10x (the f16 bound above), hence 1e-1.
    CHECK(rel < 1e-1);
    // The next-token choice rarely moves: the argmax agrees with the f32 path on nearly every step.
    const double agree = ref.argmax(-1).eq(q8.argmax(-1)).to(torch::kDouble).mean().item<double>();
    INFO("argmax agreement " << agree);
    CHECK(agree > 0.9);
    CHECK(enum_from_string(decode_weight_table(), "q8_0", "decode_weights") == DecodeWeights::Q8_0);
}

TEST_CASE("GPT-2 decode with q4_0 decode weights stays within their rounding of the f32 path", "[gemv][gpt2][q4_0]") {
    // The random tiny model has rows of one or two blocks, where 16 levels are coarse: the logits move, within a
    // bound, and more than with q8_0.
    auto& m = tiny();
    auto ids = to_vec(golden_tensor("text/gpt2_tiny/forward.safetensors", "input_ids"));
    auto run = [](Gpt2Model& model, const std::vector<int64_t>& in, DecodeWeights dw) {
        model->set_decode_weights(dw);
        return stream_logits(model, in);
    };
    const int64_t f32_bytes = m.model->decode_weight_bytes();
    auto ref = run(m.model, ids, DecodeWeights::F32);
    auto q8 = run(m.model, ids, DecodeWeights::Q8_0);
    auto q4 = run(m.model, ids, DecodeWeights::Q4_0);
    const int64_t q4_bytes = m.model->decode_weight_bytes();
    CHECK(torch::equal(run(m.model, ids, DecodeWeights::F32), ref));
    CHECK(q4_bytes < f32_bytes * 0.16); // 18 bytes per 32 weights, rows padded to whole blocks
    const double rel = test::max_abs_diff(q4, ref) / ref.abs().max().item<double>();
    const double rel8 = test::max_abs_diff(q8, ref) / ref.abs().max().item<double>();
    INFO("tiny: max |logit diff| / max |logit|: q4_0 " << rel << ", q8_0 " << rel8);
    CHECK(rel > rel8);
    CHECK(rel < 1.0);
    CHECK(enum_from_string(decode_weight_table(), "q4_0", "decode_weights") == DecodeWeights::Q4_0);
    // The trained kjv-gpt2 (rows of 4 blocks and more): the next token is the f32 path's on most steps of a verse.
    LoadedGpt2 kjv = load_gpt2(test::golden("../../assets/models/kjv-gpt2"));
    const auto verse = tokenizer().encode("In the beginning God created the heaven and the earth. And the earth was "
                                          "without form, and void; and darkness was upon the face of the deep.");
    auto kref = run(kjv.model, verse, DecodeWeights::F32);
    auto k4 = run(kjv.model, verse, DecodeWeights::Q4_0);
    const double agree = kref.argmax(-1).eq(k4.argmax(-1)).to(torch::kDouble).mean().item<double>();
    INFO("kjv-gpt2: argmax agreement q4_0 vs f32 " << agree << " over " << verse.size() << " tokens");
    CHECK(agree > 0.8);
}

TEST_CASE("encode_first equals the start of encode", "[gpt2][tokenizer]") {
    const std::string text = slurp(test::golden("text/eval/kjv_text.txt")).substr(0, 60000);
    auto all = tokenizer().encode(text);
    for (size_t n : {size_t(1), size_t(100), size_t(1000), size_t(5000), all.size(), all.size() + 10}) {
        auto first = tokenizer().encode_first(text, n);
        REQUIRE(first.size() == std::min(n, all.size()));
        CHECK(std::equal(first.begin(), first.end(), all.begin()));
    }
}

TEST_CASE("generative perplexity equals exp of the mean streamed NLL of the scored tokens", "[gpt2][genppl]") {
    auto& m = tiny();
    auto ids = to_vec(golden_tensor("text/streaming/sink4_win28.safetensors", "stream_ids"));
    const int64_t ctx = m.model->config().n_positions;
    REQUIRE(static_cast<int64_t>(ids.size()) > ctx);
    // Within the context: one causal forward, the same numbers as the full-KV stream (golden-checked above).
    std::vector<int64_t> head(ids.begin(), ids.begin() + ctx);
    auto ev = evaluate_stream(m.model, head, KvSpec::parse("full"), PositionMode::Wrap);
    for (int64_t from : {1, 5, 17}) {
        auto lp = ev.logprob_next.narrow(0, from - 1, ctx - from).to(torch::kFloat64);
        const double expected = std::exp(-lp.mean().item<double>());
        CHECK(generative_ppl(m.model, head, from) == Approx(expected).epsilon(1e-5));
    }
    // Longer than the context: overlapping windows, every token scored once.
    const double long_ppl = generative_ppl(m.model, ids, 8);
    CHECK(std::isfinite(long_ppl));
    CHECK(long_ppl > 1.0);
    CHECK_THROWS_WITH(generative_ppl(m.model, head, ctx), Catch::Contains("no tokens to score"));
    CHECK_THROWS_WITH(generative_ppl(m.model, {1, 2, 99999999}, 1), Catch::Contains("outside the scoring model"));
}
