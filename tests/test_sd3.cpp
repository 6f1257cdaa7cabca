// SD 3 / 3.5 pieces against their defining formulas (the diffusers goldens are golden_runner's sd3 checker): the
// flow-matching Euler schedule and step, the MMDiT config reader, the joint attention, the position grid, the model's
// shapes and errors, and the 16-channel VAE's config switches.
#include "cache/io/error.h"
#include "cache/io/weight_map.h"
#include "tests/test_util.h"
#include "tests/tiny_sd_run.h"
#include "unet/model/mmdit.h"
#include "unet/model/sd_family.h"
#include "unet/model/vae.h"
#include "unet/samplers/scheduler.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cmath>

using namespace anchor;
using namespace anchor::unet;

namespace {

SD3TransformerConfig tiny_config(bool sd35) {
    SD3TransformerConfig c;
    c.sample_size = 8;
    c.patch_size = 2;
    c.in_channels = c.out_channels = 16;
    c.num_layers = 3;
    c.attention_head_dim = 8;
    c.num_attention_heads = 2;
    c.joint_attention_dim = 32;
    c.caption_projection_dim = 16;
    c.pooled_projection_dim = 24;
    c.pos_embed_max_size = 16;
    if (sd35) c.qk_norm = QkNorm::RmsNorm, c.dual_attention_layers = {0, 1};
    return c;
}

double shifted(double s, double shift) {
    return shift * s / (1 + (shift - 1) * s);
}

} // namespace

TEST_CASE("flow-match Euler: shifted linear sigmas, timesteps sigma * N, Euler velocity step", "[sd3][schedulers]") {
    SchedulerConfig c;
    c.shift = 3.0;
    auto s = make_scheduler(SamplerKind::FlowMatchEuler, c);
    s->set_timesteps(6);
    const auto sig = s->sigmas();
    const auto ts = s->timesteps();
    REQUIRE(sig.size() == 7);
    REQUIRE(ts.size() == 6);
    CHECK(sig.back() == 0.0);
    // sigma_max / sigma_min of the shifted training sigmas (N/N and 1/N), spaced linearly in t and shifted again.
    const double hi = shifted(1.0, 3.0), lo = shifted(1.0 / 1000, 3.0);
    for (int i = 0; i < 6; ++i) {
        const double t = hi * 1000 + i * (lo * 1000 - hi * 1000) / 5;
        CHECK(sig[i] == Approx(shifted(t / 1000, 3.0)).epsilon(1e-6));
        CHECK(ts[i] == double(float(sig[i]) * 1000.0f));
    }
    CHECK(s->init_noise_sigma() == 1.0);
    auto x = torch::randn({1, 16, 4, 4}), v = torch::randn({1, 16, 4, 4});
    CHECK(torch::equal(s->scale_model_input(x, 0), x));
    const float dt = float(sig[2]) - float(sig[1]);
    CHECK(torch::allclose(s->step(v, 1, x, nullptr), x + dt * v, 0, 0));
    // add_noise is the straight path between the sample and the noise.
    auto x0 = torch::randn({1, 16, 4, 4}), n = torch::randn({1, 16, 4, 4});
    CHECK(torch::allclose(s->add_noise(x0, n, 2), float(sig[2]) * n + (1 - float(sig[2])) * x0, 1e-6, 1e-6));
    CHECK(sampler_from_class_name("FlowMatchEulerDiscreteScheduler") == SamplerKind::FlowMatchEuler);
    CHECK(sampler_from_string("flow_match_euler") == SamplerKind::FlowMatchEuler);
}

TEST_CASE("flow-match Euler: dynamic shifting needs mu, which follows the token count", "[sd3][schedulers]") {
    auto c = SchedulerConfig::from_json_text(
        R"({"_class_name": "FlowMatchEulerDiscreteScheduler", "use_dynamic_shifting": true, "base_shift": 0.5,
            "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096})");
    CHECK(flow_match_mu(c, 256) == Approx(0.5));
    CHECK(flow_match_mu(c, 4096) == Approx(1.15));
    CHECK_THROWS_AS(make_scheduler(SamplerKind::FlowMatchEuler, c)->set_timesteps(4), ParamError);
    c.mu = flow_match_mu(c, 1024);
    auto s = make_scheduler(SamplerKind::FlowMatchEuler, c);
    s->set_timesteps(4);
    const double e = std::exp(*c.mu);
    const double t1 = 1000 + (1 - 1000) / 3.0; // unshifted training sigmas: 1 .. 1/N
    CHECK(s->sigmas()[1] == Approx(e / (e + 1 / (t1 / 1000) - 1)).epsilon(1e-6));
}

