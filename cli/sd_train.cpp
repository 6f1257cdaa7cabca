// `anchor-sd train-vae | train-unet | train-classifier | eval-fashion`: the Fashion-MNIST demo model
// (unet/train/sd_train.h) and its evaluation with the real caches.
#include "cli/sd_commands.h"

#include "cache/io/atomic_file.h"
#include "cache/io/error.h"
#include "cache/io/json_config.h"
#include "cache/metrics.h"
#include "cache/util/bench.h"
#include "cli/common.h"
#include "cli/enum_option.h"
#include "cli/loss_plot.h"
#include "unet/model/checkpoint.h"
#include "unet/cache/freq_cache.h"
#include "unet/cache/freq_calibration.h"
#include "unet/pipeline/pipeline.h"
#include "unet/pipeline/sd3_compare.h"
#include "unet/pipeline/sd3_pipeline.h"
#include "unet/train/controlnet_train.h"
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
    c->add_option("-s,--seed", o.seed, "seed")->capture_default_str();
}

struct EvalOptions {
    unet::train::FashionEvalParams eval;
    std::string modes = "off,deepcache:2,deepcache:3,deepcache:4,deepcache:5,deepcache:6,freq:thr=0.5,freq,freq:thr=2";
    std::string prompts_file, seeds; // eval-cache: the prompts file and the seed list
};

// Speed-quality plots of an eval report, one per sampler and statistic (mean and worst image), x = speed-up, y = PSNR:
// one colour per step count; each cache kind's modes as a solid line with large markers, except DeepCache, drawn
// dashed through its frontier (the curve the "against deepcache" verdict reads); the reference mode (identical images)
// is left out.
std::vector<std::string> write_speed_quality_plots(const nlohmann::json& rep, const fs::path& dir, bool overwrite) {
    using Points = std::vector<std::pair<double, double>>; // (speed-up, PSNR)
    auto curve = [](const std::string& label, const Points& pts, int color, bool dashed, int marker) {
        LossSeries s{label, {}, {}, color, dashed, marker};
        for (const auto& [x, y] : pts) s.steps.push_back(x), s.losses.push_back(y);
        return s;
    };
    // at(): a saved report (eval-plot) may lack a field; json's out_of_range then names it.
    std::vector<std::string> written;
    for (const auto& sampler : rep.at("samplers"))
        for (const char* stat : {"psnr_db", "psnr_min_db"}) {
            std::vector<LossSeries> series;
            int color = 0;
            for (const auto& c : rep.at("cells")) {
                if (c.at("sampler") != sampler) continue;
                const std::string steps = ", " + std::to_string(c.at("steps").get<int>()) + " steps";
                std::vector<std::pair<std::string, Points>> kinds; // every kind but DeepCache, in the cell's order
                for (const auto& m : c.at("modes")) {
                    const auto mode = m.at("mode").get<std::string>();
                    const std::string kind = mode.substr(0, mode.find(':'));
                    if (!m.contains(stat) || !m.at(stat).is_number() || kind == "deepcache") continue;
                    auto it = std::find_if(kinds.begin(), kinds.end(), [&](const auto& k) { return k.first == kind; });
                    if (it == kinds.end()) it = kinds.emplace(kinds.end(), kind, Points{});
                    it->second.emplace_back(m.at("speedup_vs_first").get<double>(), m.at(stat).get<double>());
                }
                for (auto& [kind, pts] : kinds) {
                    std::sort(pts.begin(), pts.end());
                    series.push_back(curve(kind + steps, pts, color, false, 5));
                }
                const auto frontier = unet::train::deepcache_frontier(c.at("modes"), stat);
                if (!frontier.empty()) series.push_back(curve("deepcache frontier" + steps, frontier, color, true, 3));
                ++color;
            }
            if (series.empty()) continue;
            const std::string name = sampler.get<std::string>();
            const bool mean = std::string(stat) == "psnr_db";
            PlotAxes ax{name + ": " + (mean ? "mean" : "worst-image") + " PSNR vs the uncached image", "speed-up (x)",
                        "PSNR (dB)", false};
            const std::string path = (dir / ("speed_quality_" + name + (mean ? "" : "_min") + ".png")).string();
            write_file_atomic(path, line_plot_png(series, ax), overwrite);
            written.push_back(path);
        }
    return written;
}

