// `anchor-sd train-vae | train-unet | train-classifier | eval-fashion`: the Fashion-MNIST demo model
// (unet/train/sd_train.h) and its evaluation with the real caches.
#include "cli/sd_train.h"

#include "cache/calibration.h"
#include "cache/io/atomic_file.h"
#include "cache/io/error.h"
#include "cache/metrics.h"
#include "cache/util/bench.h"
#include "cli/common.h"
#include "cli/loss_plot.h"
#include "unet/checkpoint.h"
#include "unet/freq_cache.h"
#include "unet/pipeline.h"
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
    std::string model = "assets/models/fashion-sd", classifier,
                modes = "off,deepcache:2,deepcache:3,deepcache:4,"
                        "deepcache:5,deepcache:6,freq:thr=0.5,freq,freq:thr=2";
    std::string out;
    int seeds = 4, steps = 20, repeats = 1;
    double cfg = 5.0;
    bool overwrite = false;
};

// Generates one image per class and seed for every mode (batched: the 10 class prompts in one pipeline run per seed)
// and reports prompt adherence (classifier), PSNR/SSIM vs the first mode and wall time.
// Timing on a shared 2-core VM: the modes are interleaved per seed (off, A, B, ... for seed 1, then seed 2, ...), so a
// slow period of the machine hits every mode alike instead of one whole mode; with --repeats R each (seed, mode) run
// is timed R times and the fastest counts (the work is deterministic: the spread is the machine's, not the code's).
int run_eval(const EvalOptions& o) {
    const auto modes = unet::split_mode_list(o.modes);
    if (o.seeds < 1) throw UsageError("eval-fashion: --seeds must be >= 1");
    if (o.repeats < 1) throw UsageError("eval-fashion: --repeats must be >= 1");
    // Every output is known before the first image: refuse existing ones now, not after minutes of generation.
    const fs::path out = o.out.empty() ? fs::path(o.model) / "eval" : fs::path(o.out);
    fs::create_directories(out);
    const std::string report = (out / "cache_eval.json").string();
    std::vector<std::string> sheets;
    for (const auto& m : modes) {
        std::string safe = unet::parse_cache_mode(m)->spec(); // a file name of letters, digits, '.', '_' and '-'
        for (char& ch : safe)
            if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '.' && ch != '-') ch = '_';
        const std::string sheet = (out / ("samples_" + safe + ".png")).string();
        if (std::find(sheets.begin(), sheets.end(), sheet) != sheets.end())
            throw UsageError("eval-fashion: --modes lists '" + m + "' twice (as " + safe + ")");
        sheets.push_back(sheet);
        check_output_path(sheet, o.overwrite);
    }
    check_output_path(report, o.overwrite);
    const std::string cls_path =
        o.classifier.empty() ? (fs::path(o.model) / "eval" / "classifier.safetensors").string() : o.classifier;
    auto classifier = unet::train::load_fashion_classifier(cls_path);
    auto models = unet::load_sd_models(o.model);
    unet::Txt2ImgPipeline pipe(models);
    unet::Txt2ImgParams p;
    p.prompts.clear(); // the default is one empty prompt
    for (int c = 0; c < 10; ++c) p.prompts.push_back(unet::train::fashion_prompt(c, 0));
    p.steps = o.steps;
    p.sampler = unet::SamplerKind::DDIM;
    p.guidance_scale = o.cfg;
    p = pipe.resolved(p);
    pipe.run(p); // warm-up

    struct ModeResult {
        std::string spec;
        std::vector<double> wall; // per seed: fastest of the repeats
        double full_ms = 0, reuse_ms = 0; // controller time of full / reuse steps (UNet + probe), fastest repeats
        int full_n = 0, reuse_n = 0;
        double psnr_sum = 0, ssim_sum = 0;
        int psnr_n = 0, correct = 0, full = 0, total = 0;
        std::vector<torch::Tensor> tiles;
    };
    std::vector<ModeResult> res(modes.size());
    std::vector<std::vector<torch::Tensor>> ref(size_t(o.seeds)); // first-mode images per seed
    for (int s = 0; s < o.seeds; ++s) {
        p.seed = 1000 + s;
        for (size_t k = 0; k < modes.size(); ++k) {
            auto& m = res[k];
            unet::Txt2ImgResult r;
            double best = INFINITY;
            std::vector<unet::CacheStepLog> best_log;
            for (int rep = 0; rep < o.repeats; ++rep) {
                auto ctl = unet::parse_cache_mode(modes[k]);
                m.spec = ctl->spec();
                r = pipe.run(p, ctl.get());
                if (r.denoise_s < best) best = r.denoise_s, best_log = ctl->log();
            }
            m.wall.push_back(best);
            for (const auto& st : best_log) {
                (st.full ? m.full_ms : m.reuse_ms) += st.ms;
                ++(st.full ? m.full_n : m.reuse_n);
            }
            m.full += r.full_steps, m.total += r.total_steps;
            {
                c10::InferenceMode im;
                auto pred = classifier->forward(unet::train::rgb_to_classifier_input(r.image, true)).argmax(1);
                m.correct += (pred == torch::arange(10)).sum().item<int>();
            }
            for (int c = 0; c < 10; ++c) {
                auto img = r.image[c].permute({1, 2, 0}).contiguous();
                if (k == 0) ref[size_t(s)].push_back(img);
                const double ps = cache::psnr(img, ref[size_t(s)][size_t(c)], 1.0);
                if (!std::isinf(ps)) m.psnr_sum += ps, ++m.psnr_n;
                m.ssim_sum += cache::ssim(img, ref[size_t(s)][size_t(c)], 1.0);
            }
            m.tiles.push_back(r.image_uint8); // [10, H, W, 3]
        }
    }

    nlohmann::json rep = {{"model", o.model},
                          {"classifier", cls_path},
                          {"steps", o.steps},
                          {"sampler", "ddim"},
                          {"cfg_scale", o.cfg},
                          {"seeds", o.seeds},
                          {"repeats", o.repeats},
                          {"timing", "modes interleaved per seed; per (seed, mode) the fastest of the repeats"},
                          {"images_per_mode", 10 * o.seeds},
                          {"modes", nlohmann::json::array()}};
    std::printf("%-58s %6s %9s %9s %10s %8s %10s %8s %8s\n", "mode", "full", "wall s", "speed-up", "PSNR", "SSIM",
                "adherence", "full ms", "reuse ms");
    auto sum = [](const std::vector<double>& v) { return std::accumulate(v.begin(), v.end(), 0.0); };
    const double wall0 = sum(res[0].wall);
    for (size_t k = 0; k < res.size(); ++k) {
        const auto& m = res[k];
        const double wall = sum(m.wall);
        const double psnr = m.psnr_n ? m.psnr_sum / m.psnr_n : INFINITY, ssim = m.ssim_sum / (10.0 * o.seeds);
        const double adherence = double(m.correct) / (10.0 * o.seeds);
        const double full_ms = m.full_n ? m.full_ms / m.full_n : 0, reuse_ms = m.reuse_n ? m.reuse_ms / m.reuse_n : 0;
        std::printf("%-58s %3d/%-3d %8.3f %8.2fx %10s %8.4f %9.1f%% %8.2f %8s\n", m.spec.c_str(), m.full, m.total, wall,
                    wall0 / wall, std::isinf(psnr) ? "inf" : fmt("%.2f dB", psnr).c_str(), ssim, 100 * adherence,
                    full_ms, m.reuse_n ? fmt("%.2f", reuse_ms).c_str() : "-");
        // Sample sheet: one row per seed, one column per class.
        std::vector<torch::Tensor> rows;
        for (auto& t : m.tiles) rows.push_back(torch::cat(t.unbind(0), 1));
        const std::string& sheet = sheets[k];
        unet::write_png(sheet, torch::cat(rows, 0), o.overwrite);
        rep["modes"].push_back({{"mode", m.spec},
                                {"full_steps", m.full},
                                {"total_steps", m.total},
                                {"wall_s", wall},
                                {"wall_s_per_seed", m.wall},
                                {"speedup_vs_first", wall0 / wall},
                                {"full_step_ms", full_ms},
                                {"reuse_step_ms", reuse_ms},
                                {"psnr_db", std::isinf(psnr) ? nlohmann::json("inf") : nlohmann::json(psnr)},
                                {"ssim", ssim},
                                {"classifier_adherence", adherence},
                                {"samples", sheet}});
    }
    std::fflush(stdout);
    write_file_atomic(report, rep.dump(2) + "\n", o.overwrite);
    std::printf("wrote %s\n", report.c_str());
    return 0;
}

