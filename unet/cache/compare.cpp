// Side-by-side compare of cache modes (see compare.h).
#include "unet/cache/compare.h"

#include "cache/io/atomic_file.h"
#include "cache/io/error.h"
#include "cache/metrics.h"
#include "unet/pipeline/txt2img_job.h"

#if ANCHOR_HAVE_OPENCV
#include <opencv2/core.hpp>
#include <opencv2/imgcodecs.hpp>
#include <opencv2/imgproc.hpp>
#else
#define STB_IMAGE_WRITE_STATIC // own private copy, as unet/pipeline/pipeline.cpp has
#define STB_IMAGE_WRITE_IMPLEMENTATION
#include <stb_image_write.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace anchor::unet {

namespace {

std::string fmt(const char* f, double v) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), f, v);
    return buf;
}

#if ANCHOR_HAVE_OPENCV
std::string encode_png(const cv::Mat& m) {
    std::vector<uchar> buf;
    if (!cv::imencode(".png", m, buf)) throw Error("cannot encode PNG");
    return std::string(buf.begin(), buf.end());
}

cv::Mat to_bgr(const torch::Tensor& hwc) {
    auto img = hwc.to(torch::kUInt8).contiguous();
    if (img.dim() != 3 || img.size(2) != 3) throw Error("compare: expected an [H, W, 3] image");
    cv::Mat rgb(int(img.size(0)), int(img.size(1)), CV_8UC3, img.data_ptr<uint8_t>());
    cv::Mat bgr;
    cv::cvtColor(rgb, bgr, cv::COLOR_RGB2BGR);
    return bgr;
}

void put(cv::Mat& m, const std::string& s, int x, int y, double scale = 0.45, cv::Scalar c = {20, 20, 20}) {
    cv::putText(m, s, {x, y}, cv::FONT_HERSHEY_SIMPLEX, scale, c, 1, cv::LINE_AA);
}

#else
// Builds without OpenCV (e.g. the GPU machine of kernels/device-check.sh): unlabelled figures through stb.
std::string encode_png_rgb(const torch::Tensor& hwc) {
    auto img = hwc.to(torch::kUInt8).contiguous();
    std::string out;
    auto sink = [](void* ctx, void* data, int size) {
        static_cast<std::string*>(ctx)->append((const char*)data, size);
    };
    if (!stbi_write_png_to_func(sink, &out, int(img.size(1)), int(img.size(0)), 3, img.data_ptr<uint8_t>(),
                                int(img.size(1)) * 3))
        throw Error("cannot encode PNG");
    return out;
}
#endif

} // namespace

std::vector<CompareFigures> compare_figures(const std::vector<CompareEntry>& e) {
    std::vector<CompareFigures> out(e.size());
    if (e.empty()) return out;
    auto ref = e[0].image_uint8.to(torch::kFloat);
    for (size_t i = 0; i < e.size(); ++i) {
        auto img = e[i].image_uint8.to(torch::kFloat);
        out[i].speedup = e[i].wall_s > 0 ? e[0].wall_s / e[i].wall_s : 0.0;
        out[i].psnr = cache::psnr(img, ref, 255.0);
        const bool fits = img.size(0) >= 11 && img.size(1) >= 11;
        out[i].ssim = fits ? cache::ssim(img, ref, 255.0) : std::nan("");
    }
    return out;
}

