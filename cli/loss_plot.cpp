#include "cli/loss_plot.h"

#include "cache/io/atomic_file.h"
#include "cache/io/error.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#if ANCHOR_HAVE_OPENCV
#include <opencv2/core.hpp>
#include <opencv2/imgcodecs.hpp>
#include <opencv2/imgproc.hpp>
#endif

namespace anchor::cli {

LossSeries read_loss_log(const std::string& path, const std::string& label) {
    std::ifstream f(path);
    if (!f) throw Error("cannot read training log '" + path + "'");
    LossSeries s;
    s.label = label;
    std::string line;
    while (std::getline(f, line)) {
        if (line.empty() || line[0] == '#') continue;
        double step, loss;
        const auto at = line.find(" loss ");
        if (line.rfind("step ", 0) == 0 && at != std::string::npos) { // trainers' "step N/M loss X ..." lines
            std::istringstream a(line.substr(5)), b(line.substr(at + 6));
            if (a >> step && b >> loss) s.steps.push_back(step), s.losses.push_back(loss);
            continue;
        }
        std::istringstream is(line);
        if (is >> step >> loss) s.steps.push_back(step), s.losses.push_back(loss);
    }
    if (s.steps.empty()) throw Error("training log '" + path + "' has no 'step loss' or 'step N/M loss X' lines");
    return s;
}

void plot_loss_curves(const std::vector<LossSeries>& series, const std::string& png_path, const std::string& title,
                      bool overwrite) {
    write_file_atomic(png_path, loss_curves_png(series, title), overwrite);
}

std::string loss_curves_png(const std::vector<LossSeries>& series, const std::string& title) {
    PlotAxes a;
    a.title = title;
    a.y_label = "loss";
    return line_plot_png(series, a);
}

#if ANCHOR_HAVE_OPENCV
namespace {
struct PlotRange {
    double x0, x1, l0, l1; // x extent; y extent in plotted units (log10 when log_y)
};

// x from 0 for non-negative data (steps, speed-ups); y in quarter decades (log) or padded linear.
PlotRange plot_range(const std::vector<LossSeries>& series, bool log_y) {
    double x0 = 1e30, x1 = -1e30, ylo = 1e30, yhi = -1e30;
    for (const auto& s : series)
        for (size_t i = 0; i < s.steps.size(); ++i) {
            x0 = std::min(x0, s.steps[i]), x1 = std::max(x1, s.steps[i]);
            if (!log_y || s.losses[i] > 0) ylo = std::min(ylo, s.losses[i]), yhi = std::max(yhi, s.losses[i]);
        }
    if (log_y || x0 >= 0) x0 = std::min(x0, 0.0);
    if (x1 <= x0) x1 = x0 + 1;
    x1 += 0.03 * (x1 - x0); // a marker at the largest x stays whole
    if (log_y) return {x0, x1, std::floor(std::log10(ylo) * 4) / 4, std::ceil(std::log10(yhi) * 4) / 4 + 1e-9};
    const double pad = std::max(1e-9, 0.08 * (yhi - ylo) + (yhi == ylo ? std::abs(yhi) * 0.05 + 1e-3 : 0));
    return {x0, x1, ylo - pad, yhi + pad};
}
} // namespace
#endif

std::string line_plot_png(const std::vector<LossSeries>& series, const PlotAxes& axes) {
    size_t points = 0;
    for (const auto& s : series) points += s.steps.size();
    if (points == 0) throw Error("plot '" + axes.title + "': nothing to plot");
#if ANCHOR_HAVE_OPENCV
    // The legend has the right margin to itself, so it never covers a curve.
    const int W = 940, H = 420, L = 70, R = 240, T = 40, B = 50;
    const PlotRange r = plot_range(series, axes.log_y);
    const double x0 = r.x0, x1 = r.x1, l0 = r.l0, l1 = r.l1;
    auto fy = [&](double y) { return axes.log_y ? std::log10(std::max(y, 1e-30)) : y; };
    auto px = [&](double x) { return L + int((W - L - R) * (x - x0) / (x1 - x0)); };
    auto py = [&](double y) { return T + int((H - T - B) * (l1 - fy(y)) / (l1 - l0)); };
    cv::Mat m(H, W, CV_8UC3, cv::Scalar(255, 255, 255));
    cv::rectangle(m, {L, T}, {W - R, H - B}, {0, 0, 0});
    auto text = [&](const std::string& s, int x, int y, double sc = 0.42) {
        cv::putText(m, s, {x, y}, cv::FONT_HERSHEY_SIMPLEX, sc, {0, 0, 0}, 1, cv::LINE_AA);
    };
    text(axes.title, L, 18, 0.5);
    auto ygrid = [&](double v) {
        const int y = py(v);
        cv::line(m, {L, y}, {W - R, y}, {225, 225, 225});
        char b[32];
        std::snprintf(b, sizeof b, "%.3g", v);
        text(b, 8, y + 4, 0.38);
    };
    if (axes.log_y)
        for (double e = std::ceil(l0 * 4) / 4; e <= l1; e += 0.25) ygrid(std::pow(10.0, e)); // every quarter decade
    else
        for (int k = 0; k <= 4; ++k) ygrid(l0 + (l1 - l0) * k / 4);
    for (int k = 0; k <= 4; ++k) {
        const double x = x0 + (x1 - x0) * k / 4;
        char b[32];
        std::snprintf(b, sizeof b, x1 - x0 >= 20 ? "%.0f" : "%.2g", x);
        text(b, px(x) - 10, H - B + 18, 0.38);
    }
    text(axes.x_label, W / 2, H - 12, 0.42);
    if (!axes.y_label.empty()) text(axes.y_label, 8, T - 12, 0.4); // above the top tick's label
    // Tableau's 10 categorical colours (BGR): distinct in hue and on greyscale print.
    const cv::Scalar colors[] = {{180, 119, 31}, {14, 127, 255},  {44, 160, 44},   {40, 39, 214},  {189, 103, 148},
                                 {75, 86, 140},  {194, 119, 227}, {127, 127, 127}, {34, 189, 188}, {207, 190, 23}};
    auto segment = [&](cv::Point a, cv::Point b, const cv::Scalar& c, bool dashed) {
        if (!dashed) return cv::line(m, a, b, c, 2, cv::LINE_AA);
        const double len = std::hypot(double(b.x - a.x), double(b.y - a.y));
        for (double t = 0; t < len; t += 12) { // 7 px on, 5 off
            const double t1 = std::min(len, t + 7);
            auto at = [&](double u) {
                return cv::Point(int(a.x + (b.x - a.x) * u / len), int(a.y + (b.y - a.y) * u / len));
            };
            cv::line(m, at(t), at(t1), c, 2, cv::LINE_AA);
        }
    };
    for (size_t k = 0; k < series.size(); ++k) {
        const auto& s = series[k];
        const auto c = colors[size_t(s.color >= 0 ? s.color : int(k)) % 10];
        for (size_t i = 1; i < s.steps.size(); ++i)
            segment({px(s.steps[i - 1]), py(s.losses[i - 1])}, {px(s.steps[i]), py(s.losses[i])}, c, s.dashed);
        const bool markers = s.marker > 0 && s.steps.size() < 40;
        if (markers)
            for (size_t i = 0; i < s.steps.size(); ++i)
                cv::circle(m, {px(s.steps[i]), py(s.losses[i])}, s.marker, c, -1, cv::LINE_AA);
        const int ly = T + 10 + 18 * int(k), lx = W - R + 12;
        segment({lx, ly}, {lx + 26, ly}, c, s.dashed);
        if (markers) cv::circle(m, {lx + 13, ly}, s.marker, c, -1, cv::LINE_AA);
        text(s.label, lx + 34, ly + 4);
    }
    std::vector<uchar> buf;
    cv::imencode(".png", m, buf);
    return std::string(buf.begin(), buf.end());
#else
    throw Error("plot '" + axes.title + "' needs OpenCV (this build has none)");
#endif
}

} // namespace anchor::cli
