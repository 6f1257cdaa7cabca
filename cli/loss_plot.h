// Loss-curve PNG of a training log ("step loss ..." lines, '#' comments): loss vs step, log-scale y, labelled axes.
#pragma once

#include <string>
#include <vector>

namespace anchor::cli {

struct LossSeries {
    std::string label;
    std::vector<double> steps, losses;
};

// Reads the first two columns of a train_*_log.txt.
LossSeries read_loss_log(const std::string& path, const std::string& label);
// PNG bytes of the curves (several series share the axes); throws anchor::Error without OpenCV or without points.
std::string loss_curves_png(const std::vector<LossSeries>& series, const std::string& title);
// Writes loss_curves_png atomically.
void plot_loss_curves(const std::vector<LossSeries>& series, const std::string& png_path, const std::string& title,
                      bool overwrite);

} // namespace anchor::cli
