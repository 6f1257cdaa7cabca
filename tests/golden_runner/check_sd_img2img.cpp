// Golden checker for img2img and inpaint runs (img2img_tiny, inpaint_tiny): a folder whose config.json has "runs"
// and "models" and whose `<run>.safetensors` files hold `init_image_uint8` and `step.0.noise_pred`, plus the forward
// goldens of its UNets (golden_*.safetensors with sample / timesteps / encoder_hidden_states / out). Comparisons in
// tests/sd_img2img_golden.h. Also the UNet folders such a case names in "models" that hold no golden of their own
// (inpaint_tiny/unet_inpaint): loaded, their config checked against the weights.
#include "cache/io/safetensors.h"
#include "tests/golden_runner/sd_comparisons.h"
#include "tests/sd_img2img_golden.h"

namespace anchor::golden {
namespace {

std::vector<fs::path> forward_goldens(const fs::path& dir) {
    std::vector<fs::path> out;
    for (const auto& e : fs::directory_iterator(dir)) {
        const auto name = e.path().filename().string();
        if (e.path().extension() == ".safetensors" && name.rfind("golden", 0) == 0 &&
            sdgolden::is_unet_forward_golden(e.path()))
            out.push_back(e.path());
    }
    std::sort(out.begin(), out.end());
    return out;
}

const bool registered_sd_img2img = register_checker(
    {"sd-img2img",
     [](const fs::path& d) { return has_file(d, "config.json") && !sdgolden::img2img_runs_of(d).empty(); },
     [](const fs::path& dir, const Context& ctx) {
         std::vector<CaseResult> out;
         const std::string base = relative_name(dir, ctx);
         nlohmann::json cfg;
         std::string load_error;
         try {
             cfg = sdgolden::read_json_file(dir / "config.json");
         } catch (const std::exception& e) {
             load_error = e.what();
         }
         sdgolden::Img2ImgModels models;
         for (const auto& file : forward_goldens(dir)) {
             CaseResult r;
             r.name = base + ":" + file.stem().string();
             try {
                 if (!load_error.empty()) throw Error(load_error);
                 for (const auto& c : sdgolden::compare_unet_forward(models, dir, cfg, file))
                     apply_comparison(r.stats, c);
             } catch (const std::exception& e) {
                 r.stats.fail(std::string("exception: ") + e.what());
             }
             out.push_back(r);
         }
         for (const auto& run : sdgolden::img2img_runs_of(dir)) {
             for (auto& r : run_results(base + ":" + run, [&] {
                      if (!load_error.empty()) throw Error(load_error);
                      return sdgolden::compare_img2img_run(models, dir, cfg, run);
                  }))
                 out.push_back(r);
         }
         return out;
     }});

// A UNet folder without a golden of its own that the case folder above it names in "models".
bool named_by_parent_case(const fs::path& d) {
    if (config_class(d) != "UNet2DConditionModel" || has_file(d, "golden_outputs.safetensors")) return false;
    const fs::path parent = d.parent_path();
    if (!has_file(parent, "config.json") || sdgolden::img2img_runs_of(parent).empty()) return false;
    try {
        const auto cfg = sdgolden::read_json_file(parent / "config.json");
        if (!cfg.contains("models")) return false;
        for (const auto& [k, v] : cfg["models"].items())
            if (v.is_string() && sdgolden::detail::folder_token(v.get<std::string>()) == d.filename().string())
                return true;
    } catch (...) {
    }
    return false;
}

const bool registered_sd_img2img_unet = register_checker(
    {"sd-unet-weights", named_by_parent_case, [](const fs::path& dir, const Context& ctx) {
         CaseResult r;
         r.name = relative_name(dir, ctx) + ":load (forward checked by the case above)";
         try {
             auto unet = unet::load_unet_folder(dir.string());
             const auto cfg = sdgolden::read_json_file(dir / "config.json");
             const auto& c = unet->config();
             r.stats.check_true("config in_channels = conv_in input channels",
                                cfg.at("in_channels").get<int64_t>() == unet->conv_in->weight.size(1) &&
                                    c.in_channels == unet->conv_in->weight.size(1),
                                "config " + cfg.at("in_channels").dump() + ", conv_in weight " +
                                    std::to_string(unet->conv_in->weight.size(1)));
             r.stats.check_true("config out_channels", cfg.at("out_channels").get<int64_t>() == c.out_channels);
             int64_t params = 0;
             bool finite = true;
             for (const auto& p : unet->parameters()) {
                 params += p.numel();
                 finite = finite && torch::isfinite(p).all().item<bool>();
             }
             r.stats.check_true("weights finite", finite);
             r.stats.check_true("weights present", params > 0);
         } catch (const std::exception& e) {
             r.stats.fail(std::string("exception: ") + e.what());
         }
         return std::vector<CaseResult>{r};
     }});

} // namespace
} // namespace anchor::golden
