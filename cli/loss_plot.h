// Loss curve of a training run as a PNG: training loss (per log interval) and validation loss against the step.
#pragma once

#include "text/gpt2_train.h"

#include <string>
#include <vector>

namespace anchor::cli {

// PNG bytes, `width` x `height`. With OpenCV: axes with ticks, a title and a legend; without it (builds where OpenCV
// is missing) the same curves unlabelled. Throws anchor::Error when there is nothing to plot.
std::string loss_curve_png(const std::vector<text::Gpt2TrainMetric>& metrics, const std::string& title, int width = 900,
                           int height = 520);

} // namespace anchor::cli
