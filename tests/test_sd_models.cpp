// Stable Diffusion models against tests/golden/sd (tolerances from tests/golden/sd/README.md: ids exact, forwards and
// every stored intermediate atol 1e-4 + rtol 1e-4).
#include "cache/io/error.h"
#include "cache/io/safetensors.h"
#include "cache/io/weight_map.h"
#include "tests/sd_tiny_configs.h"
#include "tests/test_util.h"
#include "unet/model/checkpoint.h"
#include "unet/model/clip_text.h"
#include "unet/model/clip_tokenizer.h"
#include "unet/model/unet_model.h"
#include "unet/model/vae.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <fstream>

using namespace anchor;
using namespace anchor::unet;

namespace {

constexpr double kAtol = 1e-4, kRtol = 1e-4;

// Elementwise |a - g| <= atol + rtol |g|; returns max |a - g| for the log.
double require_close(const std::string& what, const torch::Tensor& actual, const torch::Tensor& golden,
                     double atol = kAtol, double rtol = kRtol) {
    INFO(what << ": actual " << actual.sizes() << " golden " << golden.sizes());
    REQUIRE(actual.sizes() == golden.sizes());
    auto a = actual.to(torch::kFloat64), g = golden.to(torch::kFloat64);
    auto err = (a - g).abs();
    const double max_abs = err.max().item<double>();
    const bool ok = (err <= atol + rtol * g.abs()).all().item<bool>();
    INFO(what << ": max abs error " << max_abs);
    CHECK(ok);
    return max_abs;
}

WeightMap golden_map(const std::string& rel) {
    return WeightMap::load(test::golden(rel));
}

ClipTokenizer& tiny_tokenizer() {
    static ClipTokenizer t = ClipTokenizer::from_bpe_file(test::golden("sd/vocab/bpe_simple_vocab_16e6.txt.gz"));
    return t;
}

} // namespace

TEST_CASE("CLIP tokenizer matches every golden case", "[sd][tokenizer]") {
    std::ifstream f(test::golden("sd/clip_tiny/tokenizer/tokenizer_golden.json"));
    auto j = nlohmann::json::parse(f);
    auto& tok = tiny_tokenizer();
    REQUIRE(tok.vocab_size() == 49408);
    int n = 0;
    for (const auto& c : j["cases"]) {
        const std::string prompt = c["prompt"].get<std::string>();
        INFO("prompt: " << prompt);
        auto bpe = tok.encode(prompt);
        CHECK(bpe == c["bpe_ids"].get<std::vector<int64_t>>());
        auto t = tok.tokenize(prompt);
        CHECK(t.ids == c["input_ids"].get<std::vector<int64_t>>());
        CHECK(t.num_bpe_tokens == c["num_bpe_tokens"].get<int>());
        CHECK(t.truncated == c["truncated"].get<bool>());
        ++n;
    }
    CHECK(n == 40);
}

TEST_CASE("CLIP tokenizer: bundled vocabulary, SD 2.x padding, diffusers folder", "[sd][tokenizer]") {
    auto tok = ClipTokenizer::bundled();
    auto a = tok.tokenize("a photo of an astronaut riding a horse on mars");
    CHECK(a.ids.size() == 77);
    CHECK(a.ids.back() == 49407);
    tok.set_pad_id(0);
    auto b = tok.tokenize("a photo");
    CHECK(b.ids[3] == 49407);
    CHECK(b.ids[4] == 0);
    // A diffusers tokenizer folder (vocab.json + merges.txt + pad token "!").
    auto dir = test::scratch_dir("sd_tokenizer_folder");
    std::ofstream(dir + "/vocab.json") << R"({"a": 0, "b": 1, "a</w>": 2, "b</w>": 3, "ab</w>": 4, "!": 5,
        "<|startoftext|>": 49406, "<|endoftext|>": 49407})";
    std::ofstream(dir + "/merges.txt") << "#version: 0.2\na b</w>\n";
    std::ofstream(dir + "/special_tokens_map.json") << R"({"pad_token": "!"})";
    auto ft = ClipTokenizer::from_folder(dir);
    CHECK(ft.pad_id() == 5);
    CHECK(ft.encode("AB  b") == std::vector<int64_t>{4, 3});
    auto framed = ft.tokenize("ab", 6);
    CHECK(framed.ids == std::vector<int64_t>{49406, 4, 49407, 5, 5, 5});
}

