// The one model resolver (cache/io/model_source.h): what a path is, which files hold the weights, where the config
// is, for every layout the loaders accept.
#include "cache/io/error.h"
#include "cache/io/model_source.h"
#include "cache/io/safetensors.h"
#include "cache/io/weight_map.h"
#include "tests/test_util.h"

#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>

using namespace anchor;
namespace fs = std::filesystem;

TEST_CASE("resolve_model: diffusers pipelines, components, single files", "[io][resolver]") {
    const std::string root = ANCHOR_SOURCE_DIR;
    auto pipe = resolve_model(root + "/assets/models/sd15-tiny-random");
    CHECK(pipe.layout == ModelLayout::DiffusersPipeline);
    CHECK(pipe.arch == ModelArch::StableDiffusion);
    REQUIRE(pipe.has_component("unet"));
    CHECK(pipe.component("unet").arch == ModelArch::UNet2DCondition);
    CHECK(pipe.component("vae").arch == ModelArch::AutoencoderKL);
    CHECK(pipe.component("text_encoder").arch == ModelArch::ClipText);
    CHECK(fs::path(pipe.component("unet").weight_files.at(0)).filename() == "diffusion_pytorch_model.safetensors");
    CHECK_THROWS_WITH(pipe.component("text_encoder_2"), Catch::Contains("text_encoder_2") && Catch::Contains("unet"));

    auto comp = resolve_model(test::golden("sd/unet_sd15_tiny"));
    CHECK(comp.layout == ModelLayout::DiffusersComponent);
    CHECK(comp.arch == ModelArch::UNet2DCondition);
    CHECK(comp.weight_files.size() == 1); // the standard name, not the golden_*.safetensors beside it

    auto single = resolve_model(test::golden("sd/sd15_tiny_single_file/sd15_tiny_single_file.safetensors"));
    CHECK(single.layout == ModelLayout::WeightsFile);
    CHECK(single.arch == ModelArch::StableDiffusion); // from its model.diffusion_model.* tensors

    auto gpt2 = resolve_model(root + "/assets/models/kjv-gpt2");
    CHECK(gpt2.layout == ModelLayout::WeightsFolder);
    CHECK(gpt2.arch == ModelArch::Gpt2);
    auto mdlm = resolve_model(root + "/assets/models/kjv-mdlm");
    CHECK(mdlm.arch == ModelArch::MaskedDiffusionLM);
}

TEST_CASE("resolve_model: folders of loose weights, shards, filters and errors", "[io][resolver]") {
    const auto dir = test::scratch_dir("resolver");
    save_safetensors(dir + "/a.safetensors", {{"wte.weight", torch::zeros({2, 2})}});
    save_safetensors(dir + "/b.safetensors", {{"optimizer.state", torch::zeros({1})}});
    auto all = resolve_model(dir);
    CHECK(all.layout == ModelLayout::WeightsFolder);
    CHECK(all.weight_files.size() == 2);
    ResolveOptions only;
    only.tensor_filter = [](const std::string& n) { return n == "wte.weight"; };
    only.what = "GPT-2 model";
    auto picked = resolve_model(dir, only);
    REQUIRE(picked.weight_files.size() == 1);
    CHECK(fs::path(picked.weight_files[0]).filename() == "a.safetensors");
    CHECK(picked.load_weights().has("wte.weight"));
    ResolveOptions none;
    none.tensor_filter = [](const std::string&) { return false; };
    none.what = "GPT-2 model";
    CHECK_THROWS_WITH(resolve_model(dir, none),
                      Catch::Contains("GPT-2 model folder") && Catch::Contains("a.safetensors"));
    // a sharded checkpoint through its index
    const auto shard = test::scratch_dir("resolver_shards");
    save_safetensors(shard + "/m-1.safetensors", {{"x", torch::ones({2})}});
    save_safetensors(shard + "/m-2.safetensors", {{"y", torch::ones({3})}});
    std::ofstream(shard + "/m.safetensors.index.json")
        << R"({"weight_map": {"x": "m-1.safetensors", "y": "m-2.safetensors"}})";
    auto sh = resolve_model(shard);
    CHECK(sh.layout == ModelLayout::ShardedIndex);
    CHECK(sh.load_weights().size() == 2);
    CHECK_THROWS_WITH(resolve_model(dir + "/nope"), Catch::Contains("does not exist"));
    std::ofstream(dir + "/weights.bin") << "x"; // a torch.save name, but not its bytes
    CHECK_THROWS_WITH(resolve_model(dir + "/weights.bin"), Catch::Contains("not a torch.save checkpoint"));
    std::ofstream(dir + "/weights.txt") << "x";
    CHECK_THROWS_WITH(resolve_model(dir + "/weights.txt"), Catch::Contains("is not a .safetensors or torch.save"));
}