int run_eval(EvalOptions& o, bool samplers_given = true) {
    o.eval.modes = unet::parse_cache_list(o.modes, "modes");
    // An SD 3 model has one sampler, its flow-matching Euler: the default grid's ddim becomes it.
    if (!samplers_given && unet::is_sd3_model(o.eval.model)) o.eval.samplers = {"flow_match_euler"};
    if (!o.prompts_file.empty()) o.eval.prompts = read_prompts_file(o.prompts_file);
    if (!o.seeds.empty()) o.eval.seed_list = parse_int_list(o.seeds, "--seeds");
    const auto r = unet::train::run_fashion_eval(o.eval);
    std::printf("%s", r.table().c_str());
    std::printf("wrote %s\n", r.report_path.c_str());
    for (const auto& path :
         write_speed_quality_plots(r.report, fs::path(r.report_path).parent_path(), o.eval.overwrite))
        std::printf("wrote %s\n", path.c_str());
    return 0;
}

struct EvalPlotOptions {
    std::string report; // a cache_eval.json of eval-cache / eval-fashion
    bool overwrite = false;
};

int run_eval_plot(const EvalPlotOptions& o) {
    const auto rep = JsonConfig::load(o.report, "eval report").json();
    for (const char* key : {"samplers", "cells"})
        if (!rep.contains(key) || !rep[key].is_array())
            throw Error("'" + o.report + "': not an eval-cache report (no '" + key + "' list)");
    try {
        for (const auto& path : write_speed_quality_plots(rep, fs::path(o.report).parent_path(), o.overwrite))
            std::printf("wrote %s\n", path.c_str());
    } catch (const nlohmann::json::exception& e) {
        throw Error("'" + o.report + "': " + e.what());
    }
    return 0;
}

struct CalibrateOptions {
    unet::FreqCalibrationParams cal;
    std::string model, prompts = "assets/prompts/sd_bench.txt", out;
    int max_prompts = 8;
    bool overwrite = false;
};

// SD 3 / 3.5: TeaCache's rescale polynomial (sd3_teacache_calibrate) from uncached runs of the prompts at
// --seed, --steps and --cfg-scale, written as {"coef": [...], "use": "--cache teacache:coef=..."}.
int run_calibrate_sd3(const CalibrateOptions& o, const std::vector<std::string>& prompts) {
    auto m = unet::load_sd3_models(o.model);
    std::vector<unet::SD3Txt2ImgParams> runs;
    for (const auto& pr : prompts) {
        unet::SD3Txt2ImgParams p;
        p.prompts = {pr};
        p.seed = o.cal.base.seed;
        p.steps = o.cal.base.steps;
        p.guidance_scale = o.cal.base.guidance_scale;
        runs.push_back(p);
    }
    std::vector<std::pair<double, double>> samples;
    const auto coef = unet::sd3_teacache_calibrate(m, runs, 4, &samples);
    std::string spec;
    for (double c : coef) spec += (spec.empty() ? "" : "/") + util::fmt("%.9g", c);
    const nlohmann::json out = {{"model", o.model},
                                {"prompts", prompts},
                                {"seed", o.cal.base.seed},
                                {"steps", o.cal.base.steps},
                                {"cfg_scale", o.cal.base.guidance_scale},
                                {"samples", samples.size()},
                                {"coef", coef},
                                {"use", "--cache teacache:coef=" + spec}};
    write_file_atomic(o.out, out.dump(2) + "\n", o.overwrite);
    std::printf("teacache rescale polynomial (highest degree first) from %zu samples: %s\nwrote %s (use --cache "
                "teacache:coef=%s)\n",
                samples.size(), spec.c_str(), o.out.c_str(), spec.c_str());
    return 0;
}