TEST_CASE("CLIP text encoder matches golden hidden states", "[sd][clip]") {
    auto te = load_text_encoder_folder(test::golden("sd/clip_tiny"));
    CHECK(te->config().num_attention_heads == 4);
    CHECK(te->config().intermediate_size == 37);
    auto in = golden_map("sd/clip_tiny/golden_inputs.safetensors");
    auto out = golden_map("sd/clip_tiny/golden_outputs.safetensors");
    torch::NoGradGuard ng;
    auto r = te->forward(in.get("input_ids"));
    require_close("last_hidden_state", r.last_hidden_state, out.get("last_hidden_state"));
    REQUIRE(r.hidden_states.size() == 3);
    for (size_t i = 0; i < 3; ++i)
        require_close("hidden_states." + std::to_string(i), r.hidden_states[i],
                      out.get("hidden_states." + std::to_string(i)));
    require_close("clip_skip_1", te->encode(in.get("input_ids"), 1), out.get("clip_skip_1"));
    require_close("encode(clip_skip 0)", te->encode(in.get("input_ids"), 0), out.get("last_hidden_state"));
}

TEST_CASE("CLIP text encoder agrees with its float64 evaluation on random prompts of many shapes", "[sd][clip]") {
    // The reference's own rounding is the only difference: float32 vs float64 of the same equations, within the golden
    // tolerance (atol 1e-4 + rtol 1e-4), for batches of 1-4 random id rows, causal mask over 77 positions, and
    // every clip_skip.
    auto te = load_text_encoder_folder(test::golden("sd/clip_tiny"));
    auto te64 = load_text_encoder_folder(test::golden("sd/clip_tiny"));
    te64->to(torch::kDouble);
    torch::NoGradGuard ng;
    torch::manual_seed(21);
    for (int i = 0; i < 20; ++i) {
        const int64_t B = 1 + i % 4;
        auto ids = torch::randint(0, 49406, {B, 77}, torch::kLong);
        ids.select(1, 0).fill_(49406);
        const int64_t eos = 1 + (i * 13) % 76; // prompt length, then padding with <|endoftext|>
        ids.narrow(1, eos, 77 - eos).fill_(49407);
        const int skip = i % te->config().num_hidden_layers;
        auto a = te->encode(ids, skip), b = te64->encode(ids, skip);
        INFO("batch " << B << ", eos at " << eos << ", clip_skip " << skip);
        CHECK(((a.to(torch::kDouble) - b).abs() <= 1e-4 + 1e-4 * b.abs()).all().item<bool>());
    }
}

TEST_CASE("CLIP text encoder with the tiled attention kernel: within 2e-6 of exact, causal mask its own", "[sd][clip]") {
    auto te = load_text_encoder_folder(test::golden("sd/clip_tiny"));
    auto fast = load_text_encoder_folder(test::golden("sd/clip_tiny"));
    torch::NoGradGuard ng;
    torch::manual_seed(5);
    for (auto k : {kernels::AttentionKernel::Fused, kernels::AttentionKernel::Flash}) {
        fast->set_attention_kernel(k);
        for (int i = 0; i < 6; ++i) {
            const int64_t B = 1 + i % 3;
            auto ids = torch::randint(0, 49406, {B, 77}, torch::kLong);
            const auto a = te->forward(ids), b = fast->forward(ids);
            for (size_t l = 1; l < a.hidden_states.size(); ++l) {
                const auto& x = a.hidden_states[l];
                const double scale = x.abs().max().item<double>();
                INFO(enum_name(kernels::attention_kernel_table(), k) << " layer " << l << " batch " << B);
                CHECK(test::max_abs_diff(x, b.hidden_states[l]) <= 2e-6 * scale * 10);
            }
        }
    }
}

TEST_CASE("CLIP config detected from shapes equals config.json", "[sd][clip]") {
    auto w = golden_map("sd/clip_tiny/model.safetensors");
    auto d = ClipTextConfig::detect_from_weights(w);
    auto j = ClipTextConfig::from_json_file(test::golden("sd/clip_tiny/config.json"));
    CHECK(d.hidden_size == j.hidden_size);
    CHECK(d.num_hidden_layers == j.num_hidden_layers);
    CHECK(d.num_attention_heads == j.num_attention_heads);
    CHECK(d.intermediate_size == j.intermediate_size);
    CHECK(d.hidden_act == j.hidden_act);
}