TEST_CASE("flow-match Euler: keys of later schedulers it does not run are reported", "[sd3][schedulers]") {
    const std::string ok = R"({"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000,
        "shift": 3.0, "use_dynamic_shifting": false, "base_shift": 0.5, "max_shift": 1.15,
        "base_image_seq_len": 256, "max_image_seq_len": 4096, "invert_sigmas": false, "shift_terminal": null})";
    CHECK(unsupported_scheduler_settings(ok, SamplerKind::FlowMatchEuler).empty());
    const auto bad = unsupported_scheduler_settings(
        R"({"_class_name": "FlowMatchEulerDiscreteScheduler", "shift_terminal": 0.02, "use_karras_sigmas": true})",
        SamplerKind::FlowMatchEuler);
    REQUIRE(bad.size() == 2);
    CHECK_THROWS_AS(SchedulerConfig::from_json_text(R"({"shift": 0})"), Error);
    SchedulerConfig k;
    k.schedule = NoiseSchedule::Karras;
    CHECK_THROWS_AS(make_scheduler(SamplerKind::FlowMatchEuler, k), ParamError);
}

TEST_CASE("SD3 transformer config: diffusers keys, errors naming the key", "[sd3]") {
    nlohmann::json j = tiny_config(true).to_json();
    const auto back = SD3TransformerConfig::from_json(j);
    CHECK(back.qk_norm == QkNorm::RmsNorm);
    CHECK(back.dual_attention_layers == std::vector<int>{0, 1});
    CHECK(back.inner_dim() == 16);
    auto expect_error = [&](nlohmann::json k, const std::string& word) {
        try {
            (void)SD3TransformerConfig::from_json(k, "cfg.json");
            FAIL("no error for " + word);
        } catch (const Error& e) {
            CHECK(std::string(e.what()).find(word) != std::string::npos);
        }
    };
    auto q = j;
    q["qk_norm"] = "layer_norm";
    expect_error(q, "qk_norm");
    auto cp = j;
    cp["caption_projection_dim"] = 24;
    expect_error(cp, "caption_projection_dim");
    auto unknown = j;
    unknown["skip_layers"] = {7};
    expect_error(unknown, "skip_layers");
    auto dual = j;
    dual["dual_attention_layers"] = {5};
    expect_error(dual, "dual_attention_layers");
    auto no_out = j;
    no_out.erase("out_channels");
    no_out["in_channels"] = 4;
    CHECK(SD3TransformerConfig::from_json(no_out).out_channels == 4);
}

TEST_CASE("SD3 position grid: column half then row half, sin then cos", "[sd3]") {
    const auto pe = sincos_pos_embed_2d(8, 4, 2); // positions i / (4 / 2)
    REQUIRE(pe.sizes() == torch::IntArrayRef({16, 8}));
    const int64_t r = 1, c = 3, tok = r * 4 + c;
    const double pc = c / 2.0, pr = r / 2.0;
    for (int k = 0; k < 2; ++k) {
        const double w = std::pow(10000.0, -k / 2.0);
        CHECK(pe[tok][k].item<double>() == Approx(std::sin(pc * w)).margin(1e-6));
        CHECK(pe[tok][2 + k].item<double>() == Approx(std::cos(pc * w)).margin(1e-6));
        CHECK(pe[tok][4 + k].item<double>() == Approx(std::sin(pr * w)).margin(1e-6));
        CHECK(pe[tok][6 + k].item<double>() == Approx(std::cos(pr * w)).margin(1e-6));
    }
}

