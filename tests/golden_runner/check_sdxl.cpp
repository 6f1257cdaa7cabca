// Golden checker for SDXL folders (tests/golden/sd/sdxl_tiny): a diffusers StableDiffusionXLPipeline folder with
// golden.json and golden_*.safetensors, claimed by model_index.json's class. Its component folders (unet/, vae/,
// text_encoder/, text_encoder_2/) are claimed as models that must load with every tensor used. The original SGM
// single file of the same weights is check_sd.cpp's (key_map.json), which runs these comparisons on it.
#include "tests/golden_runner/sd_comparisons.h"
#include "tests/sdxl_golden.h"
#include "unet/model/checkpoint.h"
#include "unet/model/mmdit.h"
#include "unet/model/t5_encoder.h"

namespace anchor::golden {

// Every SDXL comparison of `golden_dir` on `models` (also used for the single-file layout of the same weights).
std::vector<CaseResult> check_sdxl_models(unet::SDModels& m, const fs::path& golden_dir, const std::string& base) {
    std::vector<CaseResult> out;
    auto group = [&](const std::string& name, const std::function<std::vector<sdgolden::Comparison>()>& f) {
        out.push_back(guarded(base + ":" + name, [&](Stats& st) {
            for (const auto& c : f()) apply_comparison(st, c);
        }));
    };
    group("text-encoders", [&] { return sdgolden::compare_sdxl_text(m, golden_dir); });
    group("unet", [&] { return sdgolden::compare_sdxl_unet(*m.unet, golden_dir, true); });
    group("vae", [&] { return sdgolden::compare_sdxl_vae(*m.vae, golden_dir); });
    for (const auto& run : sdgolden::sdxl_runs(golden_dir)) {
        for (auto& r : run_results(base + ":" + run, [&] { return sdgolden::compare_sdxl_run(m, golden_dir, run); }))
            out.push_back(r);
    }
    return out;
}

namespace {

const bool registered_sdxl =
    register_checker({"sdxl", sdgolden::is_sdxl_golden_folder, [](const fs::path& dir, const Context& ctx) {
                          const std::string base = relative_name(dir, ctx);
                          unet::SDModels m;
                          std::vector<CaseResult> out;
                          out.push_back(guarded(base + ":load", [&](Stats& st) {
                              m = unet::load_sd_models(dir.string());
                              st.check_true("family sdxl", m.family == unet::SdFamily::SDXL,
                                            enum_name(unet::sd_family_table(), m.family));
                              st.check_true("force_zeros_for_empty_prompt", m.force_zeros_for_empty_prompt);
                              st.check_true("tokenizer_2 pads with '!' (0)", m.tokenizer_2.pad_id() == 0);
                          }));
                          if (!m.unet) return out;
                          for (auto& r : check_sdxl_models(m, dir, base)) out.push_back(r);
                          return out;
                      }});

// A component folder of a pipeline folder (listed in its model_index.json): it must load, every tensor used.
const bool registered_sdxl_component =
    register_checker({"sd-component",
                      [](const fs::path& d) {
                          const auto parent = d.parent_path();
                          if (!has_file(parent, "model_index.json") || !has_file(d, "config.json")) return false;
                          return sdgolden::read_json_file(parent / "model_index.json").contains(d.filename().string());
                      },
                      [](const fs::path& dir, const Context& ctx) {
                          return std::vector<CaseResult>{guarded(relative_name(dir, ctx) + ":loads", [&](Stats& st) {
                              const std::string cls = config_class(dir);
                              if (cls == "UNet2DConditionModel")
                                  (void)unet::load_unet_folder(dir.string());
                              else if (cls == "AutoencoderKL")
                                  (void)unet::load_vae_folder(dir.string());
                              else if (cls == "SD3Transformer2DModel")
                                  (void)unet::load_sd3_transformer_folder(dir.string());
                              else if (cls == "T5EncoderModel")
                                  (void)unet::load_t5_encoder_folder(dir.string());
                              else if (sdgolden::read_json_file(dir / "config.json").contains("architectures"))
                                  (void)unet::load_text_encoder_folder(dir.string());
                              else
                                  st.fail("component class '" + cls + "' is not a model this build loads");
                          })};
                      }});

} // namespace
} // namespace anchor::golden