TEST_CASE("UNet matches golden outputs and every intermediate feature", "[sd][unet]") {
    auto unet = load_unet_folder(test::golden("sd/unet_sd15_tiny"));
    auto in = golden_map("sd/unet_sd15_tiny/golden_inputs.safetensors");
    auto out = golden_map("sd/unet_sd15_tiny/golden_outputs.safetensors");
    auto feats = golden_map("sd/unet_sd15_tiny/golden_features.safetensors");
    UNetFeatures fa;
    fa.record_inner = true;
    auto a = unet->forward(in.get("sample"), in.get("timesteps_a"), in.get("encoder_hidden_states"), &fa);
    double worst = require_close("a.out", a, out.get("a.out"));
    UNetFeatures fb;
    auto b = unet->forward(in.get("sample"), in.get("timestep_b"), in.get("encoder_hidden_states"), &fb);
    worst = std::max(worst, require_close("b.out", b, out.get("b.out")));
    int n = 0;
    for (const auto& name : feats.names()) {
        const auto dot = name.find('.');
        const std::string call = name.substr(0, dot), key = name.substr(dot + 1);
        auto& f = call == "a" ? fa : fb;
        INFO("feature " << name);
        REQUIRE(f.named.count(key));
        worst = std::max(worst, require_close(name, f.named.at(key), feats.get(name)));
        ++n;
    }
    CHECK(n > 70);
    WARN("UNet golden: " << n << " features, worst max abs error " << worst);
}

TEST_CASE("UNet config detected from shapes builds the same model", "[sd][unet]") {
    auto w = WeightMap::load(test::golden("sd/unet_sd15_tiny/diffusion_pytorch_model.safetensors"));
    auto d = UNetConfig::detect_from_weights(w);
    auto j = UNetConfig::from_json_file(test::golden("sd/unet_sd15_tiny/config.json"));
    CHECK(d.block_out_channels == j.block_out_channels);
    CHECK(d.layers_per_block == j.layers_per_block);
    CHECK(d.down_block_types == j.down_block_types);
    CHECK(d.up_block_types == j.up_block_types);
    CHECK(d.heads == j.heads);
    CHECK(d.cross_attention_dim == j.cross_attention_dim);
    CHECK(d.use_linear_projection == j.use_linear_projection);
}

TEST_CASE("VAE decode and encode match golden outputs and features", "[sd][vae]") {
    auto vae = load_vae_folder(test::golden("sd/vae_tiny"));
    CHECK(vae->config().spatial_factor() == 2);
    CHECK(vae->config().scaling_factor == Approx(0.18215));
    auto in = golden_map("sd/vae_tiny/golden_inputs.safetensors");
    auto out = golden_map("sd/vae_tiny/golden_outputs.safetensors");
    auto feats = golden_map("sd/vae_tiny/golden_features.safetensors");
    FeatureMap f;
    auto img = vae->decode(in.get("latent"), &f, "decode.");
    require_close("decode.image", img, out.get("decode.image"));
    auto d = vae->encode(in.get("image"), &f, "encode.");
    require_close("encode.moments", d.moments, out.get("encode.moments"));
    require_close("encode.mean", d.mean, out.get("encode.mean"));
    require_close("encode.logvar", d.logvar, out.get("encode.logvar"));
    require_close("encode.std", d.std, out.get("encode.std"));
    auto gen = at::detail::createCPUGenerator(23);
    require_close("encode.sample", d.sample(&gen), out.get("encode.sample"));
    for (const auto& name : feats.names()) {
        INFO("feature " << name);
        REQUIRE(f.count(name));
        require_close(name, f.at(name), feats.get(name));
    }
}

