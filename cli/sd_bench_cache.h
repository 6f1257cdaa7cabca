// `anchor-sd bench-cache`: every cache mode against `off` in one run (MACs per step, wall time, speed-up, quality).
#pragma once

#include <functional>
#include <utility>
#include <vector>

namespace CLI {
class App;
}

namespace anchor::cli {

// Adds the `bench-cache` subcommand; same contract as add_sd_bench_command (cli/sd_bench.h).
void add_sd_bench_cache_command(CLI::App& app, std::vector<std::pair<CLI::App*, std::function<int()>>>& runners);

} // namespace anchor::cli
