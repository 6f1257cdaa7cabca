// The model files SD users have: SD 2.x v-prediction detection for single files, --prediction, --vae FILE and
// --weights-dtype (unet/model/checkpoint.h).
#include "cache/io/deferred_weights.h"
#include "cache/io/error.h"
#include "cache/io/safetensors.h"
#include "cache/io/weight_map.h"
#include "tests/sd_tiny_configs.h"
#include "tests/test_util.h"
#include "unet/model/checkpoint.h"
#include "unet/pipeline/pipeline.h"
#include "unet/pipeline/txt2img_job.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>

using namespace anchor;
using namespace anchor::unet;
namespace fs = std::filesystem;

namespace {

const std::string kTiny = std::string(ANCHOR_SOURCE_DIR) + "/assets/models/sd15-tiny-random";

using test::error_of;

// The VAE's tensors under original (LDM) names, as a single-file VAE (vae-ft-mse-840000-ema-pruned) has them: the
// mid-block attention's linears as [C, C, 1, 1] convolutions.
NamedTensors ldm_vae_tensors(AutoencoderKLImpl& vae, const std::string& prefix) {
    NamedTensors out;
    for (const auto& p : vae.named_parameters(true)) {
        auto t = p.value().detach().clone();
        if (p.key().find("mid_block.attentions.0.to_") != std::string::npos && t.dim() == 2)
            t = t.unsqueeze(-1).unsqueeze(-1);
        out.emplace_back(prefix + vae_ldm_name(p.key(), vae.config()), t);
    }
    return out;
}

torch::Tensor decode_fixed(AutoencoderKLImpl& vae) {
    torch::manual_seed(3);
    const auto z = torch::randn({1, vae.config().latent_channels, 8, 8});
    return vae.decode(z);
}

// A tiny SD 2.x-layout single file (linear projections, OpenCLIP text encoder) whose UNet output is constant:
// conv_out's weight 0 and its bias `out_bias` everywhere.
std::string sd2_single_file(const std::string& dir, double out_bias) {
    torch::manual_seed(11);
    const auto [uc, vc, tc] = test::tiny_sd2_configs();
    UNet2DConditionModel unet(uc);
    {
        torch::NoGradGuard ng;
        unet->conv_out->weight.zero_();
        unet->conv_out->bias.fill_(out_bias);
    }
    AutoencoderKL vae(vc);
    ClipTextModel te(tc);
    NamedTensors file;
    for (const auto& p : unet->named_parameters(true))
        file.emplace_back(ldm_name(Component::Unet, p.key(), uc, vc), p.value().detach().clone());
    auto v = ldm_vae_tensors(*vae, "first_stage_model.");
    file.insert(file.end(), v.begin(), v.end());
    test::add_open_clip_tensors(file, *te, "cond_stage_model.model.");
    const std::string path = dir + "/sd2_tiny.safetensors";
    save_safetensors(path, file);
    return path;
}

// Bytes of the Linear and Conv2d weights of `m` (what --weights-dtype stores in reduced precision).
int64_t linear_conv_weight_bytes(torch::nn::Module& m, torch::ScalarType expect) {
    int64_t n = 0;
    for (const auto& sub : m.modules(true)) {
        torch::Tensor w, b;
        if (auto* l = dynamic_cast<torch::nn::LinearImpl*>(sub.get())) w = l->weight, b = l->bias;
        if (auto* c = dynamic_cast<torch::nn::Conv2dImpl*>(sub.get())) w = c->weight, b = c->bias;
        if (!w.defined()) continue;
        CHECK(w.scalar_type() == expect);
        if (b.defined()) CHECK(b.scalar_type() == torch::kFloat); // biases stay float32
        n += w.numel() * int64_t(w.element_size());
    }
    return n;
}

Txt2ImgParams short_params() {
    Txt2ImgParams p;
    p.prompts = {"a photo of an astronaut riding a horse on mars"};
    p.steps = 6;
    p.sampler = SamplerKind::DDIM;
    p.width = p.height = 16;
    return p;
}

Txt2ImgResult short_run(SDModels& m) {
    Txt2ImgPipeline pipe(m);
    return pipe.run(short_params());
}

} // namespace