TEST_CASE("single-file checkpoint gives the same outputs as the diffusers folders", "[sd][single_file]") {
    auto m = load_sd_models(test::golden("sd/sd15_tiny_single_file/sd15_tiny_single_file.safetensors"));
    CHECK(m.layout == "single-file");
    CHECK(m.family == unet::SdFamily::SD1);
    CHECK(m.vae_scale_factor() == 2);
    auto unet = load_unet_folder(test::golden("sd/unet_sd15_tiny"));
    auto vae = load_vae_folder(test::golden("sd/vae_tiny"));
    auto te = load_text_encoder_folder(test::golden("sd/clip_tiny"));
    // Bit-identical weights (the fp16 file upcasts exactly).
    auto same_params = [](torch::nn::Module& a, torch::nn::Module& b) {
        auto pa = a.named_parameters(true);
        auto pb = b.named_parameters(true);
        REQUIRE(pa.size() == pb.size());
        for (const auto& p : pa) {
            INFO(p.key());
            REQUIRE(pb.contains(p.key()));
            CHECK(torch::equal(p.value(), pb[p.key()]));
        }
    };
    same_params(*m.unet, *unet);
    same_params(*m.vae, *vae);
    same_params(*m.text_encoder, *te);
    auto in = golden_map("sd/unet_sd15_tiny/golden_inputs.safetensors");
    auto out = golden_map("sd/unet_sd15_tiny/golden_outputs.safetensors");
    auto a = m.unet->forward(in.get("sample"), in.get("timesteps_a"), in.get("encoder_hidden_states"));
    auto a2 = unet->forward(in.get("sample"), in.get("timesteps_a"), in.get("encoder_hidden_states"));
    CHECK(torch::equal(a, a2));
    require_close("single-file a.out", a, out.get("a.out"));
    auto vin = golden_map("sd/vae_tiny/golden_inputs.safetensors");
    auto vout = golden_map("sd/vae_tiny/golden_outputs.safetensors");
    require_close("single-file decode.image", m.vae->decode(vin.get("latent")), vout.get("decode.image"));
    auto cin = golden_map("sd/clip_tiny/golden_inputs.safetensors");
    auto cout_ = golden_map("sd/clip_tiny/golden_outputs.safetensors");
    torch::NoGradGuard ng;
    require_close("single-file last_hidden_state", m.text_encoder->encode(cin.get("input_ids")),
                  cout_.get("last_hidden_state"));
}

TEST_CASE("name table maps every diffusers tensor to the golden key map", "[sd][single_file]") {
    std::ifstream f(test::golden("sd/sd15_tiny_single_file/key_map.json"));
    auto j = nlohmann::json::parse(f)["diffusers_to_single_file"];
    auto ucfg = UNetConfig::from_json_file(test::golden("sd/unet_sd15_tiny/config.json"));
    auto vcfg = VaeConfig::from_json_file(test::golden("sd/vae_tiny/config.json"));
    int n = 0;
    for (auto it = j.begin(); it != j.end(); ++it) {
        const std::string key = it.key();
        const auto colon = key.find(':');
        const std::string comp = key.substr(0, colon), name = key.substr(colon + 1);
        const Component c = comp == "unet" ? Component::Unet : comp == "vae" ? Component::Vae : Component::TextEncoder;
        INFO(key);
        CHECK(ldm_name(c, name, ucfg, vcfg) == it.value().get<std::string>());
        ++n;
    }
    CHECK(n == 877);
}

TEST_CASE("single-file loading lists every missing tensor", "[sd][single_file]") {
    auto src = SafeTensorsFile::open(test::golden("sd/sd15_tiny_single_file/sd15_tiny_single_file.safetensors"));
    NamedTensors keep;
    std::vector<std::string> dropped = {"model.diffusion_model.input_blocks.1.0.in_layers.2.weight",
                                        "model.diffusion_model.output_blocks.5.2.conv.bias",
                                        "first_stage_model.decoder.up.0.block.1.conv2.weight"};
    for (const auto& info : src->tensors())
        if (std::find(dropped.begin(), dropped.end(), info.name) == dropped.end())
            keep.emplace_back(info.name, src->tensor(info.name));
    auto dir = test::scratch_dir("sd_missing");
    const std::string path = dir + "/broken.safetensors";
    save_safetensors(path, keep);
    try {
        load_sd_models(path);
        FAIL("loading a checkpoint with missing tensors succeeded");
    } catch (const anchor::Error& e) {
        const std::string msg = e.what();
        INFO(msg);
        CHECK(msg.find("3 missing tensor(s)") != std::string::npos);
        for (const auto& d : dropped) CHECK(msg.find(d) != std::string::npos);
    }
    CHECK_THROWS_AS(load_sd_models(dir + "/nope.safetensors"), anchor::Error);
}