TEST_CASE("SD3 joint attention: softmax over the image tokens then the text tokens, per head", "[sd3]") {
    torch::manual_seed(3);
    for (const bool rms : {false, true}) {
        JointAttention a(16, 2, 8, true, false, rms ? QkNorm::RmsNorm : QkNorm::None);
        torch::NoGradGuard ng;
        for (auto& p : a->parameters()) p.normal_(0, 0.3);
        auto x = torch::randn({2, 5, 16}), ctx = torch::randn({2, 3, 16});
        auto [hx, hc] = a->forward(x, ctx);
        // Direct evaluation, head by head.
        auto q = torch::cat({a->to_q(x), a->add_q_proj(ctx)}, 1), k = torch::cat({a->to_k(x), a->add_k_proj(ctx)}, 1),
             v = torch::cat({a->to_v(x), a->add_v_proj(ctx)}, 1);
        std::vector<torch::Tensor> heads;
        for (int h = 0; h < 2; ++h) {
            auto qh = q.narrow(2, 8 * h, 8), kh = k.narrow(2, 8 * h, 8), vh = v.narrow(2, 8 * h, 8);
            if (rms) {
                auto n = [](const torch::Tensor& t, const torch::Tensor& w) {
                    return t / torch::sqrt(t.pow(2).mean(-1, true) + 1e-6) * w;
                };
                qh = torch::cat(
                    {n(qh.narrow(1, 0, 5), a->norm_q->weight), n(qh.narrow(1, 5, 3), a->norm_added_q->weight)}, 1);
                kh = torch::cat(
                    {n(kh.narrow(1, 0, 5), a->norm_k->weight), n(kh.narrow(1, 5, 3), a->norm_added_k->weight)}, 1);
            }
            heads.push_back(torch::softmax(torch::matmul(qh, kh.transpose(1, 2)) / std::sqrt(8.0), -1).matmul(vh));
        }
        auto o = torch::cat(heads, 2);
        CHECK(torch::allclose(hx, a->out_linear(o.narrow(1, 0, 5)), 1e-5, 1e-5));
        CHECK(torch::allclose(hc, a->to_add_out(o.narrow(1, 5, 3)), 1e-5, 1e-5));
    }
}

TEST_CASE("SD3 transformer: shapes, block features, the last block's pre-only context, input errors", "[sd3]") {
    torch::manual_seed(5);
    for (const bool sd35 : {false, true}) {
        SD3Transformer2DModel m(tiny_config(sd35));
        m->eval();
        std::set<std::string> names;
        for (const auto& p : m->named_parameters()) names.insert(p.key());
        CHECK(names.count("transformer_blocks.1.attn.to_add_out.weight"));
        CHECK(!names.count("transformer_blocks.2.attn.to_add_out.weight"));
        CHECK(!names.count("transformer_blocks.2.ff_context.net.0.proj.weight"));
        CHECK(names.count("transformer_blocks.0.attn2.to_q.weight") == (sd35 ? 1 : 0));
        CHECK(names.count("transformer_blocks.2.attn.norm_added_q.weight") == (sd35 ? 1 : 0));
        CHECK(m->named_buffers().contains("pos_embed.pos_embed"));
        FeatureMap f;
        auto out = m->forward(torch::randn({2, 16, 8, 6}), torch::randn({2, 7, 32}), torch::randn({2, 24}),
                              torch::tensor({1000.0f, 250.0f}), &f);
        CHECK(out.sizes() == torch::IntArrayRef({2, 16, 8, 6}));
        CHECK(f.size() == 5);
        CHECK(f.at("transformer_blocks.2.hidden_states").sizes() == torch::IntArrayRef({2, 12, 16}));
        CHECK(!f.count("transformer_blocks.2.encoder_hidden_states"));
        // One timestep for the batch is broadcast.
        auto x = torch::randn({2, 16, 4, 4}), ctx = torch::randn({2, 3, 32}), pooled = torch::randn({2, 24});
        CHECK(torch::allclose(m->forward(x, ctx, pooled, torch::tensor(500.0f)),
                              m->forward(x, ctx, pooled, torch::tensor({500.0f, 500.0f})), 0, 0));
        CHECK_THROWS_AS(
            m->forward(torch::randn({1, 16, 7, 8}), ctx.narrow(0, 0, 1), pooled.narrow(0, 0, 1), torch::tensor(1.0f)),
            Error);
        CHECK_THROWS_AS(
            m->forward(torch::randn({1, 16, 34, 8}), ctx.narrow(0, 0, 1), pooled.narrow(0, 0, 1), torch::tensor(1.0f)),
            Error);
        CHECK_THROWS_AS(m->forward(x, torch::randn({2, 3, 31}), pooled, torch::tensor(1.0f)), Error);
    }
}

