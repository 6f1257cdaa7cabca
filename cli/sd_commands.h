// anchor-sd's subcommands beside txt2img. Each add_* registers its subcommands on `app` and appends (subcommand,
// runner) to `runners`; the caller runs the runner of the subcommand that was parsed (it returns the exit code).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
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
// `upscale -i IN --model FILE -o OUT.png`: an ESRGAN upscale (cli/sd_upscale.cpp, unet/pipeline/upscale.h).
void add_sd_upscale_command(CLI::App& app, SdRunners& runners);

// SD 3 / 3.5 (cli/sd3_txt2img.cpp): the options only SD 3 has, and the txt2img run of an SD 3 model (is_sd3_model)
// from the top-level options.
struct Sd3Options {
    bool no_t5 = false;
    double shift = -1; // <= 0: the scheduler config's
    int max_sequence_length = 256;
    std::vector<int> slg_layers; // --slg-layers: skip-layer guidance (off when empty)
    double slg_scale = 2.8, slg_start = 0.01, slg_end = 0.2;
    std::string text_encoders; // --text-encoders DIR: a single file's text encoders / tokenizers when it lacks them
};
void add_sd3_options(CLI::App& app, Sd3Options& o);
struct Sd3RunArgs {
    std::string model, prompt, negative, output, dtype = "auto";
    bool negative_given = false, steps_given = false, cfg_given = false, overwrite = false;
    int steps = 28, width = 0, height = 0, threads = 0;
    double cfg_scale = 7.0;
    int64_t seed = -1;
    std::vector<std::string> compare;
    std::string cache = "off"; // --cache as typed
    std::vector<std::string> init_images; // -i/--init-img: img2img
    double strength = 0.6;                // --strength (diffusers' SD 3 img2img default when not given)
    std::vector<std::string> loras;       // --lora FILE[:MULTIPLIER] (unet/model/lora_sd3.h)
    std::string lora_model_dir;           // --lora-model-dir: the prompt's <lora:NAME[:MULTIPLIER]> tags
    Sd3Options sd3;
};
// Refuses (UsageError, exit 2) every option given on `app` that SD 3 runs do not take, and --cache / --compare
// modes that do not apply to the transformer.
int run_sd3_txt2img(const CLI::App& app, const Sd3RunArgs& a);

} // namespace anchor::cli