TEST_CASE("prompt K/V reuse across steps is exact and drops with its scope", "[sd][unet]") {
    auto unet = load_unet_folder(test::golden("sd/unet_sd15_tiny"));
    auto in = golden_map("sd/unet_sd15_tiny/golden_inputs.safetensors");
    const auto x = in.get("sample"), ctx = in.get("encoder_hidden_states");
    auto ref_a = unet->forward(x, in.get("timesteps_a"), ctx);
    auto ref_b = unet->forward(x, in.get("timestep_b"), ctx);
    auto other = ctx * 0.5; // a different context inside the same scope: recomputed, not a stale hit
    auto ref_o = unet->forward(x, in.get("timestep_b"), other);
    const auto attn = unet->cross_attentions();
    REQUIRE(attn.size() > 2);
    {
        UNet2DConditionModelImpl::ContextKvScope scope(*unet);
        CHECK(torch::equal(unet->forward(x, in.get("timesteps_a"), ctx), ref_a));
        CHECK(torch::equal(unet->forward(x, in.get("timestep_b"), ctx), ref_b));
        for (auto* a : attn) CHECK(a->context_kv_hits() == 1);
        CHECK(torch::equal(unet->forward(x, in.get("timestep_b"), other), ref_o));
        for (auto* a : attn) CHECK(a->context_kv_hits() == 1);
        CHECK(torch::equal(unet->forward(x, in.get("timestep_b"), other), ref_o));
        for (auto* a : attn) CHECK(a->context_kv_hits() == 2);
    }
    for (auto* a : attn) CHECK(a->context_kv_hits() == 0); // reset and released with the scope
    CHECK(torch::equal(unet->forward(x, in.get("timesteps_a"), ctx), ref_a));
}

TEST_CASE("DeepCache shallow path equals the full forward's tail", "[sd][unet][deepcache]") {
    auto unet = load_unet_folder(test::golden("sd/unet_sd15_tiny"));
    auto in = golden_map("sd/unet_sd15_tiny/golden_inputs.safetensors");
    const auto x = in.get("sample"), ctx = in.get("encoder_hidden_states"), t = in.get("timesteps_a");
    for (int branch : {0, 1, 2, 3, 5}) {
        INFO("branch " << branch);
        UNetFeatures f;
        f.cache_branch = branch;
        auto full = unet->forward(x, t, ctx, &f);
        REQUIRE(f.cache_feature.defined());
        // Same inputs: the shallow path with the feature of this very step reproduces the full output.
        auto shallow = unet->forward_shallow(x, t, ctx, branch, f.cache_feature);
        CHECK(test::max_abs_diff(full, shallow) < 1e-5);
    }
    UNetFeatures f0;
    f0.cache_branch = 0;
    f0.record_inner = true;
    unet->forward(x, t, ctx, &f0);
    CHECK(torch::equal(f0.cache_feature, f0.named.at("up_blocks.3.attentions.1")));
    // A probe's conv_in output handed over as `stem` gives the very same result, full and shallow.
    const auto stem = unet->stem(x);
    CHECK(torch::equal(stem, f0.named.at("conv_in")));
    CHECK(torch::equal(unet->forward(x, t, ctx, nullptr, stem), unet->forward(x, t, ctx)));
    CHECK(torch::equal(unet->forward_shallow(x, t, ctx, 0, f0.cache_feature, stem),
                       unet->forward_shallow(x, t, ctx, 0, f0.cache_feature)));
    CHECK_THROWS_WITH(unet->forward(x, t, ctx, nullptr, stem.narrow(1, 0, 3)),
                      Catch::Contains("conv_in output has shape") && Catch::Contains("expected"));
}

