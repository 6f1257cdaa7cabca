#include "unet/train/sd_train.h"

#include "cache/io/atomic_file.h"
#include "cache/io/error.h"
#include "cache/io/json_config.h"
#include "cache/io/safetensors.h"
#include "cache/io/weight_map.h"
#include "cache/train/optim.h"
#include "unet/model/checkpoint.h"
#include "unet/model/clip_text.h"
#include "unet/model/clip_tokenizer.h"
#include "unet/samplers/scheduler.h"
#include "unet/train/fashion_mnist.h"
#include "unet/train/train_loop.h"
#include "unet/model/unet_perf.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

namespace anchor::unet::train {

namespace fs = std::filesystem;
using torch::Tensor;

namespace {

// A random batch of training images as model input [B, 3, 32, 32] in [-1, 1] and their labels.
std::pair<Tensor, Tensor> batch_of(const FashionMnist& d, int64_t b, torch::Generator& gen) {
    auto idx = torch::randint(d.images.size(0), {b}, gen, torch::kLong);
    return {fashion_to_model_input(d.images.index_select(0, idx)), d.labels.index_select(0, idx)};
}

} // namespace

VaeConfig fashion_vae_config() {
    VaeConfig c;
    // Two downsamplers: 32x32 -> 8x8 latents (factor 4). Narrow at full resolution, where a conv costs the most
    // (the decoder's last level runs 4 convs at 32x32): ~0.7 s per batch of 64 on 2 cores.
    c.block_out_channels = {16, 32, 64};
    c.layers_per_block = 1;
    c.norm_num_groups = 8;
    c.latent_channels = 4;
    return c;
}

ClipTextConfig fashion_text_config() {
    ClipTextConfig c;
    c.hidden_size = 64;
    c.intermediate_size = 256;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 4;
    return c;
}

SchedulerConfig fashion_scheduler_config() {
    SchedulerConfig c; // SD 1.x's training schedule: the defaults
    c.class_name = "DDIMScheduler";
    return c;
}

UNetConfig fashion_unet_config() {
    UNetConfig c;
    c.sample_size = 8;
    c.down_block_types = {"CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"};
    c.up_block_types = {"UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"};
    c.block_out_channels = {32, 64, 64}; // 8x8 -> 4x4 -> 2x2; ~1 s per batch of 64 on one core
    c.layers_per_block = {1, 1, 1};
    c.heads = {4, 4, 4};
    c.transformer_layers_per_block = {1, 1, 1};
    c.cross_attention_dim = 64;
    c.norm_num_groups = 16;
    return c;
}

// ---- VAE ----------------------------------------------------------------------------------------------------------

TrainResult train_vae(const TrainOptions& o) {
    Loop loop(o, "vae");
    torch::manual_seed(uint64_t(o.seed));
    torch::Generator gen = at::detail::createCPUGenerator(uint64_t(o.seed) + 17);
    const auto data = load_fashion_mnist(o.data_dir, "train");
    VaeConfig cfg = fashion_vae_config();
    AutoencoderKL vae(cfg);
    vae->set_fast_paths(false); // the fast paths are inference-only (in-place ops)
    vae->train();
    auto opt = make_adamw(vae->parameters(), o);
    Ema ema(*vae, o.ema);
    const int start = loop.begin(*vae, ema, opt);
    const double kl_weight = 1e-6;
    for (int step = start; step < o.steps; ++step) {
        loop.set_lr(opt, step);
        auto [x, labels] = batch_of(data, o.batch, gen);
        auto post = vae->encode(x);
        auto z = post.mean + post.std * torch::randn(post.mean.sizes(), gen, torch::kFloat);
        auto rec = vae->decode(z);
        auto kl = 0.5 * (post.mean.pow(2) + post.std.pow(2) - 1 - post.logvar).sum({1, 2, 3}).mean();
        auto loss = torch::mse_loss(rec, x) + kl_weight * kl;
        opt.zero_grad();
        loss.backward();
        torch::nn::utils::clip_grad_norm_(vae->parameters(), o.grad_clip);
        opt.step();
        ema.update(*vae, step);
        loop.record(step, loss.item<double>(), *vae, ema, opt);
    }
    auto r = loop.finish(o.steps);

    // scaling_factor = 1 / std of the (EMA model's) latents over 4096 training images.
    AutoencoderKL final_vae(cfg);
    load_named(*final_vae, ema.weights(*vae));
    final_vae->eval();
    {
        c10::InferenceMode im;
        std::vector<Tensor> zs;
        for (int64_t i = 0; i < 4096; i += 512)
            zs.push_back(final_vae->encode(fashion_to_model_input(data.images.narrow(0, i, 512))).mean);
        cfg.scaling_factor = 1.0 / torch::cat(zs).std().item<double>();
    }
    const fs::path dir = fs::path(o.out) / "vae";
    fs::create_directories(dir);
    to_half_file((dir / "diffusion_pytorch_model.safetensors").string(), named_params(*final_vae));
    write_json(dir / "config.json", cfg.to_json(32)); // trained on 32x32 images
    r.metric = cfg.scaling_factor;
    std::fprintf(stderr, "vae: %d steps in %.0f s, loss %.4f -> %.4f, scaling_factor %.4f; wrote %s\n", r.steps_done,
                 r.seconds, r.first_loss, r.final_loss, cfg.scaling_factor, dir.c_str());
    return r;
}

// ---- UNet + text encoder --------------------------------------------------------------------------------------------

namespace {

struct TextAndUnet : torch::nn::Module {
    TextAndUnet(const ClipTextConfig& tc, const UNetConfig& uc) {
        text_encoder = register_module("text_encoder", ClipTextModel(tc));
        unet = register_module("unet", UNet2DConditionModel(uc));
        unet->set_fast_paths(false); // the fast paths are inference-only (in-place ops); the export runs them
    }
    ClipTextModel text_encoder{nullptr};
    UNet2DConditionModel unet{nullptr};
};

NamedTensors with_prefix_removed(const NamedTensors& t, const std::string& prefix) {
    NamedTensors out;
    for (const auto& [n, v] : t)
        if (n.rfind(prefix, 0) == 0) out.emplace_back(n.substr(prefix.size()), v);
    return out;
}

} // namespace

TrainResult train_unet(const TrainOptions& o) {
    Loop loop(o, "unet");
    torch::manual_seed(uint64_t(o.seed));
    torch::Generator gen = at::detail::createCPUGenerator(uint64_t(o.seed) + 29);
    const auto data = load_fashion_mnist(o.data_dir, "train");
    const fs::path vae_dir = fs::path(o.out) / "vae";
    if (!fs::exists(vae_dir / "config.json"))
        throw Error("train-unet needs the trained VAE in '" + vae_dir.string() + "' (run train-vae first)");
    auto vae = load_vae_folder(vae_dir.string());
    const double sf = vae->config().scaling_factor;

    // Latent posterior of every training image once (the VAE is frozen): mean and std, 8x8x4 each; kept in the
    // checkpoint folder so a resumed run does not encode again.
    Tensor lat_mean, lat_std;
    const auto lat_file = loop.ckpt / "latents.safetensors";
    if (fs::exists(lat_file)) {
        auto w = WeightMap::load(lat_file.string());
        lat_mean = w.get("mean");
        lat_std = w.get("std");
    } else {
        c10::InferenceMode im;
        std::vector<Tensor> m, s;
        const int64_t n = data.images.size(0);
        for (int64_t i = 0; i < n; i += 1000) {
            auto d = vae->encode(fashion_to_model_input(data.images.narrow(0, i, std::min<int64_t>(1000, n - i))));
            m.push_back(d.mean.clone());
            s.push_back(d.std.clone());
        }
        lat_mean = torch::cat(m);
        lat_std = torch::cat(s);
        fs::create_directories(loop.ckpt);
        save_safetensors(lat_file.string(), {{"mean", lat_mean}, {"std", lat_std}});
    }
    std::fprintf(stderr, "unet: encoded %lld training images to latents %s (scaling factor %.4f)\n",
                 (long long)lat_mean.size(0), shape_str(lat_mean.sizes().vec()).c_str(), sf);

    // Prompt ids: [class][template] plus the empty prompt (caption dropout / unconditional).
    const Tensor prompt_ids = fashion_prompt_ids(); // [10 * T + 1, 77]
    const int64_t n_templates = int64_t(fashion_prompt_templates().size()), uncond_row = 10 * n_templates;

    const auto ac = make_alphas_cumprod(SchedulerConfig{}); // SD 1.x training schedule

    TextAndUnet model(fashion_text_config(), fashion_unet_config());
    model.train();
    auto opt = make_adamw(model.parameters(), o);
    Ema ema(model, o.ema);
    const int start = loop.begin(model, ema, opt);
    for (int step = start; step < o.steps; ++step) {
        loop.set_lr(opt, step);
        auto idx = torch::randint(lat_mean.size(0), {o.batch}, gen, torch::kLong);
        auto x0 = (lat_mean.index_select(0, idx) +
                   lat_std.index_select(0, idx) * torch::randn({o.batch, 4, 8, 8}, gen, torch::kFloat)) *
                  sf;
        const auto nb = noised_batch(x0, data.labels.index_select(0, idx), n_templates, uncond_row,
                                     o.caption_dropout, ac, gen);
        auto ctx = model.text_encoder->encode(prompt_ids.index_select(0, nb.row));
        auto pred = model.unet->forward(nb.xt, nb.t.to(torch::kFloat), ctx);
        auto loss = torch::mse_loss(pred, nb.eps);
        opt.zero_grad();
        loss.backward();
        torch::nn::utils::clip_grad_norm_(model.parameters(), o.grad_clip);
        opt.step();
        ema.update(model, step);
        loop.record(step, loss.item<double>(), model, ema, opt);
    }
    auto r = loop.finish(o.steps);

    const auto w = ema.weights(model);
    const fs::path root(o.out);
    fs::create_directories(root / "unet");
    fs::create_directories(root / "text_encoder");
    fs::create_directories(root / "scheduler");
    to_half_file((root / "unet" / "diffusion_pytorch_model.safetensors").string(), with_prefix_removed(w, "unet."));
    write_json(root / "unet" / "config.json", fashion_unet_config().to_json());
    to_half_file((root / "text_encoder" / "model.safetensors").string(), with_prefix_removed(w, "text_encoder."));
    write_json(root / "text_encoder" / "config.json", fashion_text_config().to_json());
    write_json(root / "scheduler" / "scheduler_config.json", fashion_scheduler_config().to_json());
    write_json(root / "model_index.json", {{"_class_name", "StableDiffusionPipeline"},
                                           {"scheduler", {"diffusers", "DDIMScheduler"}},
                                           {"text_encoder", {"transformers", "CLIPTextModel"}},
                                           {"unet", {"diffusers", "UNet2DConditionModel"}},
                                           {"vae", {"diffusers", "AutoencoderKL"}}});
    // A model of our own has no reference outputs to reproduce bit for bit: let it run the fused small-head attention
    // (unet/model/checkpoint.h, LoadOptions::attention).
    write_json(root / "anchorcache.json",
               {{"attention", "fused"},
                {"why", "trained by anchor-sd train-unet; no reference outputs to reproduce bit for bit"}});
    std::fprintf(stderr, "unet: %d steps in %.0f s, loss %.4f -> %.4f; wrote %s\n", r.steps_done, r.seconds,
                 r.first_loss, r.final_loss, root.c_str());
    return r;
}

// ---- classifier ---------------------------------------------------------------------------------------------------

FashionClassifierImpl::FashionClassifierImpl() {
    namespace nn = torch::nn;
    conv1 = register_module("conv1", nn::Conv2d(nn::Conv2dOptions(1, 32, 3).padding(1)));
    conv2 = register_module("conv2", nn::Conv2d(nn::Conv2dOptions(32, 64, 3).padding(1)));
    conv3 = register_module("conv3", nn::Conv2d(nn::Conv2dOptions(64, 128, 3).padding(1)));
    fc = register_module("fc", nn::Linear(128 * 4 * 4, 10));
}

Tensor FashionClassifierImpl::forward(const Tensor& x) {
    auto h = torch::max_pool2d(torch::relu(conv1->forward(x)), 2);       // 16x16
    h = torch::max_pool2d(torch::relu(conv2->forward(h)), 2);            // 8x8
    h = torch::max_pool2d(torch::relu(conv3->forward(h)), 2).flatten(1); // 4x4x128: keeps the layout
    return fc->forward(h);
}

FashionClassifier load_fashion_classifier(const std::string& path) {
    FashionClassifier c;
    WeightMap::load(path).load_into(*c);
    c->eval();
    return c;
}

TrainResult train_classifier(const TrainOptions& o) {
    Loop loop(o, "classifier");
    torch::manual_seed(uint64_t(o.seed));
    torch::Generator gen = at::detail::createCPUGenerator(uint64_t(o.seed) + 41);
    const auto data = load_fashion_mnist(o.data_dir, "train");
    const auto test = load_fashion_mnist(o.data_dir, "t10k");
    FashionClassifier net;
    net->train();
    auto opt = make_adamw(net->parameters(), o);
    Ema ema(*net, o.ema);
    const int start = loop.begin(*net, ema, opt);
    for (int step = start; step < o.steps; ++step) {
        loop.set_lr(opt, step);
        auto [x, y] = batch_of(data, o.batch, gen);
        // Random shifts by up to 2 pixels: generated items are not always centred like the dataset's.
        const int64_t dx = torch::randint(-2, 3, {1}, gen, torch::kLong).item<int64_t>(),
                      dy = torch::randint(-2, 3, {1}, gen, torch::kLong).item<int64_t>();
        x = torch::roll(x, {dy, dx}, {2, 3});
        auto loss = torch::cross_entropy_loss(net->forward(rgb_to_classifier_input(x, false)), y);
        opt.zero_grad();
        loss.backward();
        opt.step();
        ema.update(*net, step);
        loop.record(step, loss.item<double>(), *net, ema, opt);
    }
    auto r = loop.finish(o.steps);
    FashionClassifier final_net;
    load_named(*final_net, ema.weights(*net));
    final_net->eval();
    int64_t correct = 0;
    {
        c10::InferenceMode im;
        for (int64_t i = 0; i < test.images.size(0); i += 1000) {
            auto x = rgb_to_classifier_input(fashion_to_model_input(test.images.narrow(0, i, 1000)), false);
            correct += (final_net->forward(x).argmax(1) == test.labels.narrow(0, i, 1000)).sum().item<int64_t>();
        }
    }
    r.metric = double(correct) / double(test.images.size(0));
    fs::create_directories(o.out);
    save_safetensors((fs::path(o.out) / "classifier.safetensors").string(), named_params(*final_net),
                     {{"test_accuracy", std::to_string(r.metric)}});
    std::fprintf(stderr, "classifier: %d steps in %.0f s, loss %.4f -> %.4f, test accuracy %.2f %%\n", r.steps_done,
                 r.seconds, r.first_loss, r.final_loss, 100 * r.metric);
    return r;
}

} // namespace anchor::unet::train