#if ANCHOR_HAVE_OPENCV
std::string render_compare_grid(const std::vector<CompareEntry>& e, const std::vector<CompareFigures>& f) {
    if (e.empty()) throw Error("compare: no entries");
    const int h0 = int(e[0].image_uint8.size(0)), w0 = int(e[0].image_uint8.size(1));
    // Integer nearest-neighbour upscale so the tile is at least 256 px wide (labels need ~250 px).
    const int scale = std::max(1, (256 + w0 - 1) / w0);
    // A mode's spec in lines of 32 characters (a full freq spec takes four), the figures under it.
    constexpr size_t kLabelChars = 32;
    size_t mode_lines = 1;
    for (const auto& m : e) mode_lines = std::max(mode_lines, (m.mode.size() + kLabelChars - 1) / kLabelChars);
    const int tw = std::max(w0 * scale, 260), th = h0 * scale, label_h = 77 + 15 * int(mode_lines), pad = 8;
    const int cols = int(std::min<size_t>(e.size(), 4)), rows = int((e.size() + 3) / 4);
    cv::Mat grid(rows * (th + label_h + pad) + pad, cols * (tw + pad) + pad, CV_8UC3, cv::Scalar(255, 255, 255));
    for (size_t i = 0; i < e.size(); ++i) {
        const int x = pad + int(i % 4) * (tw + pad), y = pad + int(i / 4) * (th + label_h + pad);
        cv::Mat img = to_bgr(e[i].image_uint8), big;
        cv::resize(img, big, {img.cols * scale, img.rows * scale}, 0, 0, cv::INTER_NEAREST);
        big.copyTo(grid(cv::Rect(x, y, big.cols, big.rows)));
        int ly = y + th + 1;
        for (size_t c = 0; c == 0 || c < e[i].mode.size(); c += kLabelChars)
            put(grid, e[i].mode.substr(c, kLabelChars), x, ly += 15, 0.4, {0, 0, 0});
        int full = 0;
        for (const auto& s : e[i].steps) full += s.full ? 1 : 0;
        put(grid,
            fmt("%.2fs", e[i].wall_s) + "  x" + fmt("%.2f", f[i].speedup) + "  full " + std::to_string(full) + "/" +
                std::to_string(e[i].steps.size()),
            x, ly += 17);
        const std::string p = std::isinf(f[i].psnr) ? "PSNR inf" : "PSNR " + fmt("%.2f dB", f[i].psnr);
        put(grid, p + "  SSIM " + fmt("%.4f", f[i].ssim), x, ly += 17);
        if (i == 0) put(grid, "(reference)", x, ly += 17, 0.4, {90, 90, 90});
    }
    return encode_png(grid);
}

std::string render_timeline(const std::vector<CompareEntry>& e) {
    if (e.empty()) throw Error("compare: no entries");
    size_t n = 0;
    double emax = 0;
    for (const auto& m : e) {
        n = std::max(n, m.steps.size());
        for (const auto& s : m.steps) emax = std::max(emax, s.energy_change);
    }
    const int left = 230, cell = std::max(8, std::min(28, int(900 / std::max<size_t>(n, 1)))), row_h = 70, top = 30;
    const int W = left + int(n) * cell + 20, H = top + int(e.size()) * row_h + 40;
    cv::Mat m(H, W, CV_8UC3, cv::Scalar(255, 255, 255));
    put(m, "bar: low-band DCT energy change of conv_in(x) (max " + fmt("%.3g", emax) + ")", 8, 18, 0.42);
    put(m, "full", W - 230, 18, 0.42, {0, 110, 230});
    put(m, "reuse", W - 180, 18, 0.42, {200, 120, 40});
    put(m, "forecast", W - 120, 18, 0.42, {230, 190, 140});
    for (size_t r = 0; r < e.size(); ++r) {
        const int y0 = top + int(r) * row_h, base = y0 + row_h - 12;
        put(m, e[r].mode.substr(0, 30), 6, y0 + 22, 0.42, {0, 0, 0});
        for (size_t c = 30, line = 1; c < e[r].mode.size() && line < 4; c += 30, ++line)
            put(m, e[r].mode.substr(c, 30), 6, y0 + 22 + 14 * int(line), 0.38, {0, 0, 0});
        cv::line(m, {left, base}, {left + int(n) * cell, base}, {160, 160, 160});
        for (const auto& s : e[r].steps) {
            const int x = left + s.step * cell;
            const int hbar = emax > 0 ? int(std::lround((row_h - 22) * s.energy_change / emax)) : 0;
            // Light blue: a reuse step that ran no UNet layer (freq skip=N, the output forecast).
            const cv::Scalar col = s.full       ? cv::Scalar(0, 110, 230)
                                   : s.forecast ? cv::Scalar(230, 190, 140)
                                                : cv::Scalar(200, 120, 40);
            cv::rectangle(m, cv::Rect(x + 1, base - std::max(hbar, 2), cell - 2, std::max(hbar, 2)), col, cv::FILLED);
            // A marker under the axis: filled square = full, outline = reuse.
            cv::rectangle(m, cv::Rect(x + 2, base + 3, cell - 4, 6), col, s.full ? cv::FILLED : 1);
        }
    }
    const int ya = top + int(e.size()) * row_h + 22;
    const int every = n > 30 ? 10 : 5;
    for (size_t k = 0; k < n; k += size_t(every)) put(m, std::to_string(k), left + int(k) * cell, ya, 0.38);
    put(m, "step", 6, ya, 0.38);
    return encode_png(m);
}