TEST_CASE("SD3 family and VAE: joint blocks decide the family, shift factor, no quant convs", "[sd3]") {
    SdShapes s;
    s.joint_blocks = true;
    s.text_width = 768;
    CHECK(sd_family(s) == SdFamily::SD3);
    CHECK(enum_name(sd_family_table(), SdFamily::SD3) == "sd3");
    nlohmann::json j = {{"_class_name", "AutoencoderKL"},
                        {"block_out_channels", {32, 64}},
                        {"latent_channels", 16},
                        {"layers_per_block", 1},
                        {"scaling_factor", 1.5305},
                        {"shift_factor", 0.0609},
                        {"use_quant_conv", false},
                        {"use_post_quant_conv", false},
                        {"down_block_types", {"DownEncoderBlock2D", "DownEncoderBlock2D"}},
                        {"up_block_types", {"UpDecoderBlock2D", "UpDecoderBlock2D"}}};
    const auto c = VaeConfig::from_json(j);
    CHECK(c.shift_factor == 0.0609);
    CHECK(!c.use_quant_conv);
    auto z = torch::randn({1, 16, 4, 4});
    CHECK(torch::allclose(c.unscale_latents(z), z / 1.5305 + 0.0609, 1e-6, 1e-6));
    CHECK(VaeConfig::from_json(c.to_json(16)).shift_factor == 0.0609);
    AutoencoderKL vae(c);
    for (const auto& p : vae->named_parameters()) CHECK(p.key().find("quant_conv") == std::string::npos);
    torch::NoGradGuard ng;
    CHECK(vae->decode(z).sizes() == torch::IntArrayRef({1, 3, 8, 8}));
    CHECK(vae->encode(torch::randn({1, 3, 8, 8})).mean.sizes() == torch::IntArrayRef({1, 16, 4, 4}));
}

TEST_CASE("SD3 single file: Stability names converted, the golden forward reproduced, stray tensors named", "[sd3]") {
    const std::string dir = test::golden("sd/sd3_tiny_single_file");
    const auto file = WeightMap::load(dir + "/sd3_tiny_single_file.safetensors");
    CHECK(sd_family(sd_shapes_of_single_file(file)) == SdFamily::SD3);
    const auto w = sd3_transformer_weights_from_single_file(file);
    const auto cfg = SD3TransformerConfig::detect_from_weights(w);
    CHECK(cfg.qk_norm == QkNorm::RmsNorm);
    CHECK(cfg.dual_attention_layers == std::vector<int>{0, 1});
    CHECK(cfg.attention_head_dim == 8);
    CHECK(cfg.pos_embed_max_size == 16);
    SD3Transformer2DModel m(cfg);
    m->load(w);
    m->eval();
    const auto g = WeightMap::load(dir + "/golden_transformer.safetensors");
    const auto out = m->forward(g.get("hidden_states"), g.get("encoder_hidden_states"), g.get("pooled_projections"),
                                g.get("timestep"));
    CHECK(torch::allclose(out, g.get("out"), 1e-4, 1e-4));
    WeightMap extra = file;
    extra.insert("model.diffusion_model.joint_blocks.0.x_block.attn.extra.weight", torch::zeros({2}));
    CHECK_THROWS_WITH(sd3_transformer_weights_from_single_file(extra), Catch::Contains("attn.extra.weight"));
}

TEST_CASE("flow_match_euler is refused on a UNet pipeline, naming the sampler", "[sd3][schedulers]") {
    auto models = test::deepcache_models();
    unet::Txt2ImgPipeline pipe(models);
    try {
        pipe.validate(test::tiny_params(4, SamplerKind::FlowMatchEuler));
        FAIL("flow_match_euler ran on a UNet");
    } catch (const ParamError& e) {
        CHECK(e.field() == "sampler");
        CHECK(std::string(e.what()).find("epsilon") != std::string::npos);
    }
}
