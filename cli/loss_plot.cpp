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
        std::istringstream is(line);
        double step, loss;
        if (is >> step >> loss) s.steps.push_back(step), s.losses.push_back(loss);
    }
    if (s.steps.empty()) throw Error("training log '" + path + "' has no 'step loss' lines");
    return s;
}

void plot_loss_curves(const std::vector<LossSeries>& series, const std::string& png_path, const std::string& title,
                      bool overwrite) {
    write_file_atomic(png_path, loss_curves_png(series, title), overwrite);
}

std::string loss_curves_png(const std::vector<LossSeries>& series, const std::string& title) {
    size_t points = 0;
    for (const auto& s : series) points += s.steps.size();
    if (points == 0) throw Error("loss plot '" + title + "': nothing to plot");
#if ANCHOR_HAVE_OPENCV
    const int W = 720, H = 420, L = 70, R = 20, T = 40, B = 50;
    double x1 = 1, ylo = 1e30, yhi = -1e30;
    for (const auto& s : series)
        for (size_t i = 0; i < s.steps.size(); ++i) {
            x1 = std::max(x1, s.steps[i]);
            if (s.losses[i] > 0) ylo = std::min(ylo, s.losses[i]), yhi = std::max(yhi, s.losses[i]);
        }
    const double l0 = std::floor(std::log10(ylo) * 4) / 4, l1 = std::ceil(std::log10(yhi) * 4) / 4 + 1e-9;
    auto px = [&](double x) { return L + int((W - L - R) * x / x1); };
    auto py = [&](double y) { return T + int((H - T - B) * (l1 - std::log10(std::max(y, 1e-30))) / (l1 - l0)); };
    cv::Mat m(H, W, CV_8UC3, cv::Scalar(255, 255, 255));
    cv::rectangle(m, {L, T}, {W - R, H - B}, {0, 0, 0});
    auto text = [&](const std::string& s, int x, int y, double sc = 0.42) {
        cv::putText(m, s, {x, y}, cv::FONT_HERSHEY_SIMPLEX, sc, {0, 0, 0}, 1, cv::LINE_AA);
    };
    text(title, L, 24, 0.5);
    for (double e = std::ceil(l0 * 4) / 4; e <= l1; e += 0.25) { // y grid every quarter decade
        const int y = py(std::pow(10.0, e));
        cv::line(m, {L, y}, {W - R, y}, {225, 225, 225});
        char b[32];
        std::snprintf(b, sizeof b, "%.3g", std::pow(10.0, e));
        text(b, 8, y + 4, 0.38);
    }
    for (int k = 0; k <= 4; ++k) {
        const double x = x1 * k / 4;
        char b[32];
        std::snprintf(b, sizeof b, "%.0f", x);
        text(b, px(x) - 10, H - B + 18, 0.38);
    }
    text("step", W / 2, H - 12, 0.42);
    const cv::Scalar colors[] = {{200, 90, 30}, {30, 110, 230}, {40, 160, 40}, {150, 40, 150}};
    for (size_t k = 0; k < series.size(); ++k) {
        const auto& s = series[k];
        for (size_t i = 1; i < s.steps.size(); ++i)
            cv::line(m, {px(s.steps[i - 1]), py(s.losses[i - 1])}, {px(s.steps[i]), py(s.losses[i])}, colors[k % 4], 2,
                     cv::LINE_AA);
        text(s.label, W - R - 200, T + 20 + 18 * int(k));
        cv::line(m, {W - R - 230, T + 16 + 18 * int(k)}, {W - R - 205, T + 16 + 18 * int(k)}, colors[k % 4], 2);
    }
    std::vector<uchar> buf;
    cv::imencode(".png", m, buf);
    return std::string(buf.begin(), buf.end());
#else
    throw Error("loss plot '" + title + "' needs OpenCV (this build has none)");
#endif
}

} // namespace anchor::cli