struct CalibrateOptions {
    std::string model, prompts = "assets/prompts/sd_bench.txt", out, sampler = "ddim";
    int max_prompts = 8, steps = 20, ranges = 4;
    double cfg = 7.5, target = 3.0;
    int64_t seed = 0;
    bool overwrite = false;
};

// Uncached generations; the mean per-step low-band energy change r_k of the shallow probe (freq_cache.h, rule 1)
// over the prompts; thresholds per range of steps = target x mean r_k in the range, i.e. a full step after about
// `target` steps of typical change for that part of the trajectory. r_k falls by ~10x from the first to the last
// steps, so one fixed threshold reuses little early and too much late; the profile evens that out.
int run_calibrate(const CalibrateOptions& o) {
    if (o.ranges < 1 || o.steps < 2 || !(o.target > 0))
        throw UsageError("calibrate: --ranges >= 1, --steps >= 2, --target > 0");
    if (o.out.empty()) throw UsageError("calibrate: -o PROFILE.json is required");
    check_output_path(o.out, o.overwrite);
    const auto prompts = read_prompts_file(o.prompts, o.max_prompts);
    auto models = unet::load_sd_models(o.model);
    unet::Txt2ImgPipeline pipe(models);
    unet::Txt2ImgParams p;
    p.steps = o.steps;
    p.sampler = unet::sampler_from_string(o.sampler);
    p.guidance_scale = o.cfg;
    p = pipe.resolved(p);
    std::vector<double> mean;
    for (size_t i = 0; i < prompts.size(); ++i) {
        p.prompts = {prompts[i]};
        p.seed = o.seed + int64_t(i);
        auto ctl = unet::parse_cache_mode("off");
        pipe.run(p, ctl.get());
        const auto& log = ctl->log();
        mean.resize(log.size(), 0.0);
        for (size_t k = 0; k < log.size(); ++k) mean[k] += log[k].energy_change / double(prompts.size());
        std::fprintf(stderr, "calibrate: %zu/%zu \"%s\"\n", i + 1, prompts.size(), prompts[i].c_str());
    }
    auto profile = cache::build_step_profile(mean, o.ranges, o.target);
    profile.meta = {{"written_by", "anchor-sd calibrate"},
                    {"model", o.model},
                    {"steps", o.steps},
                    {"sampler", o.sampler},
                    {"cfg_scale", o.cfg},
                    {"prompts", prompts.size()},
                    {"target_steps_of_change", o.target},
                    {"mean_energy_change_per_step", mean},
                    {"use", "--cache freq:profile=" + o.out}};
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
    ce->add_option("-m,--model", ev->model, "model folder")->capture_default_str();
    ce->add_option("--classifier", ev->classifier, "classifier (default: <model>/eval/classifier.safetensors)");
    ce->add_option("--modes", ev->modes, "cache modes, the first is the reference")->capture_default_str();
    ce->add_option("--seeds", ev->seeds, "seeds (each gives one image per class)")->capture_default_str();
    ce->add_option("--steps", ev->steps, "DDIM steps")->capture_default_str();
    ce->add_option("--repeats", ev->repeats, "timed runs per seed and mode; the fastest counts")->capture_default_str();
    ce->add_option("--cfg-scale", ev->cfg, "guidance scale")->capture_default_str();
    ce->add_option("-o,--output", ev->out, "output folder (default: <model>/eval)");
    ce->add_flag("--overwrite", ev->overwrite, "replace cache_eval.json and samples_<mode>.png already in the folder");
    runners.emplace_back(ce, [ev]() { return run_eval(*ev); });

    auto cal = std::make_shared<CalibrateOptions>();
    auto* ck = app.add_subcommand("calibrate", "measure per-step spectral change of uncached runs and write a freq "
                                               "anchor profile (--cache freq:profile=FILE)");
    ck->fallthrough();
    ck->add_option("-m,--model", cal->model, "model (default: the embedded one)");
    ck->add_option("--prompts", cal->prompts, "prompt file, one per line")->capture_default_str();
    ck->add_option("--max-prompts", cal->max_prompts, "use at most this many prompts")->capture_default_str();
    ck->add_option("--steps", cal->steps, "sampling steps (the profile is in fractions of the loop)")
        ->capture_default_str();
    ck->add_option("--sampler", cal->sampler, "sampler")->capture_default_str();
    ck->add_option("--cfg-scale", cal->cfg, "guidance scale")->capture_default_str();
    ck->add_option("--ranges", cal->ranges, "number of equal step ranges")->capture_default_str();
    ck->add_option("--target", cal->target, "full step after about this many steps of typical change")
        ->capture_default_str();
    ck->add_option("-s,--seed", cal->seed, "first seed")->capture_default_str();
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
