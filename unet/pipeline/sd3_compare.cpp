// SD 3 compare runs (see sd3_compare.h).
#include "unet/pipeline/sd3_compare.h"

#include "cache/dit_cache_rules.h"
#include "cache/io/atomic_file.h"
#include "cache/io/error.h"
#include "unet/cache/dit_cache_config.h"

namespace anchor::unet {

SD3CompareRun sd3_compare_modes(SD3Models& m, SD3Txt2ImgParams p, const std::vector<CacheConfig>& modes,
                                const SD3RunInfo& run, const std::function<void(int, int)>& on_step,
                                const std::function<void(const std::string&)>& on_mode, bool warm) {
    if (modes.empty()) throw ParamError("compare", "needs at least one mode");
    if (p.prompts.size() != 1) throw ParamError("compare", "a compare runs one image per mode");
    for (const auto& c : modes) check_dit_cache_config(c, "compare");
    if (warm) {
        // The first transformer call of a process pays one-time costs (weights paged in, kernels chosen).
        SD3Txt2ImgParams w = p;
        w.steps = 1;
        w.cache = CacheConfig{};
        (void)sd3_txt2img(m, w);
    }
    SD3CompareRun out;
    out.meta = {{"program", "anchor-sd"}, {"family", "sd3"}};
    for (const auto& c : modes) {
        if (on_mode) on_mode(c.label);
        p.cache = c;
        const auto r = sd3_txt2img(m, p, on_step);
        if (out.entries.empty()) {
            auto rec = sd3_run_record(p, r, run);
            for (const char* k : {"encode_s", "denoise_s", "decode_s", "output", "cache", "cache_mode"}) rec.erase(k);
            out.meta["run"] = rec;
        }
        CompareEntry e;
        e.mode = c.label;
        e.wall_s = r.denoise_s;
        e.image_uint8 = r.image_uint8[0];
        e.steps = r.cache_steps;
        e.log = r.cache_log;
        e.log["denoise_s"] = r.denoise_s;
        e.log["decode_s"] = r.decode_s;
        e.log["text_s"] = r.encode_s;
        out.entries.push_back(std::move(e));
    }
    return out;
}

nlohmann::json sd3_run_compare(SD3Models& m, SD3Txt2ImgParams p, const std::vector<CacheConfig>& modes,
                               const std::string& base, const SD3RunInfo& run, bool overwrite,
                               const std::function<void(int, int)>& on_step,
                               const std::function<void(const std::string&)>& on_mode) {
    if (modes.empty()) throw ParamError("compare", "needs at least one mode");
    for (const auto& path : compare_output_paths(base)) check_output_path(path, overwrite);
    const auto r = sd3_compare_modes(m, std::move(p), modes, run, on_step, on_mode);
    return write_compare(r.entries, base, r.meta, overwrite);
}

std::vector<double> sd3_teacache_calibrate(SD3Models& m, const std::vector<SD3Txt2ImgParams>& runs, int degree,
                                           std::vector<std::pair<double, double>>* samples) {
    if (runs.empty()) throw ParamError("runs", "TeaCache calibration needs at least one run");
    std::vector<double> x, y;
    for (auto p : runs) {
        p.cache = CacheConfig{};
        p.record_teacache = true;
        const auto r = sd3_txt2img(m, p);
        for (const auto& [a, b] : r.teacache_samples) x.push_back(a), y.push_back(b);
        if (samples) samples->insert(samples->end(), r.teacache_samples.begin(), r.teacache_samples.end());
    }
    return cache::fit_polynomial(x, y, degree);
}

} // namespace anchor::unet
