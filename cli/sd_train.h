// `anchor-sd train-vae | train-unet | train-classifier | eval-fashion` (the Fashion-MNIST demo model).
#pragma once

#include <functional>
#include <utility>
#include <vector>

namespace CLI {
class App;
}

namespace anchor::cli {

// Same contract as add_sd_bench_command (cli/sd_bench.h).
void add_sd_train_commands(CLI::App& app, std::vector<std::pair<CLI::App*, std::function<int()>>>& runners);

} // namespace anchor::cli
