#include "unet/train/fashion_eval.h"

#include "cache/io/atomic_file.h"
#include "cache/io/error.h"
#include "cache/metrics.h"
#include "cache/util/bench.h"
#include "unet/checkpoint.h"
#include "unet/freq_cache.h"
#include "unet/pipeline.h"
#include "unet/train/fashion_mnist.h"
#include "unet/train/sd_train.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <numeric>

namespace anchor::unet::train {

namespace fs = std::filesystem;
using util::fmt;

void FashionEvalParams::validate() const {
    if (modes.empty()) throw ParamError("modes", "no cache mode");
    for (const auto& m : modes) (void)parse_cache_mode(m);
    if (seeds < 1) throw ParamError("seeds", "must be >= 1");
    if (repeats < 1) throw ParamError("repeats", "must be >= 1");
}

std::string FashionEvalReport::table() const {
    char line[512];
    std::snprintf(line, sizeof line, "%-58s %6s %9s %9s %10s %8s %10s %8s %8s\n", "mode", "full", "wall s", "speed-up",
                  "PSNR", "SSIM", "adherence", "full ms", "reuse ms");
    std::string out = line;
    for (const auto& m : report["modes"]) {
        const auto& ps = m["psnr_db"];
        const std::string psnr = ps.is_number() ? fmt("%.2f dB", ps.get<double>()) : std::string("inf");
        const double reuse = m["reuse_step_ms"].get<double>();
        std::snprintf(line, sizeof line, "%-58s %3d/%-3d %8.3f %8.2fx %10s %8.4f %9.1f%% %8.2f %8s\n",
                      m["mode"].get<std::string>().c_str(), m["full_steps"].get<int>(), m["total_steps"].get<int>(),
                      m["wall_s"].get<double>(), m["speedup_vs_first"].get<double>(), psnr.c_str(),
                      m["ssim"].get<double>(), 100 * m["classifier_adherence"].get<double>(),
                      m["full_step_ms"].get<double>(), reuse > 0 ? fmt("%.2f", reuse).c_str() : "-");
        out += line;
    }
    return out;
}

FashionEvalReport run_fashion_eval(const FashionEvalParams& o) {
    o.validate();
    const auto& modes = o.modes;
    // Every output is known before the first image: refuse existing ones now, not after minutes of generation.
    const fs::path out = o.out.empty() ? fs::path(o.model) / "eval" : fs::path(o.out);
    fs::create_directories(out);
    const std::string report = (out / "cache_eval.json").string();
    std::vector<std::string> sheets;
    for (const auto& m : modes) {
        std::string safe = parse_cache_mode(m)->spec(); // a file name of letters, digits, '.', '_' and '-'
        for (char& ch : safe)
            if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '.' && ch != '-') ch = '_';
        const std::string sheet = (out / ("samples_" + safe + ".png")).string();
        if (std::find(sheets.begin(), sheets.end(), sheet) != sheets.end())
            throw ParamError("modes", "lists '" + m + "' twice (as " + safe + ")");
        sheets.push_back(sheet);
        check_output_path(sheet, o.overwrite);
    }
    check_output_path(report, o.overwrite);
    const std::string cls_path =
        o.classifier.empty() ? (fs::path(o.model) / "eval" / "classifier.safetensors").string() : o.classifier;
    auto classifier = load_fashion_classifier(cls_path);
    auto models = load_sd_models(o.model);
    Txt2ImgPipeline pipe(models);
    Txt2ImgParams p;
    p.prompts.clear(); // the default is one empty prompt
    for (int c = 0; c < 10; ++c) p.prompts.push_back(fashion_prompt(c, 0));
    p.steps = o.steps;
    p.sampler = SamplerKind::DDIM;
    p.guidance_scale = o.cfg;
    p = pipe.resolved(p);
    pipe.run(p); // warm-up

    struct ModeResult {
        std::string spec;
        std::vector<double> wall;         // per seed: fastest of the repeats
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
            Txt2ImgResult r;
            double best = INFINITY;
            std::vector<CacheStepLog> best_log;
            for (int rep = 0; rep < o.repeats; ++rep) {
                auto ctl = parse_cache_mode(modes[k]);
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
                auto pred = classifier->forward(rgb_to_classifier_input(r.image, true)).argmax(1);
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
    auto sum = [](const std::vector<double>& v) { return std::accumulate(v.begin(), v.end(), 0.0); };
    const double wall0 = sum(res[0].wall);
    for (size_t k = 0; k < res.size(); ++k) {
        const auto& m = res[k];
        const double wall = sum(m.wall);
        const double psnr = m.psnr_n ? m.psnr_sum / m.psnr_n : INFINITY, ssim = m.ssim_sum / (10.0 * o.seeds);
        const double adherence = double(m.correct) / (10.0 * o.seeds);
        const double full_ms = m.full_n ? m.full_ms / m.full_n : 0, reuse_ms = m.reuse_n ? m.reuse_ms / m.reuse_n : 0;
        // Sample sheet: one row per seed, one column per class.
        std::vector<torch::Tensor> rows;
        for (auto& t : m.tiles) rows.push_back(torch::cat(t.unbind(0), 1));
        const std::string& sheet = sheets[k];
        write_png(sheet, torch::cat(rows, 0), o.overwrite);
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
    write_file_atomic(report, rep.dump(2) + "\n", o.overwrite);
    return {rep, report};
}

} // namespace anchor::unet::train
