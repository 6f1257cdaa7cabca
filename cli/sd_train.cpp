// `anchor-sd train-vae | train-unet | train-classifier | eval-fashion`: the Fashion-MNIST demo model
// (unet/train/sd_train.h) and its evaluation with the real caches.
#include "cli/sd_train.h"

#include "cache/io/atomic_file.h"
#include "cache/io/error.h"
#include "cache/metrics.h"
#include "cli/bench_util.h"
#include "unet/checkpoint.h"
#include "unet/freq_cache.h"
#include "unet/pipeline.h"
#include "unet/train/fashion_mnist.h"
#include "unet/train/sd_train.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>

namespace anchor::cli {

namespace {

namespace fs = std::filesystem;
using namespace bench;
using unet::train::TrainOptions;

void add_train_options(CLI::App* c, TrainOptions& o, int steps, int batch, double lr) {
    o.steps = steps, o.batch = batch, o.lr = lr;
    c->add_option("-o,--output", o.out, "model folder (diffusers layout)")->required();
    c->add_option("--data", o.data_dir, "folder with the Fashion-MNIST IDX files")->capture_default_str();
    c->add_option("--steps", o.steps, "optimizer steps")->capture_default_str();
    c->add_option("--batch", o.batch, "batch size")->capture_default_str();
    c->add_option("--lr", o.lr, "peak learning rate (AdamW)")->capture_default_str();
    c->add_option("--warmup", o.warmup, "linear warm-up steps")->capture_default_str();
    c->add_option("--ema", o.ema, "EMA decay of the saved weights (0 = off)")->capture_default_str();
    c->add_option("--checkpoint-every", o.checkpoint_every, "steps between checkpoints")->capture_default_str();
    c->add_flag("--resume", o.resume, "continue from <output>/checkpoint/<what>/ if present");
    c->add_option("--seed", o.seed, "seed")->capture_default_str();
}

struct EvalOptions {
    std::string model = "assets/models/fashion-sd", classifier, modes = "off,deepcache:2,deepcache:3,deepcache:4,"
                                                                       "deepcache:5,deepcache:6,freq:thr=0.5,freq,freq:thr=2";
    std::string out;
    int seeds = 4, steps = 20;
    double cfg = 5.0;
    bool overwrite = false;
};

// Generates one image per class and seed for every mode (batched: the 10 class prompts in one pipeline run per seed)
// and reports prompt adherence (classifier), PSNR/SSIM vs the first mode and wall time.
int run_eval(const EvalOptions& o) {
    const auto modes = unet::split_mode_list(o.modes);
    for (const auto& m : modes) unet::parse_cache_mode(m);
    if (o.seeds < 1) throw UsageError("eval-fashion: --seeds must be >= 1");
    const std::string cls_path = o.classifier.empty() ? (fs::path(o.model) / "eval" / "classifier.safetensors").string()
                                                      : o.classifier;
    auto classifier = unet::train::load_fashion_classifier(cls_path);
    auto models = unet::load_sd_models(o.model);
    unet::Txt2ImgPipeline pipe(models);
    unet::Txt2ImgParams p;
    for (int c = 0; c < 10; ++c) p.prompts.push_back(unet::train::fashion_prompt(c, 0));
    p.steps = o.steps;
    p.sampler = unet::SamplerKind::DDIM;
    p.guidance_scale = o.cfg;
    p = pipe.resolved(p);
    const fs::path out = o.out.empty() ? fs::path(o.model) / "eval" : fs::path(o.out);
    fs::create_directories(out);
    pipe.run(p); // warm-up

    nlohmann::json rep = {{"model", o.model},        {"classifier", cls_path}, {"steps", o.steps},
                          {"sampler", "ddim"},        {"cfg_scale", o.cfg},     {"seeds", o.seeds},
                          {"images_per_mode", 10 * o.seeds}, {"modes", nlohmann::json::array()}};
    std::vector<std::vector<torch::Tensor>> ref(size_t(o.seeds)); // off images per seed
    std::printf("%-58s %6s %9s %9s %10s %8s %10s\n", "mode", "full", "wall s", "speed-up", "PSNR", "SSIM", "adherence");
    double wall0 = 0;
    for (size_t k = 0; k < modes.size(); ++k) {
        double wall = 0, psnr_sum = 0, ssim_sum = 0;
        int psnr_n = 0, correct = 0, full = 0, total = 0;
        std::vector<torch::Tensor> tiles;
        std::string spec;
        for (int s = 0; s < o.seeds; ++s) {
            auto ctl = unet::parse_cache_mode(modes[k]);
            spec = ctl->spec();
            p.seed = 1000 + s;
            auto r = pipe.run(p, ctl.get());
            wall += r.denoise_s;
            full += r.full_steps, total += r.total_steps;
            {
                c10::InferenceMode im;
                auto pred = classifier->forward(unet::train::rgb_to_classifier_input(r.image, true)).argmax(1);
                correct += (pred == torch::arange(10)).sum().item<int>();
            }
            for (int c = 0; c < 10; ++c) {
                auto img = r.image[c].permute({1, 2, 0}).contiguous();
                if (k == 0) ref[size_t(s)].push_back(img);
                const double ps = cache::psnr(img, ref[size_t(s)][size_t(c)], 1.0);
                if (!std::isinf(ps)) psnr_sum += ps, ++psnr_n;
                ssim_sum += cache::ssim(img, ref[size_t(s)][size_t(c)], 1.0);
            }
            tiles.push_back(r.image_uint8); // [10, H, W, 3]
        }
        if (k == 0) wall0 = wall;
        const double psnr = psnr_n ? psnr_sum / psnr_n : INFINITY, ssim = ssim_sum / (10.0 * o.seeds);
        const double adherence = double(correct) / (10.0 * o.seeds);
        std::printf("%-58s %3d/%-3d %8.3f %8.2fx %10s %8.4f %9.1f%%\n", spec.c_str(), full, total, wall,
                    wall0 / wall, std::isinf(psnr) ? "inf" : fmt("%.2f dB", psnr).c_str(), ssim, 100 * adherence);
        std::fflush(stdout);
        // Sample sheet: one row per seed, one column per class.
        std::vector<torch::Tensor> rows;
        for (auto& t : tiles) rows.push_back(torch::cat(t.unbind(0), 1));
        const std::string sheet = (out / ("samples_" + fs::path(spec).filename().string() + ".png")).string();
        unet::write_png(sheet, torch::cat(rows, 0), true);
        rep["modes"].push_back({{"mode", spec},
                                {"full_steps", full},
                                {"total_steps", total},
                                {"wall_s", wall},
                                {"speedup_vs_first", wall0 / wall},
                                {"psnr_db", std::isinf(psnr) ? nlohmann::json("inf") : nlohmann::json(psnr)},
                                {"ssim", ssim},
                                {"classifier_adherence", adherence},
                                {"samples", sheet}});
    }
    write_file_atomic((out / "cache_eval.json").string(), rep.dump(2) + "\n", true);
    std::printf("wrote %s\n", (out / "cache_eval.json").c_str());
    return 0;
}

} // namespace

void add_sd_train_commands(CLI::App& app, std::vector<std::pair<CLI::App*, std::function<int()>>>& runners) {
    auto vae = std::make_shared<TrainOptions>();
    auto* cv = app.add_subcommand("train-vae", "train the demo AutoencoderKL on Fashion-MNIST");
    cv->fallthrough();
    add_train_options(cv, *vae, 1500, 64, 1e-3);
    runners.emplace_back(cv, [vae]() { return unet::train::train_vae(*vae), 0; });

    auto un = std::make_shared<TrainOptions>();
    auto* cu = app.add_subcommand("train-unet", "train the demo UNet + text encoder on the VAE's latents");
    cu->fallthrough();
    add_train_options(cu, *un, 3000, 128, 1e-3);
    cu->add_option("--caption-dropout", un->caption_dropout, "probability of the empty prompt")->capture_default_str();
    runners.emplace_back(cu, [un]() { return unet::train::train_unet(*un), 0; });

    auto cl = std::make_shared<TrainOptions>();
    auto* cc = app.add_subcommand("train-classifier", "train the Fashion-MNIST classifier used by eval-fashion");
    cc->fallthrough();
    add_train_options(cc, *cl, 1500, 128, 2e-3);
    runners.emplace_back(cc, [cl]() { return unet::train::train_classifier(*cl), 0; });

    auto ev = std::make_shared<EvalOptions>();
    auto* ce = app.add_subcommand("eval-fashion", "prompt adherence and cache speed/quality on the fashion model");
    ce->fallthrough();
    ce->add_option("-m,--model", ev->model, "model folder")->capture_default_str();
    ce->add_option("--classifier", ev->classifier, "classifier (default: <model>/eval/classifier.safetensors)");
    ce->add_option("--modes", ev->modes, "cache modes, the first is the reference")->capture_default_str();
    ce->add_option("--seeds", ev->seeds, "seeds (each gives one image per class)")->capture_default_str();
    ce->add_option("--steps", ev->steps, "DDIM steps")->capture_default_str();
    ce->add_option("--cfg-scale", ev->cfg, "guidance scale")->capture_default_str();
    ce->add_option("-o,--output", ev->out, "output folder (default: <model>/eval)");
    runners.emplace_back(ce, [ev]() { return run_eval(*ev); });
}

} // namespace anchor::cli
