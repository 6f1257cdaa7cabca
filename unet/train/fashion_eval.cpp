#include "unet/train/fashion_eval.h"

#include "cache/io/atomic_file.h"
#include "cache/io/error.h"
#include "cache/metrics.h"
#include "cache/util/bench.h"
#include "unet/model/checkpoint.h"
#include "unet/cache/dit_cache_config.h"
#include "unet/cache/freq_cache.h"
#include "unet/pipeline/pipeline.h"
#include "unet/pipeline/sd3_pipeline.h"
#include "unet/train/fashion_mnist.h"
#include "unet/train/sd_train.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <functional>
#include <memory>
#include <numeric>

namespace anchor::unet::train {

namespace fs = std::filesystem;
using util::fmt;

void FashionEvalParams::validate() const {
    if (modes.empty()) throw ParamError("modes", "no cache mode");
    if (seed_list.empty() && seeds < 1) throw ParamError("seeds", "must be >= 1");
    if (repeats < 1) throw ParamError("repeats", "must be >= 1");
    if (batch < 0)
        throw ParamError("batch", "must be >= 0 (0 = all prompts in one batch), got " + std::to_string(batch));
    if (samplers.empty()) throw ParamError("samplers", "no sampler");
    for (const auto& s : samplers) (void)sampler_from_string(s);
    if (steps.empty()) throw ParamError("steps", "no step count");
    for (int n : steps)
        if (n < 1) throw ParamError("steps", "must be >= 1, got " + std::to_string(n));
    for (const auto& pr : prompts)
        if (pr.empty()) throw ParamError("prompts", "an empty prompt");
}

namespace {

// Order statistics and the share above 30 dB of one mode's per-image PSNRs (inf: identical images).
struct PsnrStats {
    double mean = INFINITY, median = INFINITY, min = INFINITY, share30 = 1.0;
};
PsnrStats psnr_stats(std::vector<double> v) {
    PsnrStats st;
    if (v.empty()) return st;
    std::sort(v.begin(), v.end());
    st.min = v.front();
    const size_t n = v.size();
    st.median = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
    double sum = 0;
    size_t finite = 0, above = 0;
    for (double x : v) {
        if (std::isfinite(x)) sum += x, ++finite;
        above += x >= 30.0;
    }
    // The mean of the finite ones (an identical image has no finite PSNR); inf when every image is identical.
    st.mean = finite ? sum / double(finite) : INFINITY;
    st.share30 = double(above) / double(n);
    return st;
}

nlohmann::json db(double v) {
    return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json("inf");
}

std::string safe_name(std::string s) { // a file name of letters, digits, '.', '_' and '-'
    for (char& ch : s)
        if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '.' && ch != '-') ch = '_';
    return s;
}

// Full UNet steps per image and run: a whole number when every image ran alike, else the mean to one decimal.
std::string full_per_run(const nlohmann::json& m, const nlohmann::json& cell) {
    const double full = m["full_steps"].get<double>() / cell["runs"].get<int>();
    return std::abs(full - std::round(full)) < 1e-9 ? std::to_string(int(std::round(full))) : fmt("%.1f", full);
}

// Whether a report row is a DeepCache configuration: by its resolved parameters where the report has them (the label
// is what the user typed, e.g. a preset name), else by the label of an older report.
bool is_deepcache(const nlohmann::json& row) {
    const auto it = row.find("resolved");
    const std::string s = (it != row.end() ? *it : row.at("mode")).get<std::string>();
    return s == "deepcache" || s.rfind("deepcache:", 0) == 0;
}
} // namespace

