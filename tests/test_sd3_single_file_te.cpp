// SD 3 / 3.5 single files with their text encoders inside (unet/model/sd3_text_encoders.h): the float8 decoding of
// safetensors against torch's own float8 types, and the loader's refusals (what is missing, all at once; scaled fp8;
// T5 without a tokenizer). The whole-pipeline check is golden_runner's sd3-single-file-te case.
#include "cache/io/error.h"
#include "cache/io/safetensors.h"
#include "cache/io/weight_map.h"
#include "tests/test_util.h"
#include "unet/bench/mmdit_bench.h"
#include "unet/bench/random_checkpoint.h"
#include "unet/model/sd3_text_encoders.h"
#include "unet/pipeline/sd3_pipeline.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>

using namespace anchor;
using namespace anchor::unet;

namespace {

// One 256-element float8 tensor per dtype holding the bytes 0..255, as a safetensors file in memory.
std::string sd3te_float8_file() {
    const std::string header = R"({"e4m3":{"dtype":"F8_E4M3","shape":[256],"data_offsets":[0,256]},)"
                               R"("e5m2":{"dtype":"F8_E5M2","shape":[16,16],"data_offsets":[256,512]}})";
    std::string bytes(8, '\0');
    const uint64_t n = header.size();
    std::memcpy(&bytes[0], &n, 8); // little-endian host
    bytes += header;
    for (int k = 0; k < 2; ++k)
        for (int b = 0; b < 256; ++b) bytes.push_back(char(b));
    return bytes;
}

WeightMap sd3te_without(const WeightMap& file, const std::function<bool(const std::string&)>& drop) {
    WeightMap w;
    for (const auto& [n, t] : file.all())
        if (!drop(n)) w.insert(n, t, file.source(n));
    return w;
}

bool sd3te_starts(const std::string& n, Sd3TextRole r) {
    return n.rfind(sd3_text_encoder_prefix(r), 0) == 0;
}

} // namespace

TEST_CASE("safetensors F8_E4M3 / F8_E5M2 decode to bfloat16 exactly as torch's float8 types", "[sd3][io]") {
    std::ifstream in(std::string(ANCHOR_SOURCE_DIR) + "/tests/data/float8/torch_float8.json");
    REQUIRE(in.good());
    const auto ref = nlohmann::json::parse(in);
    const auto f = SafeTensorsFile::from_bytes(sd3te_float8_file(), "float8");
    for (const auto& [name, key] : {std::pair{"e4m3", "F8_E4M3"}, std::pair{"e5m2", "F8_E5M2"}}) {
        const auto t = f->tensor(name);
        CHECK(t.scalar_type() == torch::kBFloat16);
        const auto v = t.to(torch::kFloat).reshape({-1});
        int bad = 0;
        for (int b = 0; b < 256; ++b) {
            const auto& r = ref.at(key).at(b);
            const float got = v[b].item<float>();
            if (r.is_null())
                bad += !std::isnan(got);
            else if (r.is_string())
                bad += !(std::isinf(got) && (got > 0) == (r.get<std::string>() == "inf"));
            else
                bad += got != r.get<float>() || std::signbit(got) != std::signbit(r.get<float>());
        }
        INFO(key);
        CHECK(bad == 0);
    }
}

