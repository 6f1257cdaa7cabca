// `anchor-sd bench`: UNet step speed with analytic MAC counts, against this machine's own GEMM rate.
#pragma once

#include <functional>
#include <utility>
#include <vector>

namespace CLI {
class App;
}

namespace anchor::cli {

// Adds the `bench` subcommand to `app` and appends (subcommand, runner) to `runners`; the caller runs the runner of
// the subcommand that was parsed (runner returns the exit code).
void add_sd_bench_command(CLI::App& app, std::vector<std::pair<CLI::App*, std::function<int()>>>& runners);

} // namespace anchor::cli