TEST_CASE("SD 2.x-style single file (linear projections, OpenCLIP text encoder) round-trips", "[sd][single_file]") {
    torch::manual_seed(7);
    const auto [uc, vc, tc] = test::tiny_sd2_configs();
    UNet2DConditionModel unet(uc);
    AutoencoderKL vae(vc);
    ClipTextModel te(tc);
    NamedTensors file;
    for (const auto& p : unet->named_parameters(true))
        file.emplace_back(ldm_name(Component::Unet, p.key(), uc, vc), p.value().detach().to(torch::kHalf));
    for (const auto& p : vae->named_parameters(true)) {
        auto t = p.value().detach();
        if (p.key().find("mid_block.attentions.0.to_") != std::string::npos && t.dim() == 2)
            t = t.unsqueeze(-1).unsqueeze(-1);
        file.emplace_back(ldm_name(Component::Vae, p.key(), uc, vc), t);
    }
    // Open CLIP layout: fused in_proj, one more resblock than the model SD 2.x uses (penultimate layer).
    const std::string oc = "cond_stage_model.model.";
    test::add_open_clip_tensors(file, *te, oc);
    file.emplace_back(oc + "text_projection", torch::randn({32, 32}));
    file.emplace_back(oc + "logit_scale", torch::ones({}));
    auto dir = test::scratch_dir("sd2_single_file");
    save_safetensors(dir + "/sd2_tiny.safetensors", file);
    auto m = load_sd_models(dir + "/sd2_tiny.safetensors");
    CHECK(m.family == unet::SdFamily::SD2);
    CHECK(m.tokenizer.pad_id() == 0);
    CHECK(m.unet->config().use_linear_projection);
    CHECK(m.unet->config().heads == uc.heads);
    CHECK(m.text_encoder->config().num_hidden_layers == 2);
    CHECK(m.text_encoder->config().hidden_act == "gelu");
    auto x = torch::randn({2, 4, 8, 8});
    auto ctx = torch::randn({2, 77, 32});
    auto t = torch::tensor(int64_t(500));
    // The UNet went through float16 in the file: compare against the same rounding.
    UNet2DConditionModel ref(uc);
    {
        torch::NoGradGuard ng;
        for (auto& p : ref->named_parameters(true))
            p.value().copy_(unet->named_parameters(true)[p.key()].to(torch::kHalf));
    }
    // Both in eval mode, as loaded models are: train mode keeps autograd and with it the torch attention path, whose
    // rounding differs from the fused kernel's (kernels/attention.h).
    ref->eval();
    vae->eval();
    CHECK(torch::equal(m.unet->forward(x, t, ctx), ref->forward(x, t, ctx)));
    auto z = torch::randn({1, 4, 4, 4});
    CHECK(torch::equal(m.vae->decode(z), vae->decode(z)));
    auto ids = torch::randint(0, 1000, {1, 77}, torch::kLong);
    torch::NoGradGuard ng;
    CHECK(torch::equal(m.text_encoder->encode(ids), te->encode(ids)));
}

