// LoRA on SD 3 / 3.5 (unet/model/lora_sd3.h) against tests/golden/sd/sd3_lora_tiny (diffusers 0.32.2 + PEFT on
// sd3_tiny_text's models): the SD 3 name table against the single-file converter, kohya's fused modules against the
// PEFT file they were written from, the header's alpha, the errors naming the file and every tensor that does not
// fit, and the tensors of an unloaded T5 skipped.
#include "cache/io/error.h"
#include "cache/io/safetensors.h"
#include "cache/io/weight_map.h"
#include "tests/test_util.h"
#include "unet/model/lora_sd3.h"
#include "unet/model/mmdit.h"
#include "unet/model/name_conversion.h"
#include "unet/pipeline/sd3_pipeline.h"

#include <catch2/catch.hpp>

#include <algorithm>

using namespace anchor;
using namespace anchor::unet;

namespace {

const std::string kSd3LoraCase = "sd/sd3_lora_tiny";

std::string sd3_lora_file(const std::string& f) {
    return test::golden(kSd3LoraCase + "/" + f);
}

SD3Models sd3_lora_base() {
    return load_sd3_models(test::golden("sd/sd3_tiny_text"));
}

} // namespace

TEST_CASE("sd3_source places every transformer tensor where the single-file converter reads it", "[lora][sd3]") {
    auto t = load_sd3_transformer_folder(test::golden("sd/sd3_tiny_text/transformer"));
    const auto& c = t->config();
    REQUIRE(!c.dual_attention_layers.empty()); // the table's attn2 rows are exercised
    std::map<std::string, std::vector<std::pair<int64_t, torch::Tensor>>> rows;
    std::vector<std::pair<std::string, torch::Tensor>> named;
    for (const auto& p : t->named_parameters(true)) named.emplace_back(p.key(), p.value());
    for (const auto& b : t->named_buffers(true)) named.emplace_back(b.key(), b.value());
    for (const auto& [name, v] : named) {
        const Sd3Source s = sd3_source(name, c.inner_dim(), c.num_layers);
        const torch::Tensor x = s.swap_halves ? torch::cat({v.chunk(2, 0)[1], v.chunk(2, 0)[0]}, 0) : v;
        rows[s.name].emplace_back(std::max<int64_t>(s.row_begin, 0), x);
    }
    WeightMap file;
    for (auto& [name, parts] : rows) {
        std::sort(parts.begin(), parts.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
        std::vector<torch::Tensor> ts;
        for (const auto& p : parts) ts.push_back(p.second);
        file.insert("model.diffusion_model." + name, torch::cat(ts, 0));
    }
    const WeightMap back = sd3_transformer_weights_from_single_file(file);
    for (const auto& [name, v] : named) {
        INFO(name);
        REQUIRE(back.has(name));
        CHECK(torch::equal(back.get(name), v));
    }
    CHECK(back.names().size() == named.size());
    CHECK_THROWS_WITH(sd3_source("transformer_blocks.0.attn.to_x.weight", 16, 3),
                      Catch::Contains("no original-layout name for 'transformer_blocks.0.attn.to_x.weight'"));
}

TEST_CASE("SD 3 LoRA: kohya's fused modules merge as the PEFT file they were written from", "[lora][sd3]") {
    SD3Models a = sd3_lora_base(), b = sd3_lora_base();
    const LoraFile k = read_lora(sd3_lora_file("lora_kohya.safetensors"), sd3_lora_targets(a));
    CHECK(k.format == "kohya");
    const auto qkv = std::find_if(k.modules.begin(), k.modules.end(), [](const LoraModule& m) {
        return m.key == "lora_unet_joint_blocks_0_x_block_attn_qkv";
    });
    REQUIRE(qkv != k.modules.end());
    REQUIRE(qkv->pieces.size() == 3);
    CHECK(qkv->pieces[1].weight == "transformer_blocks.0.attn.to_k.weight");
    const auto peft = read_lora(sd3_lora_file("lora_peft.safetensors"), sd3_lora_targets(b));
    CHECK(peft.format == "peft");
    // The header's LoraConfig: lora_alpha 8 over rank 4, proj_out's alpha_pattern 2.
    for (const auto& m : peft.modules) {
        if (m.weight == "transformer_blocks.0.attn.to_q.weight") CHECK(m.scale() == 2.0);
        if (m.weight == "proj_out.weight") CHECK(m.scale() == 0.5);
    }
    apply_sd3_loras(a, {{sd3_lora_file("lora_kohya.safetensors"), 0.6}});
    apply_sd3_loras(b, {{sd3_lora_file("lora_peft.safetensors"), 0.6}});
    std::map<std::string, torch::Tensor> pb;
    for (const auto& p : b.transformer->named_parameters(true)) pb[p.key()] = p.value();
    for (const auto& p : a.transformer->named_parameters(true)) {
        INFO(p.key());
        CHECK(test::max_abs_diff(p.value(), pb.at(p.key())) < 1e-6);
    }
    CHECK(a.loras.at(0).modules_per_component.at("transformer") == int(k.modules.size()));
    CHECK(b.loras.at(0).modules_per_component.count("text_encoder") == 1);
}

TEST_CASE("SD 3 LoRA: a file that does not fit names itself and every bad tensor; the weights stay", "[lora][sd3]") {
    SD3Models m = sd3_lora_base();
    const auto before = m.transformer->named_parameters(true)["transformer_blocks.0.attn.to_q.weight"].clone();
    const std::string dir = test::scratch_dir("lora_sd3_bad");
    auto st = SafeTensorsFile::open(sd3_lora_file("lora_peft_nometa.safetensors"));
    NamedTensors good, bad;
    for (const auto& ti : st->tensors()) {
        auto t = st->tensor(ti.name);
        good.emplace_back(ti.name, t);
        if (ti.name == "transformer.transformer_blocks.1.attn.to_k.lora_B.weight") t = torch::zeros({t.size(0) + 1, t.size(1)});
        bad.emplace_back(ti.name, t);
    }
    bad.emplace_back("transformer.transformer_blocks.0.attn.to_x.lora_A.weight", torch::zeros({4, 16}));
    bad.emplace_back("lora_unet_joint_blocks_7_x_block_attn_qkv.lora_down.weight", torch::zeros({4, 16}));
    bad.emplace_back("transformer.proj_out.dora_scale", torch::zeros({4}));
    save_safetensors(dir + "/bad.safetensors", bad);
    const std::string err = test::error_of([&] { apply_sd3_loras(m, {{dir + "/bad.safetensors", 1.0}}); });
    CHECK_THAT(err, Catch::Contains("LoRA file '" + dir + "/bad.safetensors' does not fit the model"));
    CHECK_THAT(err, Catch::Contains("transformer.transformer_blocks.0.attn.to_x.lora_A.weight"));
    CHECK_THAT(err, Catch::Contains("lora_unet_joint_blocks_7_x_block_attn_qkv.lora_down.weight"));
    CHECK_THAT(err, Catch::Contains("transformer.proj_out.dora_scale"));
    CHECK_THAT(err, Catch::Contains("transformer.transformer_blocks.1.attn.to_k: down [4, 16] / up [17, 4] do not fit"));
    CHECK(torch::equal(m.transformer->named_parameters(true)["transformer_blocks.0.attn.to_q.weight"], before));
    CHECK(m.loras.empty());

    // T5's tensors (sd-scripts' lora_te3_) are skipped when T5 is not loaded, and counted.
    good.emplace_back("lora_te3_encoder_block_0_layer_0_SelfAttention_q.lora_down.weight", torch::zeros({4, 32}));
    good.emplace_back("lora_te3_encoder_block_0_layer_0_SelfAttention_q.lora_up.weight", torch::zeros({32, 4}));
    save_safetensors(dir + "/te3.safetensors", good);
    const auto applied = apply_sd3_loras(m, {{dir + "/te3.safetensors", 1.0}});
    CHECK(applied.at(0).skipped == 2);
    CHECK(applied.at(0).to_json()["skipped_tensors"] == 2);
}