#else
std::string render_compare_grid(const std::vector<CompareEntry>& e, const std::vector<CompareFigures>&) {
    if (e.empty()) throw Error("compare: no entries");
    std::vector<torch::Tensor> tiles;
    for (const auto& x : e)
        tiles.push_back(x.image_uint8), tiles.push_back(torch::full({x.image_uint8.size(0), 4, 3}, 255, torch::kUInt8));
    tiles.pop_back();
    return encode_png_rgb(torch::cat(tiles, 1)); // labels need OpenCV: the figures are in the JSON report
}

std::string render_timeline(const std::vector<CompareEntry>& e) {
    if (e.empty()) throw Error("compare: no entries");
    size_t n = 1;
    for (const auto& m : e) n = std::max(n, m.steps.size());
    const int cell = 12, row_h = 40;
    auto img = torch::full({int64_t(e.size()) * row_h, int64_t(n) * cell, 3}, 255, torch::kUInt8);
    for (size_t r = 0; r < e.size(); ++r)
        for (const auto& s : e[r].steps) { // orange = full, blue = reuse, as in the OpenCV figure
            auto bar = img.narrow(0, int64_t(r) * row_h + 4, row_h - 8).narrow(1, int64_t(s.step) * cell + 1, cell - 2);
            bar.copy_(torch::tensor(s.full ? std::vector<int64_t>{230, 110, 0} : std::vector<int64_t>{40, 120, 200})
                          .to(torch::kUInt8)
                          .view({1, 1, 3})
                          .expand_as(bar));
        }
    return encode_png_rgb(img);
}
#endif

std::vector<std::string> compare_output_paths(const std::string& base) {
    return {base + ".png", base + "_timeline.png", base + "_report.json"}; // the grid is the -o image itself
}

nlohmann::json compare_report(const std::vector<CompareEntry>& e, const nlohmann::json& meta) {
    const auto figs = compare_figures(e);
    nlohmann::json rep = meta;
    rep["reference_mode"] = e.empty() ? "" : e[0].mode;
    nlohmann::json modes = nlohmann::json::array();
    for (size_t i = 0; i < e.size(); ++i) {
        nlohmann::json m = e[i].log;
        m["mode"] = e[i].mode;
        m["wall_s"] = e[i].wall_s;
        m["speedup_vs_first"] = figs[i].speedup;
        // JSON has no infinity: an image identical to the first has no finite PSNR.
        m["psnr_vs_first_db"] = std::isinf(figs[i].psnr) ? nlohmann::json(nullptr) : nlohmann::json(figs[i].psnr);
        m["identical_to_first"] = std::isinf(figs[i].psnr);
        m["ssim_vs_first"] = std::isnan(figs[i].ssim) ? nlohmann::json(nullptr) : nlohmann::json(figs[i].ssim);
        modes.push_back(m);
    }
    rep["modes"] = modes;
    return rep;
}

