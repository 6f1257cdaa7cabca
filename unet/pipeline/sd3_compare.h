// anchor-sd --compare on SD 3 / 3.5: the same txt2img run under several cache modes of the transformer
// (unet/cache/dit_cache.h), written as SD 1.x's compare writes it (unet/cache/compare.h: the grid, the timeline, the
// report).
#pragma once

#include "unet/cache/compare.h"
#include "unet/pipeline/sd3_record.h"

#include <nlohmann/json.hpp>

#include <functional>
#include <string>
#include <vector>

namespace anchor::unet {

// Runs `p` once per mode (one image; an untimed one-step run first, so that one-time costs do not land on the first
// mode), the same seed each time, then write_compare(base): <base>.png, <base>_timeline.png, <base>_report.json.
// The report's meta holds the first mode's record (sd3_run_record) without its timings. ParamError("compare") for
// no modes, a batch, or a mode that does not apply to the transformer. Returns the report.
nlohmann::json sd3_run_compare(SD3Models& m, SD3Txt2ImgParams p, const std::vector<CacheConfig>& modes,
                               const std::string& base, const SD3RunInfo& run, bool overwrite,
                               const std::function<void(int, int)>& on_step = {},
                               const std::function<void(const std::string&)>& on_mode = {});

// The runs of sd3_run_compare without the files (a server answers with compare_report(entries, meta)): the checks,
// the untimed one-step run when `warm`, then one run per mode. ParamError("compare") as sd3_run_compare.
struct SD3CompareRun {
    std::vector<CompareEntry> entries;
    nlohmann::json meta;
};
SD3CompareRun sd3_compare_modes(SD3Models& m, SD3Txt2ImgParams p, const std::vector<CacheConfig>& modes,
                                const SD3RunInfo& run, const std::function<void(int, int)>& on_step = {},
                                const std::function<void(const std::string&)>& on_mode = {}, bool warm = true);

// TeaCache's rescale polynomial for this model (its `coef=` key, highest degree first): every run of `runs` uncached
// (mode off), the samples of every step (the relative L1 change of the first block's modulated input against that
// of the model output, consecutive steps) fitted by least squares (cache::fit_polynomial). `samples`, when given,
// receives the points. ParamError("runs") for no runs.
std::vector<double> sd3_teacache_calibrate(SD3Models& m, const std::vector<SD3Txt2ImgParams>& runs, int degree = 4,
                                           std::vector<std::pair<double, double>>* samples = nullptr);

} // namespace anchor::unet