int run_calibrate(CalibrateOptions& o) {
    if (o.out.empty()) throw UsageError("calibrate: -o PROFILE.json is required");
    check_output_path(o.out, o.overwrite);
    if (unet::is_sd3_model(o.model)) return run_calibrate_sd3(o, read_prompts_file(o.prompts, o.max_prompts));
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

// `train-controlnet`, `eval-controlnet`, `fashion-edges`: the demo model's Canny ControlNet
// (unet/train/controlnet_train.h).
void add_controlnet_train_commands(CLI::App& app,
                                   std::vector<std::pair<CLI::App*, std::function<int()>>>& runners) {
    struct TrainCn {
        unet::train::ControlNetTrainOptions o;
        std::string preprocess = "canny:100:200";
    };
    auto tc = std::make_shared<TrainCn>();
    auto* ct = app.add_subcommand("train-controlnet", "train a Canny ControlNet for the demo model (UNet, VAE and "
                                                      "text encoder frozen; initialised from the UNet's encoder)");
    ct->fallthrough();
    tc->o.train.caption_dropout = 0.5; // Zhang et al. 2023, sec. 3.3
    tc->o.train.warmup = 50;
    tc->o.train.ema = 0.99; // a short run: an average over ~100 steps, not ~1000
    add_train_options(ct, tc->o.train, 1500, 64, 3e-4);
    ct->add_option("-m,--model", tc->o.model, "the frozen model (diffusers folder)")->capture_default_str();
    ct->add_option("--caption-dropout", tc->o.train.caption_dropout, "probability of the empty prompt")
        ->capture_default_str();
    ct->add_option("--hint-channels", tc->o.hint_channels,
                   "hint encoder widths (conditioning_embedding_out_channels; n entries downsample 2^(n-1)x)")
        ->delimiter(',')
        ->capture_default_str();
    ct->add_option("--preprocess", tc->preprocess, "edge detector of the control images (canny:LOW:HIGH)")
        ->capture_default_str();
    ct->add_option("--max-seconds", tc->o.max_seconds, "stop and save after this much training time (0 = no limit); the learning rate "
                   "then decays on the larger of the step and time fractions")
        ->capture_default_str();
    runners.emplace_back(ct, [tc]() {
        tc->o.canny = unet::ControlPreprocessSpec::parse(tc->preprocess, "--preprocess");
        return unet::train::train_controlnet(tc->o), 0;
    });

    struct EvalCn {
        unet::train::ControlFollowParams p;
        std::string preprocess = "canny:100:200";
    };
    auto ec = std::make_shared<EvalCn>();
    auto* ce = app.add_subcommand("eval-controlnet", "does a ControlNet steer? Canny edges of images generated with "
                                                     "and without it against the control edges (held-out test set)");
    ce->fallthrough();
    ce->add_option("-m,--model", ec->p.model, "model folder")->capture_default_str();
    ce->add_option("--control-net", ec->p.controlnet, "the ControlNet (folder or file)")->required();
    ce->add_option("--data", ec->p.data_dir, "folder with the Fashion-MNIST IDX files")->capture_default_str();
    ce->add_option("--images", ec->p.images, "test-set images (the first of each class, in class order)")
        ->capture_default_str();
    ce->add_option("--steps", ec->p.steps, "sampling steps")->capture_default_str();
    ce->add_option("--cfg-scale", ec->p.cfg, "guidance scale")->capture_default_str();
    ce->add_option("--control-scale", ec->p.scale, "ControlNet conditioning scale")->capture_default_str();
    add_enum_option(*ce, "--sampler", ec->p.sampler, unet::sampler_table(), "sampler");
    ce->add_option("-s,--seed", ec->p.seed, "seed of the batch")->capture_default_str();
    ce->add_option("--preprocess", ec->preprocess, "edge detector (canny:LOW:HIGH)")->capture_default_str();
    ce->add_option("--sheet", ec->p.sheet, "PNG: one column per image, rows control / with / without");
    ce->add_flag("--overwrite", ec->p.overwrite, "replace the sheet");
    runners.emplace_back(ce, [ec]() {
        ec->p.canny = unet::ControlPreprocessSpec::parse(ec->preprocess, "--preprocess");
        const auto r = unet::train::eval_control_following(ec->p);
        std::printf("%s", r.table().c_str());
        if (!ec->p.sheet.empty()) std::printf("wrote %s\n", ec->p.sheet.c_str());
        return 0;
    });

    struct Edges {
        std::string prompt, out, data = unet::train::kFashionMnistDir, preprocess = "canny:100:200";
        int nth = 0;
        bool overwrite = false;
    };
    auto fe = std::make_shared<Edges>();
    auto* cf = app.add_subcommand("fashion-edges", "the Canny edge map of a Fashion-MNIST test image of a prompt's "
                                                   "class (a control image for the demo ControlNet)");
    cf->fallthrough();
    cf->add_option("-p,--prompt", fe->prompt, "a class prompt (\"a photo of a sneaker\")")->required();
    cf->add_option("--nth", fe->nth, "which test image of the class (0 = the first)")->capture_default_str();
    cf->add_option("--data", fe->data, "folder with the Fashion-MNIST IDX files")->capture_default_str();
    cf->add_option("--preprocess", fe->preprocess, "edge detector (canny:LOW:HIGH)")->capture_default_str();
    cf->add_option("-o,--output", fe->out, "PNG to write (32x32 RGB)")->required();
    cf->add_flag("--overwrite", fe->overwrite, "replace the PNG");
    runners.emplace_back(cf, [fe]() {
        const int label = unet::train::fashion_class_of_prompt(fe->prompt);
        if (label < 0) throw UsageError("--prompt '" + fe->prompt + "' names no Fashion-MNIST class");
        const auto spec = unet::ControlPreprocessSpec::parse(fe->preprocess, "--preprocess");
        unet::write_png(fe->out, unet::train::fashion_test_edges(fe->data, label, fe->nth, spec), fe->overwrite);
        std::printf("wrote %s\n", fe->out.c_str());
        return 0;
    });
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

    // eval-fashion (the class prompts, seeds 1000 ..) and eval-cache (prompts and seeds given) share one table.
    auto add_eval_options = [](CLI::App* c, EvalOptions& ev, bool grid) {
        c->fallthrough();
        c->add_option("-m,--model", ev.eval.model, "model folder")->capture_default_str();
        c->add_option("--classifier", ev.eval.classifier, "classifier (default: <model>/eval/classifier.safetensors)");
        c->add_option("--modes", ev.modes, "cache modes, the first is the reference")->capture_default_str();
        if (grid) {
            c->add_option("--prompts", ev.prompts_file, "prompts file, one per line")->required();
            c->add_option("--seeds", ev.seeds, "seeds, comma-separated (each gives one image per prompt)")->required();
            c->add_option("--batch", ev.eval.batch,
                          "images per run (0 = all prompts in one batch); 1 judges a per-batch decision (freq's full "
                          "steps) per image, as one user's image meets it")
                ->capture_default_str();
        } else {
            c->add_option("--seeds", ev.eval.seeds, "number of seeds from 1000 (each gives one image per class)")
                ->capture_default_str();
        }
        c->add_option("--samplers", ev.eval.samplers, "samplers of the grid")->delimiter(',')->capture_default_str();
        c->add_option("--steps", ev.eval.steps, "step counts of the grid")->delimiter(',')->capture_default_str();
        c->add_option("--repeats", ev.eval.repeats, "timed runs per seed and mode; the fastest counts")
            ->capture_default_str();
        c->add_option("--cfg-scale", ev.eval.cfg, "guidance scale")->capture_default_str();
        c->add_option("-o,--output", ev.eval.out, "output folder (default: <model>/eval)");
        c->add_flag("--overwrite", ev.eval.overwrite,
                    "replace cache_eval.json, the sample sheets and plots already in the folder");
    };
    auto ev = std::make_shared<EvalOptions>();
    auto* ce = app.add_subcommand("eval-fashion", "prompt adherence and cache speed/quality on the fashion model");
    add_eval_options(ce, *ev, false);
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
    runners.emplace_back(ce, [ev, ce, bind_eval_fields]() {
        bind_eval_fields();
        return run_eval(*ev, ce->get_option("--samplers")->count() > 0);
    });
    auto eg = std::make_shared<EvalOptions>();
    auto* cg = app.add_subcommand("eval-cache", "cache speed/quality over a prompts x seeds x samplers x steps grid: "
                                                "PSNR (mean, median, worst, share >= 30 dB), SSIM, speed-up, full "
                                                "steps, classifier adherence, speed-quality plots");
    add_eval_options(cg, *eg, true);
    runners.emplace_back(cg, [eg, cg, bind_eval_fields]() {
        bind_eval_fields();
        bind_field("samplers", "--samplers");
        bind_field("batch", "--batch");
        return run_eval(*eg, cg->get_option("--samplers")->count() > 0);
    });

    auto ep = std::make_shared<EvalPlotOptions>();
    auto* cpl = app.add_subcommand("eval-plot", "redraw the speed-quality plots of a saved cache_eval.json, beside it");
    cpl->add_option("report", ep->report, "cache_eval.json written by eval-cache or eval-fashion")
        ->required()
        ->check(CLI::ExistingFile);
    cpl->add_flag("--overwrite", ep->overwrite, "replace the plots already beside the report");
    runners.emplace_back(cpl, [ep]() { return run_eval_plot(*ep); });

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

    add_controlnet_train_commands(app, runners);
}

} // namespace anchor::cli