TEST_CASE("VAE replacement (--vae): an LDM-named single file or a diffusers folder decodes bit for bit as the model's "
          "own VAE",
          "[sd_load][vae]") {
    const auto dir = test::scratch_dir("sd_load_vae");
    auto base = load_sd_models(kTiny);
    const auto ref = decode_fixed(*base.vae);
    // vae-ft-mse style: LDM names without a prefix; the same inside a full checkpoint's first_stage_model.; both with
    // the LDM training loss's tensors beside them (ignored).
    auto plain = ldm_vae_tensors(*base.vae, "");
    plain.emplace_back("loss.logvar", torch::zeros({}));
    save_safetensors(dir + "/vae_ldm.safetensors", plain);
    save_safetensors(dir + "/vae_prefixed.safetensors", ldm_vae_tensors(*base.vae, "first_stage_model."));
    // A diffusers VAE folder (its config.json and weights).
    fs::create_directories(dir + "/vae_folder");
    fs::copy_file(kTiny + "/vae/config.json", dir + "/vae_folder/config.json");
    NamedTensors diffusers;
    for (const auto& p : base.vae->named_parameters(true)) diffusers.emplace_back(p.key(), p.value().detach().clone());
    save_safetensors(dir + "/vae_folder/diffusion_pytorch_model.safetensors", diffusers);
    for (const std::string f : {"/vae_ldm.safetensors", "/vae_prefixed.safetensors", "/vae_folder",
                                "/vae_folder/diffusion_pytorch_model.safetensors"}) {
        INFO(f);
        LoadOptions o;
        o.vae_file = dir + f;
        auto m = load_sd_models(kTiny, o);
        CHECK(m.vae_file == dir + f);
        CHECK(torch::equal(decode_fixed(*m.vae), ref));
    }
    // The whole pipeline: the same image.
    LoadOptions o;
    o.vae_file = dir + "/vae_ldm.safetensors";
    auto m = load_sd_models(kTiny, o);
    CHECK(torch::equal(short_run(m).image, short_run(base).image));
}

TEST_CASE("VAE replacement (--vae): a VAE that does not fit names the file, every tensor and both shapes",
          "[sd_load][vae]") {
    const auto dir = test::scratch_dir("sd_load_vae_bad");
    auto base = load_sd_models(kTiny);
    auto t = ldm_vae_tensors(*base.vae, "");
    std::vector<int64_t> good;
    for (auto& [n, v] : t)
        if (n == "decoder.conv_in.weight") good = v.sizes().vec(), v = torch::zeros({3, 3});
    t.erase(std::remove_if(t.begin(), t.end(), [](const auto& kv) { return kv.first == "encoder.conv_out.bias"; }),
            t.end());
    t.emplace_back("decoder.extra.weight", torch::zeros({2}));
    const std::string file = dir + "/vae_wrong.safetensors";
    save_safetensors(file, t);
    LoadOptions o;
    o.vae_file = file;
    const auto msg = error_of([&] { load_sd_models(kTiny, o); });
    INFO(msg);
    CHECK_THAT(msg, Catch::Contains(file));
    CHECK_THAT(msg, Catch::Contains("decoder.conv_in.weight: expected " + shape_str(good) + ", got [3, 3]"));
    CHECK_THAT(msg, Catch::Contains("1 missing tensor(s)"));
    CHECK_THAT(msg, Catch::Contains("encoder.conv_out.bias"));
    CHECK_THAT(msg, Catch::Contains("1 unexpected tensor(s):\n  decoder.extra.weight"));
    o.vae_file = dir + "/missing.safetensors";
    CHECK_THAT(error_of([&] { load_sd_models(kTiny, o); }), Catch::Contains("missing.safetensors"));
}