std::vector<std::pair<double, double>> deepcache_frontier(const nlohmann::json& modes, const std::string& measure) {
    std::vector<std::pair<double, double>> dc; // (speed-up, value)
    // at(): the modes may come from a saved report (anchor-sd eval-plot), where a field can be missing.
    for (const auto& d : modes)
        if (is_deepcache(d) && d.contains(measure) && d.at(measure).is_number())
            dc.emplace_back(d.at("speedup_vs_first").get<double>(), d.at(measure).get<double>());
    std::stable_sort(dc.begin(), dc.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    std::vector<std::pair<double, double>> fr;
    for (size_t i = 0; i < dc.size(); ++i) {
        bool beaten = false; // by one at least as fast and as good; of two alike, the later one stays
        for (size_t j = 0; j < dc.size() && !beaten; ++j)
            beaten = j != i && dc[j].first >= dc[i].first && dc[j].second >= dc[i].second &&
                     (dc[j].first > dc[i].first || dc[j].second > dc[i].second || j > i);
        if (!beaten) fr.push_back(dc[i]);
    }
    return fr;
}

nlohmann::json against_deepcache(const nlohmann::json& modes, const nlohmann::json& m) {
    std::vector<double> dc; // the speed-ups of the configurations measured in both
    for (const auto& d : modes)
        if (is_deepcache(d) && d["psnr_db"].is_number() && d["psnr_min_db"].is_number())
            dc.push_back(d["speedup_vs_first"].get<double>());
    if (dc.empty() || is_deepcache(m) || !m["psnr_db"].is_number() || !m["psnr_min_db"].is_number()) return nullptr;
    std::sort(dc.begin(), dc.end());
    const double s = m["speedup_vs_first"].get<double>();
    // DeepCache's curve in one measure: its frontier, linear between the two configurations that bracket s; below the
    // slowest, the slowest (its best); above the fastest, the fastest (DeepCache only loses quality as it speeds up).
    // A configuration beaten by a faster one (a deeper branch, say) does not pull the curve down.
    auto curve_at = [&](const char* measure) {
        const auto fr = deepcache_frontier(modes, measure);
        if (s <= fr.front().first) return fr.front().second;
        for (size_t i = 0; i + 1 < fr.size(); ++i)
            if (s <= fr[i + 1].first)
                return fr[i].second +
                       (s - fr[i].first) / (fr[i + 1].first - fr[i].first) * (fr[i + 1].second - fr[i].second);
        return fr.back().second;
    };
    const double dc_mean = curve_at("psnr_db"), dc_min = curve_at("psnr_min_db");
    const bool faster = s > dc.back(), slower = s < dc.front();
    const std::string basis =
        faster   ? "faster than deepcache's fastest configuration (" + fmt("%.2fx", dc.back()) + "): set against it"
        : slower ? "slower than deepcache's slowest configuration (" + fmt("%.2fx", dc.front()) +
                       "): set against its best configuration"
                 : "its best configurations, linear between the two that bracket it";
    const double mean = m["psnr_db"].get<double>(), min = m["psnr_min_db"].get<double>();
    const bool beats = mean > dc_mean && min > dc_min;
    // Faster and worse, or slower and better: DeepCache at the same speed-up is not in the grid.
    const char* verdict = beats ? (slower ? "open" : "beats") : (faster ? "open" : "loses");
    return {{"deepcache_psnr_db", dc_mean},
            {"deepcache_psnr_min_db", dc_min},
            {"mean_margin_db", mean - dc_mean},
            {"worst_margin_db", min - dc_min},
            {"verdict", verdict},
            {"basis", basis}};
}

std::string FashionEvalReport::table() const {
    char line[640];
    std::snprintf(line, sizeof line, "%-9s %5s %-66s %9s %8s %9s %9s %9s %6s %7s %9s %8s %8s\n", "sampler", "steps",
                  "mode", "full", "speed-up", "PSNR mean", "median", "min", ">=30dB", "SSIM", "adherence", "full ms",
                  "reuse ms");
    std::string out = line;
    auto dbs = [](const nlohmann::json& v) {
        return v.is_number() ? fmt("%.2f", v.get<double>()) : std::string("inf");
    };
    for (const auto& c : report["cells"])
        for (const auto& m : c["modes"]) {
            const double reuse = m["reuse_step_ms"].get<double>();
            const auto& ad = m["classifier_adherence"];
            std::snprintf(line, sizeof line, "%-9s %5d %-66s %5s/%-3d %7.2fx %9s %9s %9s %5.0f%% %7.4f %9s %8.2f %8s\n",
                          c["sampler"].get<std::string>().c_str(), c["steps"].get<int>(),
                          m["mode"].get<std::string>().c_str(), full_per_run(m, c).c_str(),
                          m["total_steps"].get<int>() / c["runs"].get<int>(), m["speedup_vs_first"].get<double>(),
                          dbs(m["psnr_db"]).c_str(), dbs(m["psnr_median_db"]).c_str(), dbs(m["psnr_min_db"]).c_str(),
                          100 * m["share_psnr_30db"].get<double>(), m["ssim"].get<double>(),
                          ad.is_number() ? fmt("%.1f%%", 100 * ad.get<double>()).c_str() : "-",
                          m["full_step_ms"].get<double>(), reuse > 0 ? fmt("%.2f", reuse).c_str() : "-");
            out += line;
        }
    bool header = false;
    for (const auto& c : report["cells"])
        for (const auto& m : c["modes"]) {
            if (!m.contains("vs_deepcache") || m["vs_deepcache"].is_null()) continue;
            if (!header)
                out += "\nagainst deepcache at the same speed-up (the best of its configurations in the grid there, "
                       "mean and worst image; margin > 0: better; open: no configuration of the grid is that fast "
                       "(slow) and the fastest is not beaten (the best is beaten))\n";
            header = true;
            const auto& v = m["vs_deepcache"];
            std::snprintf(line, sizeof line, "%-9s %5d %-66s %7.2fx  mean %+6.2f dB  worst %+6.2f dB  %-5s %s\n",
                          c["sampler"].get<std::string>().c_str(), c["steps"].get<int>(),
                          m["mode"].get<std::string>().c_str(), m["speedup_vs_first"].get<double>(),
                          v["mean_margin_db"].get<double>(), v["worst_margin_db"].get<double>(),
                          v["verdict"].get<std::string>().c_str(), v["basis"].get<std::string>().c_str());
            out += line;
        }
    return out;
}

namespace {

// One pipeline run of an eval cell: the images, the denoising wall time and the cache's per-step log.
struct FashionEvalRun {
    torch::Tensor image, image_uint8; // [B, 3, H, W] in [0, 1]; [B, H, W, 3] uint8
    double denoise_s = 0;
    std::vector<CacheStepLog> log;
    double full_steps = 0; // the pipeline's count, used when the log is empty
    int total_steps = 0;
    std::string spec; // the mode's canonical string
};
using FashionEvalRunner = std::function<FashionEvalRun(const std::vector<std::string>&, int64_t, const std::string&,
                                                       int, const CacheConfig&)>;

FashionEvalRunner make_sd_eval_runner(const FashionEvalParams& o) {
    auto models = std::make_shared<SDModels>(load_sd_models(o.model));
    auto pipe = std::make_shared<Txt2ImgPipeline>(*models);
    return [models, pipe, cfg = o.cfg](const std::vector<std::string>& prompts, int64_t seed,
                                       const std::string& sampler, int steps, const CacheConfig& mode) {
        Txt2ImgParams p;
        p.prompts = prompts;
        p.seed = seed;
        p.steps = steps;
        p.sampler = sampler_from_string(sampler);
        p.guidance_scale = cfg;
        p = pipe->resolved(p);
        auto ctl = make_cache_controller(mode);
        const auto r = pipe->run(p, ctl.get());
        return FashionEvalRun{r.image, r.image_uint8, r.denoise_s, ctl->log(), double(r.full_steps), r.total_steps,
                              ctl->spec()};
    };
}

// SD 3 / 3.5 models sample with the flow-matching Euler of their scheduler config only (no sampler choice).
FashionEvalRunner make_sd3_eval_runner(const FashionEvalParams& o) {
    for (const auto& s : o.samplers)
        if (sampler_from_string(s) != SamplerKind::FlowMatchEuler)
            throw ParamError("samplers", "'" + o.model + "' is an SD 3 model: it samples with flow_match_euler only, "
                                         "got '" + s + "'");
    auto models = std::make_shared<SD3Models>(load_sd3_models(o.model, torch::kFloat, true));
    return [models, cfg = o.cfg](const std::vector<std::string>& prompts, int64_t seed, const std::string&,
                                 int steps, const CacheConfig& mode) {
        SD3Txt2ImgParams p;
        p.prompts = prompts;
        p.seed = seed;
        p.steps = steps;
        p.guidance_scale = cfg;
        p.cache = mode;
        const auto r = sd3_txt2img(*models, p);
        double full = 0;
        for (const auto& st : r.cache_steps) full += st.full_share;
        return FashionEvalRun{r.image, r.image_uint8, r.denoise_s, r.cache_steps, full, steps,
                              r.cache_log.value("resolved", mode.canonical())};
    };
}

} // namespace

FashionEvalReport run_fashion_eval(const FashionEvalParams& o) {
    o.validate();
    const auto& modes = o.modes;
    std::vector<std::string> prompts = o.prompts;
    if (prompts.empty())
        for (int c = 0; c < 10; ++c) prompts.push_back(fashion_prompt(c, 0));
    std::vector<int64_t> seeds = o.seed_list;
    if (seeds.empty())
        for (int s = 0; s < o.seeds; ++s) seeds.push_back(1000 + s);
    std::vector<int> classes; // the class each prompt names (-1: none, not scored for adherence)
    for (const auto& pr : prompts) classes.push_back(fashion_class_of_prompt(pr));
    const int64_t n_img = int64_t(prompts.size());
    // The default grid (one cell: ddim, one step count) keeps the sheet names samples_<mode>.png.
    const bool one_cell = o.samplers.size() == 1 && o.steps.size() == 1;

    // Every output is known before the first image: refuse existing ones now, not after minutes of generation.
    const fs::path out = o.out.empty() ? fs::path(o.model) / "eval" : fs::path(o.out);
    fs::create_directories(out);
    const std::string report = (out / "cache_eval.json").string();
    std::vector<std::string> specs;
    for (const auto& m : modes) {
        // What runs: on SD 3 / 3.5 freq's keys over the transformer's defaults (resolve_dit_cache_config).
        const std::string spec = is_sd3_model(o.model) ? resolve_dit_cache_config(m).canonical() : m.canonical();
        if (std::find(specs.begin(), specs.end(), spec) != specs.end())
            throw ParamError("modes", "lists '" + m.label + "' twice (as " + safe_name(spec) + ")");
        specs.push_back(spec);
    }
    auto sheet_path = [&](const std::string& sampler, int steps, size_t k) {
        const std::string cell = one_cell ? "" : sampler + "_" + std::to_string(steps) + "_";
        return (out / ("samples_" + cell + safe_name(specs[k]) + ".png")).string();
    };
    for (const auto& sm : o.samplers)
        for (int st : o.steps)
            for (size_t k = 0; k < modes.size(); ++k) check_output_path(sheet_path(sm, st, k), o.overwrite);
    check_output_path(report, o.overwrite);
    const std::string cls_path =
        o.classifier.empty() ? (fs::path(o.model) / "eval" / "classifier.safetensors").string() : o.classifier;
    auto classifier = load_fashion_classifier(cls_path);
    const int64_t per_batch = o.batch > 0 ? std::min<int64_t>(o.batch, n_img) : n_img;
    // SD 1.x / 2.x / XL through Txt2ImgPipeline, SD 3 / 3.5 through sd3_txt2img (its transformer cache modes).
    const FashionEvalRunner run_mode = is_sd3_model(o.model) ? make_sd3_eval_runner(o) : make_sd_eval_runner(o);
    run_mode({prompts.begin(), prompts.begin() + per_batch}, 0, o.samplers.front(), o.steps.front(),
             CacheConfig{}); // warm-up
    struct {
        std::vector<std::string> prompts;
        int64_t seed = 0;
    } p;

    nlohmann::json rep = {{"model", o.model},
                          {"classifier", cls_path},
                          {"prompts", prompts},
                          {"seeds", seeds},
                          {"samplers", o.samplers},
                          {"steps", o.steps},
                          {"cfg_scale", o.cfg},
                          {"repeats", o.repeats},
                          {"timing", "per cell, modes interleaved per seed; per (seed, mode) the fastest of the "
                                     "repeats; speed-up = the first mode's denoising time / the mode's"},
                          {"psnr", "per image against the first mode's image of the same prompt and seed; the mean "
                                   "leaves out identical images (inf)"},
                          {"images_per_mode_and_cell", n_img * int64_t(seeds.size())},
                          {"images_per_batch", per_batch},
                          {"cells", nlohmann::json::array()}};
    struct ModeResult {
        std::string spec;
        std::vector<double> wall;         // per seed: the sum over its batches of the fastest of the repeats
        double full_ms = 0, reuse_ms = 0; // controller time of full / reuse steps (UNet + probe), fastest repeats
        int full_n = 0, reuse_n = 0;
        std::vector<double> psnr;
        double ssim_sum = 0;
        int correct = 0, scored = 0, total = 0, runs = 0;
        double full = 0; // full UNet steps per image, summed over the runs (freq decides per image)
        std::vector<torch::Tensor> tiles;
    };
    for (const auto& sampler : o.samplers)
        for (int steps : o.steps) {
            std::vector<ModeResult> res(modes.size());
            for (int64_t seed : seeds) {
                p.seed = seed;
                for (size_t k = 0; k < modes.size(); ++k) res[k].wall.push_back(0.0), res[k].tiles.emplace_back();
                // The batches of this seed, each run by every mode in turn (modes interleaved per batch).
                for (int64_t lo = 0; lo < n_img; lo += per_batch) {
                    const int64_t n = std::min(per_batch, n_img - lo);
                    p.prompts.assign(prompts.begin() + lo, prompts.begin() + lo + n);
                    std::vector<torch::Tensor> ref; // the first mode's images of this batch
                    for (size_t k = 0; k < modes.size(); ++k) {
                        auto& m = res[k];
                        FashionEvalRun r;
                        double best = INFINITY;
                        std::vector<CacheStepLog> best_log;
                        for (int rep_i = 0; rep_i < o.repeats; ++rep_i) {
                            r = run_mode(p.prompts, p.seed, sampler, steps, modes[k]);
                            m.spec = r.spec;
                            if (r.denoise_s < best) best = r.denoise_s, best_log = r.log;
                        }
                        m.wall.back() += best;
                        for (const auto& st : best_log) {
                            (st.full ? m.full_ms : m.reuse_ms) += st.ms;
                            ++(st.full ? m.full_n : m.reuse_n);
                        }
                        double full_steps = 0;
                        for (const auto& st : best_log) full_steps += st.full_share;
                        m.full += best_log.empty() ? r.full_steps : full_steps;
                        m.total += r.total_steps, ++m.runs;
                        {
                            c10::InferenceMode im;
                            auto pred = classifier->forward(rgb_to_classifier_input(r.image, true)).argmax(1);
                            for (int64_t i = 0; i < n; ++i)
                                if (classes[size_t(lo + i)] >= 0)
                                    ++m.scored, m.correct += pred[i].item<int64_t>() == classes[size_t(lo + i)];
                        }
                        for (int64_t i = 0; i < n; ++i) {
                            auto img = r.image[i].permute({1, 2, 0}).contiguous();
                            if (k == 0) ref.push_back(img);
                            m.psnr.push_back(cache::psnr(img, ref[size_t(i)], 1.0));
                            m.ssim_sum += cache::ssim(img, ref[size_t(i)], 1.0);
                        }
                        auto& tile = m.tiles.back(); // [prompts so far, H, W, 3]
                        tile = tile.defined() ? torch::cat({tile, r.image_uint8}, 0) : r.image_uint8;
                    }
                }
            }
            nlohmann::json cell = {
                {"sampler", sampler}, {"steps", steps}, {"runs", res[0].runs}, {"modes", nlohmann::json::array()}};
            auto sum = [](const std::vector<double>& v) { return std::accumulate(v.begin(), v.end(), 0.0); };
            const double wall0 = sum(res[0].wall);
            for (size_t k = 0; k < res.size(); ++k) {
                const auto& m = res[k];
                const double wall = sum(m.wall);
                const auto ps = psnr_stats(m.psnr);
                const double images = double(m.psnr.size());
                const double full_ms = m.full_n ? m.full_ms / m.full_n : 0;
                const double reuse_ms = m.reuse_n ? m.reuse_ms / m.reuse_n : 0;
                // Sample sheet: one row per seed, one column per prompt.
                std::vector<torch::Tensor> rows;
                for (auto& t : m.tiles) rows.push_back(torch::cat(t.unbind(0), 1));
                const std::string sheet = sheet_path(sampler, steps, k);
                write_png(sheet, torch::cat(rows, 0), o.overwrite);
                cell["modes"].push_back(
                    {{"mode", modes[k].label},
                     {"resolved", m.spec},
                     {"full_steps", m.full},
                     {"total_steps", m.total},
                     {"wall_s", wall},
                     {"wall_s_per_seed", m.wall},
                     {"speedup_vs_first", wall0 / wall},
                     {"full_step_ms", full_ms},
                     {"reuse_step_ms", reuse_ms},
                     {"psnr_db", db(ps.mean)},
                     {"psnr_median_db", db(ps.median)},
                     {"psnr_min_db", db(ps.min)},
                     {"share_psnr_30db", ps.share30},
                     {"psnr_per_image_db",
                      [&] {
                          nlohmann::json a = nlohmann::json::array();
                          for (double v : m.psnr) a.push_back(db(v));
                          return a;
                      }()},
                     {"ssim", images > 0 ? m.ssim_sum / images : 1.0},
                     {"classifier_adherence",
                      m.scored ? nlohmann::json(double(m.correct) / m.scored) : nlohmann::json(nullptr)},
                     {"samples", sheet}});
            }
            for (auto& m : cell["modes"]) m["vs_deepcache"] = against_deepcache(cell["modes"], m);
            rep["cells"].push_back(cell);
        }
    write_file_atomic(report, rep.dump(2) + "\n", o.overwrite);
    return {rep, report};
}

} // namespace anchor::unet::train