TEST_CASE("the attention arithmetic is the model's: by its shapes, a model folder may ask for fused", "[sd][unet]") {
    namespace fs = std::filesystem;
    // the golden tiny model: no anchorcache.json, exact
    auto tiny = unet::load_sd_models(std::string(ANCHOR_SOURCE_DIR) + "/assets/models/sd15-tiny-random");
    CHECK(tiny.attention == kernels::AttentionKernel::Exact);
    // the demo model trained here asks for the fused kernel; an explicit choice wins
    const std::string fashion = std::string(ANCHOR_SOURCE_DIR) + "/assets/models/fashion-sd";
    if (fs::exists(fashion)) {
        auto fm = unet::load_sd_models(fashion);
        CHECK(fm.attention == kernels::AttentionKernel::Fused);
        unet::LoadOptions lo;
        lo.attention = kernels::AttentionKernel::Exact;
        CHECK(unet::load_sd_models(fashion, lo).attention == kernels::AttentionKernel::Exact);
        // On a trained model the fused kernel's other summation order stays at the rounding level.
        c10::InferenceMode guard;
        torch::manual_seed(1);
        auto x = torch::randn({20, 4, 8, 8}), ctx = torch::randn({20, 77, 64});
        auto t = torch::tensor(500.0, torch::kFloat).reshape({});
        auto fused = fm.unet->forward(x, t, ctx);
        fm.unet->set_attention_kernel(kernels::AttentionKernel::Exact);
        auto exact = fm.unet->forward(x, t, ctx);
        CHECK(test::max_abs_diff(fused, exact) <= 1e-5 * exact.abs().max().item<double>());
    }
    // Without a hint, the UNet's shapes decide: SD 1.5 / SDXL (10 channels per GroupNorm group) get the fast kernels,
    // the tiny reference layouts (1-2 channels per group) the reference's bits.
    CHECK(unet::default_attention_kernel(unet::UNetConfig{}) == kernels::AttentionKernel::Fused);
    {
        unet::UNetConfig narrow;
        narrow.block_out_channels = {32, 64};
        CHECK(unet::default_attention_kernel(narrow) == kernels::AttentionKernel::Exact);
    }
    // A UNet of the published kind (8 channels per group) at a 32x32 latent: level 0 attends over 1024 tokens, which
    // the fused choice runs on the tiled kernel; the whole forward stays within rounding of the reference.
    {
        unet::UNetConfig c;
        c.block_out_channels = {64, 128};
        c.norm_num_groups = 8;
        c.layers_per_block = {1, 1};
        c.heads = {2, 2};
        c.transformer_layers_per_block = {1, 1};
        c.down_block_types = {"CrossAttnDownBlock2D", "DownBlock2D"};
        c.up_block_types = {"UpBlock2D", "CrossAttnUpBlock2D"};
        c.cross_attention_dim = 32;
        c.sample_size = 32;
        CHECK(unet::default_attention_kernel(c) == kernels::AttentionKernel::Fused);
        torch::manual_seed(3);
        unet::UNet2DConditionModel u(c);
        u->eval();
        c10::InferenceMode guard;
        auto x = torch::randn({2, 4, 32, 32}), ctx = torch::randn({2, 7, 32});
        auto t = torch::tensor(300.0, torch::kFloat).reshape({});
        u->set_attention_kernel(kernels::AttentionKernel::Exact);
        auto exact = u->forward(x, t, ctx);
        for (auto k : {kernels::AttentionKernel::Fused, kernels::AttentionKernel::Flash}) {
            u->set_attention_kernel(k);
            CHECK(test::max_abs_diff(u->forward(x, t, ctx), exact) <= 1e-5 * exact.abs().max().item<double>());
        }
    }
    // a malformed hint file is an error naming the file and the field
    const auto dir = test::scratch_dir("model_hints");
    std::ofstream(dir + "/anchorcache.json") << R"({"attention": "fastest"})";
    CHECK_THROWS_WITH(unet::read_model_hints(dir), Catch::Contains("anchorcache.json") && Catch::Contains("fastest"));
    std::ofstream(dir + "/anchorcache.json") << R"({"attention": "exact", "threads": 4})";
    CHECK_THROWS_WITH(unet::read_model_hints(dir), Catch::Contains("threads"));
}

TEST_CASE("SD family from tensor shapes: one rule for every layout", "[sd][family]") {
    using unet::SdFamily;
    using unet::SdShapes;
    CHECK(unet::sd_family(SdShapes{768, false, 0, 768, false, false, ""}) == SdFamily::SD1);
    CHECK(unet::sd_family(SdShapes{1024, false, 0, 1024, true, false, ""}) == SdFamily::SD2);
    CHECK(unet::sd_family(SdShapes{32, true, 0, 32, false, false, ""}) == SdFamily::SD2); // OpenCLIP layout
    CHECK(unet::sd_family(SdShapes{768, false, 1280, 2048, true, true, "label_emb"}) == SdFamily::SDXL);
    CHECK(unet::sd_family(SdShapes{0, false, 1280, 1280, true, true, "label_emb"}) == SdFamily::SDXLRefiner);
    // the golden single files: SD 1.x and SDXL (the tensor that showed it is named)
    auto sd1 = WeightMap::load(test::golden("sd/sd15_tiny_single_file/sd15_tiny_single_file.safetensors"));
    CHECK(unet::sd_family(unet::sd_shapes_of_single_file(sd1)) == SdFamily::SD1);
    auto shapes = unet::sd_shapes_of_single_file(
        WeightMap::load(test::golden("sd/sdxl_tiny_single_file/sdxl_tiny_single_file.safetensors")));
    CHECK(unet::sd_family(shapes) == SdFamily::SDXL);
    CHECK(shapes.added_conditioning_tensor == "model.diffusion_model.label_emb.0.0.weight");
    CHECK(unet::default_unet_heads({320, 640, 1280}, false) == std::vector<int>{8, 8, 8});
    CHECK(unet::default_unet_heads({320, 640, 1280}, true) == std::vector<int>{5, 10, 20});
}