TEST_CASE("SD 2.x single files: the v-prediction test decides, --prediction overrides, the default size follows",
          "[sd_load][prediction]") {
    const auto dir = test::scratch_dir("sd_load_prediction");
    // UNet output constant -2 on x = 0.5: mean(out - x) = -2.5 < -1, v-prediction.
    const auto v_file = sd2_single_file(dir, -2.0);
    auto v = load_sd_models(v_file);
    REQUIRE(v.family == SdFamily::SD2);
    CHECK(v.prediction.type == PredictionType::VPrediction);
    CHECK(v.prediction.source == PredictionSource::Detected);
    REQUIRE(v.prediction.test_mean);
    CHECK(*v.prediction.test_mean == Approx(-2.5).margin(1e-6));
    CHECK(v.unet->config().sample_size == 96); // 768-v: 96 latents x the VAE factor
    {
        Txt2ImgPipeline pipe(v);
        CHECK(pipe.scheduler_config().prediction_type == PredictionType::VPrediction);
        CHECK(pipe.resolved({}).width == 96 * v.vae_scale_factor());
        const auto rec = model_record(pipe);
        CHECK(rec["prediction"]["type"] == "v_prediction");
        CHECK(rec["prediction"]["source"] == "detected");
        CHECK(rec["prediction"]["v_test_mean"].get<double>() == Approx(-2.5).margin(1e-6));
        CHECK(rec["vae"].is_null());
    }
    // --prediction eps overrides the detected v; the test's evidence is still recorded.
    LoadOptions eps;
    eps.prediction = PredictionType::Epsilon;
    auto forced = load_sd_models(v_file, eps);
    CHECK(forced.prediction.type == PredictionType::Epsilon);
    CHECK(forced.prediction.source == PredictionSource::Option);
    REQUIRE(forced.prediction.test_mean);
    CHECK(*forced.prediction.test_mean == Approx(-2.5).margin(1e-6));
    CHECK(forced.unet->config().sample_size == 64);
    CHECK(Txt2ImgPipeline(forced).scheduler_config().prediction_type == PredictionType::Epsilon);

    // Output 0.5 = x: mean 0, epsilon.
    fs::create_directories(dir + "/eps");
    auto e = load_sd_models(sd2_single_file(dir + "/eps", 0.5));
    CHECK(e.prediction.type == PredictionType::Epsilon);
    CHECK(e.prediction.source == PredictionSource::Detected);
    CHECK(*e.prediction.test_mean == Approx(0.0).margin(1e-6));
    CHECK(e.unet->config().sample_size == 64);
    CHECK(Txt2ImgPipeline(e).scheduler_config().prediction_type == PredictionType::Epsilon);
}

TEST_CASE("prediction of SD 1.x single files and diffusers folders: no test, the config, the option",
          "[sd_load][prediction]") {
    auto sd1 = load_sd_models(test::golden("sd/sd15_tiny_single_file/sd15_tiny_single_file.safetensors"));
    CHECK(sd1.prediction.source == PredictionSource::Sd1Default);
    CHECK(!sd1.prediction.test_mean);
    CHECK(Txt2ImgPipeline(sd1).scheduler_config().prediction_type == PredictionType::Epsilon);
    auto folder = load_sd_models(kTiny);
    CHECK(folder.prediction.source == PredictionSource::SchedulerConfig);
    CHECK(!folder.prediction.test_mean);
    const auto own = SchedulerConfig::from_json_file(kTiny + "/scheduler/scheduler_config.json").prediction_type;
    CHECK(Txt2ImgPipeline(folder).scheduler_config().prediction_type == own);
    LoadOptions o;
    o.prediction = PredictionType::VPrediction;
    auto forced = load_sd_models(kTiny, o);
    CHECK(Txt2ImgPipeline(forced).scheduler_config().prediction_type == PredictionType::VPrediction);
    CHECK(forced.unet->config().sample_size == folder.unet->config().sample_size); // the folder's config says
}