nlohmann::json write_compare(const std::vector<CompareEntry>& e, const std::string& base, const nlohmann::json& meta,
                             bool overwrite) {
    const auto paths = compare_output_paths(base);
    for (const auto& p : paths) check_output_path(p, overwrite);
    nlohmann::json rep = compare_report(e, meta);
    rep["grid_png"] = paths[0];
    rep["timeline_png"] = paths[1];
    write_file_atomic(paths[0], render_compare_grid(e, compare_figures(e)), overwrite);
    write_file_atomic(paths[1], render_timeline(e), overwrite);
    write_file_atomic(paths[2], rep.dump(2) + "\n", overwrite);
    return rep;
}

namespace {

// The controllers of the modes, every mode checked against the model before any work.
std::vector<std::unique_ptr<CacheController>> compare_controllers(Txt2ImgPipeline& pipe, const Txt2ImgParams& p,
                                                                  const std::vector<CacheConfig>& modes) {
    if (modes.empty()) throw ParamError("compare", "needs at least one mode");
    if (p.prompts.size() * size_t(p.images_per_prompt) != 1)
        throw ParamError("batch_size", "a compare runs one image per mode");
    std::vector<std::unique_ptr<CacheController>> ctls;
    for (const auto& m : modes) {
        if (pipe.models().unet) check_cache_config(m, *pipe.models().unet, "compare");
        ctls.push_back(make_cache_controller(m));
    }
    return ctls;
}

} // namespace

CompareRun run_compare_modes(Txt2ImgPipeline& pipe, const Txt2ImgParams& p, const std::vector<CacheConfig>& modes,
                             const nlohmann::json& meta, const std::function<void(const std::string& mode)>& on_mode,
                             const std::function<void(size_t mode, const ProgressInfo&)>& progress, bool warm_up) {
    auto ctls = compare_controllers(pipe, p, modes);
    if (warm_up) {
        // A process's first UNet call pays one-time costs (oneDNN primitives built, weights and buffers paged in):
        // 15x a later step on the demo model. Untimed here, they would land on the first mode's wall time and
        // inflate every speed-up against it. The shallow paths run the same layers at the same shapes.
        Txt2ImgParams w = p;
        w.steps = 1;
        w.decode = false;
        w.free_params = false;
        if (w.init.enabled()) w.init.strength = 1.0; // one loop step whatever the strength
        w.hires.enabled = false; // the first pass's shapes only: one step has no second pass to run
        (void)pipe.run(w);
    }
    CompareRun out;
    out.meta = meta;
    for (auto& c : ctls) {
        if (on_mode) on_mode(c->label());
        const size_t index = out.entries.size();
        auto r =
            pipe.run(p, c.get(),
                     progress ? [&](const ProgressInfo& pi) { progress(index, pi); } : Txt2ImgPipeline::ProgressFn{});
        if (out.entries.empty()) {
            // What every mode was run with, as the image sidecar says it (the per-mode figures are in the entries),
            // and the model facts (LoRAs merged at load, prediction, VAE).
            auto params = image_record(p, r, 0, nullptr);
            for (const char* k : {"cache", "unet_full_steps", "unet_steps", "timings_s", "index_in_batch"})
                params.erase(k);
            out.meta.update(params);
            out.meta.update(model_record(pipe));
        }
        CompareEntry e;
        e.mode = c->label();
        e.wall_s = r.denoise_s;
        e.image_uint8 = r.image_uint8[0];
        e.steps = c->log();
        e.log = cache_log_json(*c);
        e.log["denoise_s"] = r.denoise_s;
        e.log["decode_s"] = r.decode_s;
        e.log["text_s"] = r.text_s;
        out.entries.push_back(std::move(e));
    }
    return out;
}

nlohmann::json run_compare(Txt2ImgPipeline& pipe, const Txt2ImgParams& p, const std::vector<CacheConfig>& modes,
                           const std::string& base, const nlohmann::json& meta, bool overwrite,
                           const std::function<void(const std::string& mode)>& on_mode) {
    (void)compare_controllers(pipe, p, modes); // the modes, then the outputs, before any work
    for (const auto& path : compare_output_paths(base)) check_output_path(path, overwrite);
    const auto run = run_compare_modes(pipe, p, modes, meta, on_mode);
    return write_compare(run.entries, base, run.meta, overwrite);
}

} // namespace anchor::unet
