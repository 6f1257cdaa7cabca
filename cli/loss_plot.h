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
// Writes the PNG atomically (several series share the axes).
void plot_loss_curves(const std::vector<LossSeries>& series, const std::string& png_path, const std::string& title,
                      bool overwrite);

} // namespace anchor::cli