TEST_CASE("SD3 single file text encoders: loaded from the file, what is missing named at once", "[sd3]") {
    const std::string dir = test::golden("sd/sd3_tiny_single_file_te");
    const std::string path = dir + "/sd3_tiny_te.safetensors";
    const auto file = WeightMap::load(path);

    const auto te = load_sd3_text_encoders(file, path, "", torch::kFloat, false);
    REQUIRE(te.text_encoder);
    REQUIRE(te.text_encoder_2);
    CHECK_FALSE(te.text_encoder_3);
    CHECK(te.text_encoder->config().hidden_act == "quick_gelu");
    CHECK(te.text_encoder_2->config().hidden_act == "gelu");
    // CLIP-L's projection: the identity, as diffusers' torch.eye.
    const auto proj = te.text_encoder->named_parameters()["text_projection.weight"];
    CHECK(torch::equal(proj, torch::eye(te.text_encoder->config().hidden_size)));
    CHECK(te.tokenizer_2.pad_id() == 0);

    // T5 inside, no tokenizer anywhere: refused, saying how to give one.
    CHECK_THROWS_WITH(load_sd3_text_encoders(file, path, "", torch::kFloat, true),
                      Catch::Contains("T5 tokenizer") && Catch::Contains("--no-t5"));
    // With the case's folder (tokenizer_3/): T5 loads, its config from shapes.
    const auto all = load_sd3_text_encoders(file, path, dir + "/text_encoders", torch::kFloat, true);
    REQUIRE(all.text_encoder_3);
    CHECK(all.text_encoder_3->config().relative_attention_max_distance == 128);
    CHECK(all.text_encoder_3->config().num_heads == 3);
    CHECK(all.text_encoder_3->config().d_kv == 8);

    // Only one CLIP: refused, naming the other.
    const auto no_g = sd3te_without(file, [](const std::string& n) { return sd3te_starts(n, Sd3TextRole::ClipG); });
    CHECK_THROWS_WITH(load_sd3_text_encoders(no_g, path, "", torch::kFloat, false), Catch::Contains("CLIP-G"));
    // Tensors missing in two encoders: one error names every one.
    const std::string l = sd3_text_encoder_prefix(Sd3TextRole::ClipL), t5 = sd3_text_encoder_prefix(Sd3TextRole::T5xxl);
    const auto holes = sd3te_without(file, [&](const std::string& n) {
        return n == l + "text_model.encoder.layers.1.mlp.fc2.bias" || n == l + "text_model.final_layer_norm.weight" ||
               n == t5 + "encoder.block.2.layer.1.DenseReluDense.wo.weight";
    });
    try {
        load_sd3_text_encoders(holes, path, dir + "/text_encoders", torch::kFloat, true);
        FAIL("missing tensors were not reported");
    } catch (const Error& e) {
        const std::string m = e.what();
        CHECK(m.find("2 text encoder(s)") != std::string::npos);
        CHECK(m.find("layers.1.mlp.fc2.bias") != std::string::npos);
        CHECK(m.find("final_layer_norm.weight") != std::string::npos);
        CHECK(m.find("block.2.layer.1.DenseReluDense.wo.weight") != std::string::npos);
    }

    // No text encoders at all (a transformer-only file): none loaded, nothing refused.
    const auto bare = sd3te_without(file, [](const std::string& n) { return n.rfind("text_encoders.", 0) == 0; });
    const auto none = load_sd3_text_encoders(bare, path, "", torch::kFloat, true);
    CHECK_FALSE(none.text_encoder);
    CHECK_FALSE(none.text_encoder_3);
    // ComfyUI's scaled fp8 marker: refused by name.
    WeightMap scaled = file;
    scaled.insert("scaled_fp8", torch::zeros({2}, torch::kBFloat16));
    CHECK_THROWS_WITH(check_sd3_single_file_weights(scaled, path), Catch::Contains("'scaled_fp8'"));
    CHECK_THROWS_WITH(load_sd3_text_encoders(file, path, dir + "/nowhere", torch::kFloat, false),
                      Catch::Contains("does not exist"));
}