TEST_CASE("weight storage dtype (--weights-dtype) f16/bf16 halves the Linear/Conv weights, the compute stays float32",
          "[sd_load][weights]") {
    auto f32 = load_sd_models(kTiny);
    LoadOptions o;
    o.weights_dtype = torch::kHalf;
    auto f16 = load_sd_models(kTiny, o);
    CHECK(f16.weights_dtype == torch::kHalf);
    const std::vector<std::pair<torch::nn::Module*, torch::nn::Module*>> parts = {
        {f32.unet.get(), f16.unet.get()},
        {f32.vae.get(), f16.vae.get()},
        {f32.text_encoder.get(), f16.text_encoder.get()}};
    for (const auto& [a, b] : parts) {
        const int64_t wa = linear_conv_weight_bytes(*a, torch::kFloat), wb = linear_conv_weight_bytes(*b, torch::kHalf);
        CHECK(2 * wb == wa);
        // Nothing else changed size: no float32 copy kept.
        CHECK(parameter_bytes(*b) == parameter_bytes(*a) - wa / 2);
    }
    // The weights are the float32 ones rounded to float16 (round to nearest, relative error <= 2^-11).
    CHECK(torch::equal(f16.unet->conv_in->weight, f32.unet->conv_in->weight.to(torch::kHalf)));
    // The tiny model's weights are float16 values already (as most distributed SD checkpoints are): storing them as
    // float16 loses nothing, and the upcast-at-use compute gives the float32 run's bits.
    const auto a = short_run(f32), b = short_run(f16);
    CHECK(torch::equal(a.image, b.image));
    // bfloat16 keeps 8 mantissa bits: each weight moves by at most 2^-9 relative. One UNet evaluation then stays
    // within a few times that of the float32 output (relative to its largest value; errors of independent roundings
    // add up over the layers), far below what a wrong or missing upcast gives.
    o.weights_dtype = torch::kBFloat16;
    auto bf16 = load_sd_models(kTiny, o);
    torch::manual_seed(5);
    const auto x = torch::randn({1, 4, 8, 8}), ctx = torch::randn({1, 77, f32.unet->config().cross_attention_dim});
    const auto ua = f32.unet->forward(x, torch::tensor(int64_t(500)), ctx),
               ub = bf16.unet->forward(x, torch::tensor(int64_t(500)), ctx);
    CHECK(ub.scalar_type() == torch::kFloat);
    const double rel = test::max_abs_diff(ua, ub) / ua.abs().max().item<double>();
    INFO("bf16 weights: UNet output max|a-b| / max|a| " << rel);
    CHECK(rel > 0.0);
    CHECK(rel <= 2e-2);
    // f32 (the default) is the untouched model.
    o.weights_dtype = torch::kFloat;
    auto same = load_sd_models(kTiny, o);
    CHECK(torch::equal(short_run(same).image, a.image));
}

TEST_CASE("weight storage dtype (--weights-dtype) is checked before loading", "[sd_load][weights]") {
    LoadOptions o;
    o.weights_dtype = torch::kHalf;
    o.dtype = torch::kBFloat16;
    CHECK_THAT(error_of([&] { o.validate(); }), Catch::Contains("weights_dtype"));
    o.dtype = torch::kFloat;
    o.weights_dtype = torch::kDouble;
    const auto msg = error_of([&] { o.validate(); });
    CHECK_THAT(msg, Catch::Contains("f32, f16, bf16"));
}

