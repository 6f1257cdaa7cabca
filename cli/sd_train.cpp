// `anchor-sd train-vae | train-unet | train-classifier | eval-fashion`: the Fashion-MNIST demo model
// (unet/train/sd_train.h) and its evaluation with the real caches.
#include "cli/sd_commands.h"

#include "cache/io/atomic_file.h"
#include "cache/io/error.h"
#include "cache/metrics.h"
#include "cache/util/bench.h"
#include "cli/common.h"
#include "cli/enum_option.h"
#include "cli/loss_plot.h"
#include "unet/checkpoint.h"
#include "unet/freq_cache.h"
#include "unet/freq_calibration.h"
#include "unet/pipeline.h"
#include "unet/train/fashion_eval.h"
#include "unet/train/fashion_mnist.h"
#include "unet/train/sd_train.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <numeric>

namespace anchor::cli {

namespace {

namespace fs = std::filesystem;
using namespace util;
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
    unet::train::FashionEvalParams eval;
    std::string modes = "off,deepcache:2,deepcache:3,deepcache:4,deepcache:5,deepcache:6,freq:thr=0.5,freq,freq:thr=2";
};

int run_eval(EvalOptions& o) {
    o.eval.modes = unet::split_mode_list(o.modes);
    const auto r = unet::train::run_fashion_eval(o.eval);
    std::printf("%s", r.table().c_str());
    std::printf("wrote %s\n", r.report_path.c_str());
    return 0;
}

struct CalibrateOptions {
    unet::FreqCalibrationParams cal;
    std::string model, prompts = "assets/prompts/sd_bench.txt", out;
    int max_prompts = 8;
    bool overwrite = false;
};

int run_calibrate(CalibrateOptions& o) {
    if (o.out.empty()) throw UsageError("calibrate: -o PROFILE.json is required");
    check_output_path(o.out, o.overwrite);
    o.cal.prompts = read_prompts_file(o.prompts, o.max_prompts);
    o.cal.validate();
    auto models = unet::load_sd_models(o.model);
    unet::Txt2ImgPipeline pipe(models);
    auto profile = unet::calibrate_freq_profile(pipe, o.cal, [&](size_t i, const std::string& prompt) {
        std::fprintf(stderr, "calibrate: %zu/%zu \"%s\"\n", i + 1, o.cal.prompts.size(), prompt.c_str());
    });
    profile.meta["model"] = o.model;
    profile.meta["use"] = "--cache freq:profile=" + o.out;
    profile.save(o.out, o.overwrite);
    for (const auto& r : profile.step_ranges)
        std::printf("steps [%.2f, %.2f): mean change %.4f -> threshold %.4f\n", r.begin, r.end, r.mean_change,
                    r.threshold);
    std::printf("wrote %s (use --cache freq:profile=%s)\n", o.out.c_str(), o.out.c_str());
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
    ce->add_option("-m,--model", ev->eval.model, "model folder")->capture_default_str();
    ce->add_option("--classifier", ev->eval.classifier, "classifier (default: <model>/eval/classifier.safetensors)");
    ce->add_option("--modes", ev->modes, "cache modes, the first is the reference")->capture_default_str();
    ce->add_option("--seeds", ev->eval.seeds, "seeds (each gives one image per class)")->capture_default_str();
    ce->add_option("--steps", ev->eval.steps, "DDIM steps")->capture_default_str();
    ce->add_option("--repeats", ev->eval.repeats, "timed runs per seed and mode; the fastest counts")
        ->capture_default_str();
    ce->add_option("--cfg-scale", ev->eval.cfg, "guidance scale")->capture_default_str();
    ce->add_option("-o,--output", ev->eval.out, "output folder (default: <model>/eval)");
    ce->add_flag("--overwrite", ev->eval.overwrite,
                 "replace cache_eval.json and samples_<mode>.png already in the folder");
    // Bound when eval-fashion runs, not when it is declared: txt2img binds some of the same fields (prompts, steps)
    // to its own options.
    auto bind_eval_fields = [] {
        for (const auto& [field, flag] : std::vector<std::pair<const char*, const char*>>{{"modes", "--modes"},
                                                                                          {"seeds", "--seeds"},
                                                                                          {"repeats", "--repeats"},
                                                                                          {"ranges", "--ranges"},
                                                                                          {"target", "--target"},
                                                                                          {"steps", "--steps"},
                                                                                          {"prompts", "--prompts"}})
            bind_field(field, flag);
    };
    runners.emplace_back(ce, [ev, bind_eval_fields]() {
        bind_eval_fields();
        return run_eval(*ev);
    });

    auto cal = std::make_shared<CalibrateOptions>();
    auto* ck = app.add_subcommand("calibrate", "measure per-step spectral change of uncached runs and write a freq "
                                               "anchor profile (--cache freq:profile=FILE)");
    ck->fallthrough();
    ck->add_option("-m,--model", cal->model, "model (default: the embedded one)");
    ck->add_option("--prompts", cal->prompts, "prompt file, one per line")->capture_default_str();
    ck->add_option("--max-prompts", cal->max_prompts, "use at most this many prompts")->capture_default_str();
    auto& base = cal->cal.base;
    base.steps = 20;
    base.sampler = unet::SamplerKind::DDIM;
    base.seed = 0;
    ck->add_option("--steps", base.steps, "sampling steps (the profile is in fractions of the loop)")
        ->capture_default_str();
    add_enum_option(*ck, "--sampler", base.sampler, unet::sampler_table(), "sampler");
    ck->add_option("--cfg-scale", base.guidance_scale, "guidance scale")->capture_default_str();
    ck->add_option("--ranges", cal->cal.ranges, "number of equal step ranges")->capture_default_str();
    ck->add_option("--target", cal->cal.target, "full step after about this many steps of typical change")
        ->capture_default_str();
    ck->add_option("-s,--seed", base.seed, "first seed")->capture_default_str();
    ck->add_option("-o,--output", cal->out, "profile JSON to write")->required();
    ck->add_flag("--overwrite", cal->overwrite, "replace an existing profile");
    runners.emplace_back(ck, [cal]() {
        if (cal->model.empty()) cal->model = default_sd_model();
        return run_calibrate(*cal);
    });

    struct PlotOptions {
        std::vector<std::string> logs;
        std::string out, title = "training loss";
    };
    auto pl = std::make_shared<PlotOptions>();
    auto* cp = app.add_subcommand("plot-loss", "loss-curve PNG of one or more train_*_log.txt files");
    cp->fallthrough();
    cp->add_option("logs", pl->logs, "training logs (\"step loss\" or the trainers' \"step N/M loss X ...\" lines)")
        ->required();
    cp->add_option("-o,--output", pl->out, "PNG to write")->required();
    cp->add_option("--title", pl->title, "title")->capture_default_str();
    runners.emplace_back(cp, [pl]() {
        std::vector<LossSeries> s;
        for (const auto& l : pl->logs) s.push_back(read_loss_log(l, fs::path(l).stem().string()));
        plot_loss_curves(s, pl->out, pl->title, true);
        std::printf("wrote %s\n", pl->out.c_str());
        return 0;
    });
}

} // namespace anchor::cli