TEST_CASE("random-model SD 3: Stability's names, text encoders inside, read back by the SD 3 loader", "[sd3]") {
    // Tiny configs through the writer the real sizes use (sd3.5-medium / -large are written only by hand: GBs).
    RandomSd3Parts parts;
    auto& t = parts.transformer;
    t.sample_size = 8, t.patch_size = 2, t.in_channels = t.out_channels = 16, t.num_layers = 3;
    t.attention_head_dim = 8, t.num_attention_heads = 2, t.joint_attention_dim = 32, t.caption_projection_dim = 16;
    t.pooled_projection_dim = 32, t.pos_embed_max_size = 16, t.dual_attention_layers = {0, 1};
    t.qk_norm = QkNorm::RmsNorm;
    VaeConfig v = sd3_vae_config();
    v.block_out_channels = {32, 64};
    v.layers_per_block = 1;
    parts.vae = v;
    ClipTextConfig l;
    l.hidden_size = 16, l.intermediate_size = 37, l.num_hidden_layers = 2, l.num_attention_heads = 2;
    l.projection_dim = 16;
    ClipTextConfig g = l;
    g.hidden_act = "gelu";
    parts.clip_l = l, parts.clip_g = g;
    T5EncoderConfig t5;
    t5.vocab_size = 132, t5.d_model = 32, t5.d_kv = 8, t5.num_heads = 3, t5.d_ff = 37, t5.num_layers = 2;
    t5.relative_attention_num_buckets = 8;
    parts.t5 = t5;
    RandomCheckpointParams p;
    p.dtype = torch::kFloat;
    p.output = test::scratch_dir("sd3_random") + "/sd3_random.safetensors";
    p.overwrite = true;
    write_random_sd3_checkpoint(p, parts, [](const std::string&) {});
    // T5's tokenizer: t5_tiny's (a single file has none).
    const std::string te = test::scratch_dir("sd3_random_te");
    std::filesystem::create_directories(te + "/tokenizer_3");
    for (const char* f : {"spiece.model", "tokenizer_config.json", "special_tokens_map.json"})
        std::filesystem::copy_file(test::golden("sd/t5_tiny") + "/" + f, te + "/tokenizer_3/" + f,
                                   std::filesystem::copy_options::overwrite_existing);
    const auto m = load_sd3_models(p.output, torch::kFloat, true, te);
    CHECK(m.transformer->config().dual_attention_layers == std::vector<int>{0, 1});
    CHECK(m.transformer->config().num_attention_heads == 2);
    CHECK(m.transformer->config().qk_norm == QkNorm::RmsNorm);
    REQUIRE(m.text_encoder);
    REQUIRE(m.text_encoder_2);
    REQUIRE(m.text_encoder_3);
    REQUIRE(m.vae);
    CHECK(m.text_encoder_3->config().num_layers == 2);
    CHECK(m.vae->config().latent_channels == 16);
    // A single-file name per diffusers tensor, q / k / v sharing the fused one.
    CHECK(sd3_single_file_name("transformer_blocks.2.attn.add_k_proj.bias") ==
          "joint_blocks.2.context_block.attn.qkv.bias");
    CHECK(sd3_single_file_name("transformer_blocks.0.attn2.norm_q.weight") ==
          "joint_blocks.0.x_block.attn2.ln_q.weight");
    CHECK(sd3_single_file_name("norm_out.linear.weight") == "final_layer.adaLN_modulation.1.weight");
    CHECK_THROWS_WITH(sd3_single_file_name("transformer_blocks.0.attn.nope.weight"), Catch::Contains("nope"));
    // MACs: the patch grid and the text tokens as counted by hand for one block layout.
    const auto macs = mmdit_macs(t, 8, 8, 10);
    CHECK(macs.conv == 16.0 * 64 * 16);
    CHECK(macs.attention > 0);
}

TEST_CASE("SD 3.5 real configs: Medium and Large as published", "[sd3]") {
    const auto m = sd3_transformer_config_of(Sd3Variant::Medium35);
    CHECK(m.num_layers == 24);
    CHECK(m.inner_dim() == 1536);
    CHECK(m.dual_attention_layers.size() == 13);
    CHECK(m.dual_attention_layers.back() == 12);
    CHECK(m.qk_norm == QkNorm::RmsNorm);
    const auto l = sd3_transformer_config_of(Sd3Variant::Large35);
    CHECK(l.num_layers == 38);
    CHECK(l.inner_dim() == 2432);
    CHECK(l.dual_attention_layers.empty());
}
