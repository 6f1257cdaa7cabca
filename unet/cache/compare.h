// anchor-sd --compare: the same txt2img run under several cache modes, side by side.
//
// Outputs (all through cache/io/atomic_file.h, never replacing a file without overwrite):
//   * a grid PNG: one tile per mode, the image (nearest-neighbour upscaled to >= 256 px so labels stay readable) with
//     its label: mode, wall time, speed-up vs the first mode, PSNR and SSIM vs the first mode (cache/metrics.h);
//   * a timeline PNG: one row per mode, one column per loop step; the bar height is the shallow probe's low-band DCT
//     energy change r_k, the colour says full UNet (orange) or reuse (blue);
//   * a JSON report with every figure and the per-step logs.
#pragma once

#include "unet/cache/freq_cache.h"
#include "unet/pipeline/pipeline.h"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

namespace anchor::unet {

struct CompareEntry {
    std::string mode;          // the mode as the user wrote it (CacheConfig::label)
    double wall_s = 0;         // denoise wall time (seconds)
    torch::Tensor image_uint8; // [H, W, 3] uint8
    std::vector<CacheStepLog> steps;
    nlohmann::json log; // cache_log_json
};

struct CompareFigures {
    double speedup = 1, psnr = 0, ssim = 1; // vs entries[0]
};

// PSNR/SSIM (data range 255) and speed-up of every entry against entries[0].
std::vector<CompareFigures> compare_figures(const std::vector<CompareEntry>& entries);

// Renders the two images (BGR uint8 cv::Mat encoded as PNG bytes).
std::string render_compare_grid(const std::vector<CompareEntry>& entries, const std::vector<CompareFigures>& figs);
std::string render_timeline(const std::vector<CompareEntry>& entries);

// The report of the entries without any file: `meta`, the reference mode and per mode its cache log, wall time,
// speed-up, PSNR and SSIM vs the first mode (PSNR null with identical_to_first for an image equal to the first).
nlohmann::json compare_report(const std::vector<CompareEntry>& entries, const nlohmann::json& meta);
// Writes <base>.png (the grid), <base>_timeline.png and <base>_report.json (base = output path without .png). `meta` is
// copied into the report (prompt, seed, ...). Returns the report.
nlohmann::json write_compare(const std::vector<CompareEntry>& entries, const std::string& base,
                             const nlohmann::json& meta, bool overwrite);
// Runs `pipe` once per mode of `modes` (parsed at the edge: parse_cache_list) with the same parameters
// and seed (one image), then write_compare(base); `on_mode` hears each mode before it runs. The report holds `meta`
// (program facts), every parameter as the image sidecar records it (prompts, sampler, schedule, eta, size, the init
// image, mask and strength with their hashes) and the LoRAs merged at load. Returns the report.
nlohmann::json run_compare(Txt2ImgPipeline& pipe, const Txt2ImgParams& p, const std::vector<CacheConfig>& modes,
                           const std::string& base, const nlohmann::json& meta, bool overwrite,
                           const std::function<void(const std::string& mode)>& on_mode = {});

// What run_compare runs, without writing anything (a server answers with it): the entries and the report's meta
// (`meta`, the parameters, the model facts). `progress` hears each mode's steps with the mode's index. With
// `warm_up`, one untimed step at p's size runs first (a caller that has already run this shape in this process, e.g.
// a server, passes false).
struct CompareRun {
    std::vector<CompareEntry> entries;
    nlohmann::json meta;
};
CompareRun run_compare_modes(Txt2ImgPipeline& pipe, const Txt2ImgParams& p, const std::vector<CacheConfig>& modes,
                             const nlohmann::json& meta,
                             const std::function<void(const std::string& mode)>& on_mode = {},
                             const std::function<void(size_t mode, const ProgressInfo&)>& progress = {},
                             bool warm_up = true);

// The three paths write_compare uses for `base`.
std::vector<std::string> compare_output_paths(const std::string& base);

} // namespace anchor::unet
