// Golden checker for txt2img runs (pipeline_tiny, deepcache): a folder whose config.json has "runs" and "models" and
// whose `<run>.safetensors` files hold `step.0.noise_pred`. Comparisons in tests/sd_pipeline_golden.h.
#include "cache/io/safetensors.h"
#include "tests/golden_runner/sd_comparisons.h"
#include "tests/sd_pipeline_golden.h"

namespace anchor::golden {
namespace {

std::vector<std::string> runs_of(const fs::path& dir) {
    std::vector<std::string> runs;
    if (!fs::is_directory(dir)) return runs;
    for (const auto& e : fs::directory_iterator(dir)) {
        if (e.path().extension() != ".safetensors") continue;
        try {
            auto f = SafeTensorsFile::open(e.path().string());
            // img2img / inpaint runs (an init image) are check_sd_img2img.cpp's
            if (f->has("step.0.noise_pred") && !f->has("init_image_uint8")) runs.push_back(e.path().stem().string());
        } catch (...) {
        }
    }
    std::sort(runs.begin(), runs.end());
    return runs;
}

const bool registered_sd_pipeline =
    register_checker({"sd-txt2img", [](const fs::path& d) { return has_file(d, "config.json") && !runs_of(d).empty(); },
                      [](const fs::path& dir, const Context& ctx) {
                          std::vector<CaseResult> out;
                          nlohmann::json cfg;
                          unet::SDModels models;
                          std::string load_error;
                          try {
                              cfg = sdgolden::read_json_file(dir / "config.json");
                              models = sdgolden::load_run_models(dir, cfg);
                          } catch (const std::exception& e) {
                              load_error = e.what();
                          }
                          const auto scratch =
                              fs::temp_directory_path() / ("anchor_golden_sd_" + std::to_string(::getpid()));
                          fs::create_directories(scratch);
                          for (const auto& run : runs_of(dir)) {
                              for (auto& r : run_results(relative_name(dir, ctx) + ":" + run, [&] {
                                       if (!load_error.empty()) throw Error(load_error);
                                       return sdgolden::compare_run(models, dir, cfg, run, scratch.string());
                                   }))
                                  out.push_back(r);
                          }
                          fs::remove_all(scratch);
                          return out;
                      }});

} // namespace
} // namespace anchor::golden
