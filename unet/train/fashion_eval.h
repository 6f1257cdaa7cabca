// Evaluation of the cache modes on the Fashion-MNIST demo model (`anchor-sd eval-fashion`): one image per class and
// seed for every mode (the 10 class prompts in one batch per seed), prompt adherence by the classifier, PSNR/SSIM vs
// the first mode, wall time, sample sheets and a JSON report. Timing on a shared 2-core VM: the modes are interleaved
// per seed (off, A, B, ... for seed 1, then seed 2, ...), so a slow period of the machine hits every mode alike; with
// repeats R each (seed, mode) run is timed R times and the fastest counts (the work is deterministic: the spread is
// the machine's, not the code's).
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace anchor::unet::train {

struct FashionEvalParams {
    std::string model = "assets/models/fashion-sd", classifier; // classifier: <model>/eval/classifier.safetensors
    std::vector<std::string> modes{"off",         "deepcache:2",  "deepcache:3", "deepcache:4", "deepcache:5",
                                   "deepcache:6", "freq:thr=0.5", "freq",        "freq:thr=2"};
    std::string out; // report folder: <model>/eval by default
    int seeds = 4, steps = 20, repeats = 1;
    double cfg = 5.0;
    bool overwrite = false;
    void validate() const; // ParamError naming the field
};

struct FashionEvalReport {
    nlohmann::json report; // written to <out>/cache_eval.json
    std::string report_path;
    std::string table() const; // one line per mode
};

FashionEvalReport run_fashion_eval(const FashionEvalParams& p);

} // namespace anchor::unet::train
