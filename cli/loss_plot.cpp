#include "cli/loss_plot.h"

#include "cache/io/error.h"

#if ANCHOR_HAVE_OPENCV
#include <opencv2/core.hpp>
#include <opencv2/imgcodecs.hpp>
#include <opencv2/imgproc.hpp>
#else
#define STB_IMAGE_WRITE_STATIC // own private copy, as unet/pipeline.cpp has
#define STB_IMAGE_WRITE_IMPLEMENTATION
#include <stb_image_write.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace anchor::cli {

namespace {

struct Series {
    std::vector<double> x, y;
};

// A "nice" tick step (1, 2 or 5 x 10^k) giving about `n` ticks over `span`.
double nice_step(double span, int n) {
    const double raw = span / std::max(1, n), p = std::pow(10.0, std::floor(std::log10(raw)));
    for (double m : {1.0, 2.0, 5.0, 10.0})
        if (m * p >= raw) return m * p;
    return 10.0 * p;
}

#if ANCHOR_HAVE_OPENCV
std::string fmt(const char* f, double v) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), f, v);
    return buf;
}
#endif

} // namespace

std::string loss_curve_png(const std::vector<text::Gpt2TrainMetric>& metrics, const std::string& title, int W, int H) {
    Series train, val;
    for (const auto& m : metrics) {
        train.x.push_back(double(m.step)), train.y.push_back(m.train_loss);
        if (m.val_loss >= 0) val.x.push_back(double(m.step)), val.y.push_back(m.val_loss);
    }
    if (train.x.empty()) throw Error("loss plot: no training metrics to plot");
    double x1 = 0, y0 = 1e300, y1 = -1e300;
    for (const auto* s : {&train, &val}) {
        for (double v : s->x) x1 = std::max(x1, v);
        for (double v : s->y) y0 = std::min(y0, v), y1 = std::max(y1, v);
    }
    const double ystep = nice_step(std::max(y1 - y0, 1e-3), 6);
    y0 = std::floor(y0 / ystep) * ystep;
    y1 = std::ceil(y1 / ystep) * ystep;
    if (y1 <= y0) y1 = y0 + ystep;
    const double xstep = nice_step(std::max(x1, 1.0), 8);
    x1 = std::ceil(x1 / xstep) * xstep;
    const int L = 70, R = 20, Tm = 56, B = 50; // margins
    auto px = [&](double x) { return L + int(std::lround((x / x1) * (W - L - R))); };
    auto py = [&](double y) { return Tm + int(std::lround((1.0 - (y - y0) / (y1 - y0)) * (H - Tm - B))); };

#if ANCHOR_HAVE_OPENCV
    cv::Mat img(H, W, CV_8UC3, cv::Scalar(255, 255, 255));
    const cv::Scalar grid(225, 225, 225), axis(60, 60, 60), blue(200, 110, 30), red(40, 40, 210);
    auto text = [&](const std::string& s, int x, int y, double scale = 0.45, cv::Scalar c = {30, 30, 30}) {
        cv::putText(img, s, {x, y}, cv::FONT_HERSHEY_SIMPLEX, scale, c, 1, cv::LINE_AA);
    };
    for (double y = y0; y <= y1 + 1e-9; y += ystep) {
        cv::line(img, {L, py(y)}, {W - R, py(y)}, grid, 1);
        text(fmt("%.1f", y), 8, py(y) + 5);
    }
    for (double x = 0; x <= x1 + 1e-9; x += xstep) {
        cv::line(img, {px(x), Tm}, {px(x), H - B}, grid, 1);
        const auto s = fmt("%.0f", x);
        text(s, px(x) - 4 * int(s.size()), H - B + 18);
    }
    cv::rectangle(img, {L, Tm}, {W - R, H - B}, axis, 1);
    auto polyline = [&](const Series& s, const cv::Scalar& c, bool dots) {
        std::vector<cv::Point> pts;
        for (size_t i = 0; i < s.x.size(); ++i) pts.emplace_back(px(s.x[i]), py(s.y[i]));
        if (pts.size() > 1) cv::polylines(img, pts, false, c, 2, cv::LINE_AA);
        if (dots)
            for (const auto& p : pts) cv::circle(img, p, 4, c, cv::FILLED, cv::LINE_AA);
    };
    polyline(train, blue, false);
    polyline(val, red, true);
    text(title, 8, 22, 0.55);
    text("step", W / 2 - 15, H - 12);
    text("loss (nats/token)", 8, Tm - 8, 0.4);
    cv::line(img, {W - R - 230, Tm + 18}, {W - R - 200, Tm + 18}, blue, 2, cv::LINE_AA);
    text("train (mean per log interval)", W - R - 192, Tm + 22, 0.42);
    cv::circle(img, {W - R - 215, Tm + 40}, 4, red, cv::FILLED, cv::LINE_AA);
    text("validation (held-out text)", W - R - 192, Tm + 44, 0.42);
    std::vector<uchar> buf;
    if (!cv::imencode(".png", img, buf)) throw Error("loss plot: cannot encode PNG");
    return std::string(buf.begin(), buf.end());
#else
    (void)title;
    std::vector<uint8_t> rgb(size_t(W) * H * 3, 255);
    auto set = [&](int x, int y, uint8_t r, uint8_t g, uint8_t b) {
        if (x < 0 || y < 0 || x >= W || y >= H) return;
        auto* p = &rgb[(size_t(y) * W + x) * 3];
        p[0] = r, p[1] = g, p[2] = b;
    };
    auto line = [&](int xa, int ya, int xb, int yb, uint8_t r, uint8_t g, uint8_t b) {
        const int n = std::max(std::abs(xb - xa), std::abs(yb - ya)) + 1;
        for (int i = 0; i <= n; ++i) set(xa + (xb - xa) * i / n, ya + (yb - ya) * i / n, r, g, b);
    };
    for (double y = y0; y <= y1 + 1e-9; y += ystep) line(L, py(y), W - R, py(y), 225, 225, 225);
    line(L, Tm, W - R, Tm, 60, 60, 60), line(L, H - B, W - R, H - B, 60, 60, 60);
    line(L, Tm, L, H - B, 60, 60, 60), line(W - R, Tm, W - R, H - B, 60, 60, 60);
    for (size_t i = 1; i < train.x.size(); ++i)
        line(px(train.x[i - 1]), py(train.y[i - 1]), px(train.x[i]), py(train.y[i]), 30, 110, 200);
    for (size_t i = 1; i < val.x.size(); ++i)
        line(px(val.x[i - 1]), py(val.y[i - 1]), px(val.x[i]), py(val.y[i]), 210, 40, 40);
    std::string out;
    auto sink = [](void* ctx, void* data, int size) {
        static_cast<std::string*>(ctx)->append((const char*)data, size);
    };
    if (!stbi_write_png_to_func(sink, &out, W, H, 3, rgb.data(), W * 3)) throw Error("loss plot: cannot encode PNG");
    return out;
#endif
}

} // namespace anchor::cli
