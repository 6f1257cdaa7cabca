// Evaluation of the cache modes on the Fashion-MNIST demo model (`anchor-sd eval-fashion`): one image per class and
// seed for every mode (the 10 class prompts in one batch per seed), prompt adherence by the classifier, PSNR/SSIM vs
// the first mode, wall time, sample sheets and a JSON report. Timing on a shared 2-core VM: the modes are interleaved
// per seed (off, A, B, ... for seed 1, then seed 2, ...), so a slow period of the machine hits every mode alike; with
// repeats R each (seed, mode) run is timed R times and the fastest counts (the work is deterministic: the spread is
// the machine's, not the code's).
#pragma once

#include "unet/cache/cache_config.h"

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace anchor::unet::train {

struct FashionEvalParams {
    std::string model = "assets/models/fashion-sd", classifier; // classifier: <model>/eval/classifier.safetensors
    std::vector<CacheConfig> modes; // parsed at the edge (anchor-sd eval-fashion --modes has the default list)
    std::string out; // report folder: <model>/eval by default
    // The grid: every sampler x step count x seed is a cell, the prompts in batches of `batch`, run by every mode (the
    // modes interleaved per cell, the first is the reference of the cell). Empty prompts: the 10 class prompts "a photo
    // of a <class>"; empty seed_list: the seeds 1000 .. 1000 + seeds - 1.
    std::vector<std::string> prompts;
    std::vector<int64_t> seed_list;
    std::vector<std::string> samplers{"ddim"}; // sampler_table() names
    std::vector<int> steps{20};
    int seeds = 4, repeats = 1;
    // Images per pipeline run (0: every prompt of a seed in one batch). A cache mode that decides per batch (freq's
    // full steps: one image that moves makes the step full for all) is judged per image only with batch = 1, the
    // way a user generating one image meets it.
    int batch = 0;
    double cfg = 5.0;
    bool overwrite = false;
    void validate() const; // ParamError naming the field
};

struct FashionEvalReport {
    nlohmann::json report; // written to <out>/cache_eval.json
    std::string report_path;
    std::string table() const; // one line per cell and mode
};

FashionEvalReport run_fashion_eval(const FashionEvalParams& p);

// Where mode `m` of a cell (`modes`: the cell's modes, as in cache_eval.json) stands against DeepCache at the same
// speed-up: DeepCache's mean and worst PSNR there, each on the frontier of its configurations in the cell (intervals
// and branches; those that no configuration at least as fast beats in that measure), linear between the two that
// bracket the speed-up; a mode faster than every configuration is set against the fastest (DeepCache only loses
// quality as it speeds up), one slower than every configuration against their best. Null for a DeepCache mode
// or a cell without one. {deepcache_psnr_db, deepcache_psnr_min_db, mean_margin_db, worst_margin_db, verdict, basis};
// verdict: "beats" (both margins > 0), "loses", or "open": faster than every configuration and not better than the
// fastest, or slower than every configuration and better than all of them (the grid has no DeepCache at that speed).
nlohmann::json against_deepcache(const nlohmann::json& modes, const nlohmann::json& m);

// DeepCache's frontier in one measure of a cell ("psnr_db" or "psnr_min_db"): its configurations in `modes` that no
// other configuration at least as fast beats in that measure, as (speed-up, value), slowest first. The curve
// against_deepcache reads, and the one the speed-quality plots draw.
std::vector<std::pair<double, double>> deepcache_frontier(const nlohmann::json& modes, const std::string& measure);

} // namespace anchor::unet::train
