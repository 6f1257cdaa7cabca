// Line plots as PNG (OpenCV): loss curves of training logs ("step loss ..." lines, '#' comments; loss vs step,
// log-scale y) and general x/y curves such as a cache's speed/quality trade-off.
#pragma once

#include <string>
#include <vector>

namespace anchor::cli {

struct LossSeries {
    std::string label;
    std::vector<double> steps, losses;
    int color = -1;      // index into the plot's palette of 10 (-1: the series' own index)
    bool dashed = false; // dashed line (e.g. a baseline drawn under the series it is compared with)
    int marker = 3;      // radius of the point markers in pixels (0: none); drawn for series under 40 points
};

// Axes of a plot: labels, log or linear y.
struct PlotAxes {
    std::string title, x_label = "step", y_label;
    bool log_y = true;
};

// PNG bytes of the curves on shared axes (`steps` is x, `losses` is y), the legend to the right of the axes; throws
// anchor::Error without OpenCV or without points. Series with one point are drawn as a marker.
std::string line_plot_png(const std::vector<LossSeries>& series, const PlotAxes& axes);

// Reads the first two columns of a train_*_log.txt.
LossSeries read_loss_log(const std::string& path, const std::string& label);
// PNG bytes of the curves (several series share the axes); throws anchor::Error without OpenCV or without points.
std::string loss_curves_png(const std::vector<LossSeries>& series, const std::string& title);
// Writes loss_curves_png atomically.
void plot_loss_curves(const std::vector<LossSeries>& series, const std::string& png_path, const std::string& title,
                      bool overwrite);

} // namespace anchor::cli
