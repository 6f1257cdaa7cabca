// The trainers' config.json files go through the one JSON field binding (cache/io/json_config.h) in both directions:
// each config's to_json writes the fields its from_json reads. Written -> read gives the same config, and the committed
// demo models' configs (written by the trainers) are reproduced key for key from what the loaders read.
#include "cache/io/json_config.h"
#include "text/gpt2/gpt2_model.h"
#include "unet/model/clip_text.h"
#include "unet/train/sd_train.h"
#include "unet/model/unet_model.h"
#include "unet/model/vae.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

using namespace anchor;
using namespace anchor::unet;

namespace {

nlohmann::json committed(const std::string& path) {
    return JsonConfig::load(path, "committed config").json();
}

} // namespace

TEST_CASE("train configs: the committed demo configs are what the loaders read, written back", "[train][config]") {
    const std::string sd = "assets/models/fashion-sd/";
    CHECK(UNetConfig::from_json_file(sd + "unet/config.json").to_json() == committed(sd + "unet/config.json"));
    CHECK(VaeConfig::from_json_file(sd + "vae/config.json").to_json(32) == committed(sd + "vae/config.json"));
    CHECK(ClipTextConfig::from_json_file(sd + "text_encoder/config.json").to_json() ==
          committed(sd + "text_encoder/config.json"));
    // The GPT-2 exporter adds torch_dtype, the dtype of the weights it wrote, to the config.
    auto gpt2 = committed("assets/models/kjv-gpt2/config.json");
    gpt2.erase("torch_dtype");
    CHECK(text::Gpt2Config::from_json_file("assets/models/kjv-gpt2/config.json").to_json() == gpt2);
    CHECK(SchedulerConfig::from_json_file(sd + "scheduler/scheduler_config.json").to_json() ==
          committed(sd + "scheduler/scheduler_config.json"));
}

TEST_CASE("train configs: the SD trainer's shapes write the committed files", "[train][config]") {
    const std::string sd = "assets/models/fashion-sd/";
    CHECK(train::fashion_unet_config().to_json() == committed(sd + "unet/config.json"));
    CHECK(train::fashion_text_config().to_json() == committed(sd + "text_encoder/config.json"));
    CHECK(train::fashion_scheduler_config().to_json() == committed(sd + "scheduler/scheduler_config.json"));
    // The VAE's scaling factor is measured by its training run.
    auto vae = train::fashion_vae_config();
    vae.scaling_factor = VaeConfig::from_json_file(sd + "vae/config.json").scaling_factor;
    CHECK(vae.to_json(32) == committed(sd + "vae/config.json"));
}

TEST_CASE("train configs: written then read gives the same config", "[train][config]") {
    SECTION("UNet: per-block lists, no mid block, SDXL's added conditioning") {
        UNetConfig c = train::fashion_unet_config();
        c.layers_per_block = {1, 2, 2};
        c.transformer_layers_per_block = {1, 2, 3};
        c.upcast_attention = true;
        c.mid_block = false;
        c.addition_time_embed_dim = 16;
        c.projection_class_embeddings_input_dim = 64 + 6 * 16;
        const auto j = c.to_json();
        CHECK(j["layers_per_block"] == nlohmann::json({1, 2, 2}));
        CHECK(j["mid_block_type"].is_null());
        const UNetConfig r = UNetConfig::from_json(j);
        CHECK(r.layers_per_block == c.layers_per_block);
        CHECK(r.heads == c.heads);
        CHECK(r.transformer_layers_per_block == c.transformer_layers_per_block);
        CHECK(r.upcast_attention);
        CHECK_FALSE(r.mid_block);
        CHECK(r.addition_time_embed_dim == 16);
        CHECK(r.projection_class_embeddings_input_dim == 64 + 6 * 16);
        CHECK(r.to_json() == j);
    }
    SECTION("VAE: latent statistics and force_upcast") {
        VaeConfig c = train::fashion_vae_config();
        c.force_upcast = true;
        c.latents_mean = {0.1, 0.2, 0.3, 0.4};
        c.latents_std = {1.0, 2.0, 3.0, 4.0};
        const VaeConfig r = VaeConfig::from_json(c.to_json(32));
        CHECK(r.block_out_channels == c.block_out_channels);
        CHECK(r.layers_per_block == 1);
        CHECK(r.force_upcast);
        CHECK(r.latents_mean == c.latents_mean);
        CHECK(r.latents_std == c.latents_std);
        CHECK(r.to_json(32) == c.to_json(32));
    }
    SECTION("CLIP text encoder with a projection") {
        ClipTextConfig c = train::fashion_text_config();
        c.hidden_act = "gelu";
        c.projection_dim = 32;
        const ClipTextConfig r = ClipTextConfig::from_json(c.to_json());
        CHECK(r.hidden_act == "gelu");
        CHECK(r.projection_dim == 32);
        CHECK(r.hidden_size == 64);
        CHECK(r.to_json() == c.to_json());
    }
    SECTION("GPT-2: n_inner null for 4 * n_embd, else its width") {
        text::Gpt2Config c;
        c.n_layer = 2, c.n_head = 2, c.n_embd = 32, c.n_positions = 64;
        CHECK(c.to_json()["n_inner"].is_null());
        CHECK(c.to_json()["n_ctx"] == 64);
        c.n_inner = 48;
        c.activation = "gelu";
        const auto r = text::Gpt2Config::from_json(c.to_json());
        CHECK(r.n_inner == 48);
        CHECK(r.activation == "gelu");
        CHECK(r.n_positions == 64);
        CHECK(r.to_json() == c.to_json());
    }
}