TEST_CASE("deferred layers (cache/io/deferred_weights.h): real shapes, the scope's weight dtype, no initialisation "
          "written, and the forward of the eager layer once filled",
          "[sd_load][deferred]") {
    torch::manual_seed(3);
    const auto lo = torch::nn::LinearOptions(6, 5), lo_nobias = torch::nn::LinearOptions(6, 5).bias(false);
    const auto co = torch::nn::Conv2dOptions(8, 12, 3).stride(2).padding(1).groups(4);
    // Outside a scope: LibTorch's own layers.
    CHECK(make_linear(lo)->weight.abs().sum().item<double>() > 0);
    torch::nn::Linear eager_l(lo);
    torch::nn::Conv2d eager_c(co);
    torch::nn::Linear lazy_l{nullptr}, lazy_nb{nullptr};
    torch::nn::Conv2d lazy_c{nullptr};
    {
        const DeferredWeights outer(torch::kBFloat16);
        {
            const DeferredWeights inner; // float32: the innermost scope wins
            lazy_c = make_conv2d(co);
        }
        lazy_l = make_linear(lo);
        lazy_nb = make_linear(lo_nobias);
    }
    CHECK(lazy_l->weight.sizes() == eager_l->weight.sizes());
    CHECK(lazy_l->weight.scalar_type() == torch::kBFloat16);
    CHECK(lazy_l->bias.scalar_type() == torch::kFloat); // biases stay float32, as store_weights_as leaves them
    CHECK(lazy_l->options.in_features() == 6);
    CHECK(lazy_l->options.out_features() == 5);
    CHECK_FALSE(lazy_nb->bias.defined());
    CHECK(lazy_c->weight.sizes() == eager_c->weight.sizes());
    CHECK(lazy_c->bias.sizes() == eager_c->bias.sizes());
    CHECK(lazy_c->weight.scalar_type() == torch::kFloat);
    CHECK(lazy_c->options.in_channels() == 8);
    CHECK(lazy_c->options.out_channels() == 12);
    // After the copy a loader makes, the forward is the eager layer's, bit for bit.
    {
        torch::NoGradGuard ng;
        lazy_c->weight.copy_(eager_c->weight);
        lazy_c->bias.copy_(eager_c->bias);
    }
    const auto x = torch::randn({2, 8, 9, 9});
    CHECK(torch::equal(lazy_c->forward(x), eager_c->forward(x)));
    // A whole model loaded through the deferred layers is the one loaded into initialised layers.
    WeightMap w = WeightMap::load(kTiny + "/vae");
    AutoencoderKL eager(VaeConfig::from_json_file(kTiny + "/vae/config.json"));
    eager->load(w);
    auto deferred = load_vae_folder(kTiny + "/vae");
    const auto pe = eager->named_parameters(true), pd = deferred->named_parameters(true);
    REQUIRE(pe.size() == pd.size());
    for (const auto& p : pe) CHECK(torch::equal(p.value(), pd[p.key()]));
}

TEST_CASE("free_params releases the text encoder, the VAE encoder and the UNet after their last use: the same image, "
          "and the models refuse a second run",
          "[sd_load][free_params]") {
    auto kept = load_sd_models(kTiny);
    auto freed = load_sd_models(kTiny);
    Txt2ImgPipeline pipe(freed);
    Txt2ImgParams p = short_params();
    p.free_params = true;
    const auto r = pipe.run(p);
    CHECK(torch::equal(r.image, short_run(kept).image));
    CHECK(parameter_bytes(*freed.unet) == 0);
    CHECK(parameter_bytes(*freed.text_encoder) == 0);
    CHECK(parameter_bytes(*freed.vae->encoder) == 0);
    CHECK(parameter_bytes(*freed.vae->decoder) == parameter_bytes(*kept.vae->decoder));
    const std::string e = error_of([&] { pipe.run(p); });
    CHECK_THAT(
        e, Catch::Contains("weights released after their last use (free_params): text encoders, VAE encoder, UNet"));
    // A job releases them on its last batch only: every batch before it still has the models.
    auto job_models = load_sd_models(kTiny);
    Txt2ImgPipeline job_pipe(job_models);
    Txt2ImgJob job;
    job.params = p;
    job.params.steps = 2;
    job.prompts = {"a", "b"};
    job.batch_size = 1;
    job.write_files = false;
    const auto out = run_txt2img_job(job_pipe, job);
    CHECK(out.images.size() == 2);
    CHECK(job_models.released.size() == 3);
}
