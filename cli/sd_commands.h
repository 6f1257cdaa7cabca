// anchor-sd's subcommands beside txt2img. Each add_* registers its subcommands on `app` and appends (subcommand,
// runner) to `runners`; the caller runs the runner of the subcommand that was parsed (it returns the exit code).
#pragma once

#include <functional>
#include <utility>
#include <vector>

namespace CLI {
class App;
}

namespace anchor::cli {

using SdRunners = std::vector<std::pair<CLI::App*, std::function<int()>>>;

// `bench`: UNet step speed with analytic MAC counts, against this machine's own GEMM rate (cli/sd_bench.cpp).
void add_sd_bench_command(CLI::App& app, SdRunners& runners);
// `bench-vae`: one VAE decode's time and peak memory, plain or tiled (unet/bench/vae_bench.h).
void add_sd_bench_vae_command(CLI::App& app, SdRunners& runners);
// `random-model`: a random-weight single file with a family's real shapes (unet/bench/random_checkpoint.h).
void add_sd_random_model_command(CLI::App& app, SdRunners& runners);
// `bench-cache`: every cache mode against `off` in one run (MACs per step, wall time, speed-up, quality).
void add_sd_bench_cache_command(CLI::App& app, SdRunners& runners);
// `info IMAGE.png`: the `parameters` (A1111) and `anchorcache` (JSON record) text chunks of a PNG (cli/sd_info.cpp).
void add_sd_info_command(CLI::App& app, SdRunners& runners);
// `serve`: the HTTP server (unet/serve/sd_server.h): A1111 and OpenAI image APIs, the compare endpoint and page.
void add_sd_serve_command(CLI::App& app, SdRunners& runners);
// `train-vae | train-unet | train-classifier | eval-fashion | calibrate` (the Fashion-MNIST demo model).
void add_sd_train_commands(CLI::App& app, SdRunners& runners);

} // namespace anchor::cli
