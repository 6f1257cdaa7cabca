#include "unet/pipeline/sd3_record.h"

#include "cache/util/bench.h"

#include <filesystem>
#include <regex>

namespace anchor::unet {

nlohmann::json sd3_run_record(const SD3Txt2ImgParams& p, const SD3Txt2ImgResult& r, const SD3RunInfo& run) {
    const bool negative = !p.negative_prompts.empty();
    return {{"program", "anchor-sd"},
            {"model", run.model},
            {"family", "sd3"},
            {"prompt", p.prompts.empty() ? std::string() : p.prompts.front()},
            {"negative_prompt", negative ? nlohmann::json(p.negative_prompts.front()) : nlohmann::json(nullptr)},
            {"seed", p.seed},
            {"steps", p.steps},
            {"guidance_scale", p.guidance_scale},
            {"width", r.width},
            {"height", r.height},
            {"sampler", "flow_match_euler"},
            {"shift", r.shift},
            {"t5", r.t5},
            {"max_sequence_length", p.max_sequence_length},
            {"slg", p.slg.layers.empty() ? nlohmann::json(nullptr)
                                         : nlohmann::json{{"layers", p.slg.layers},
                                                          {"scale", p.slg.scale},
                                                          {"start", p.slg.start},
                                                          {"end", p.slg.stop}}},
            {"dtype", run.dtype},
            {"threads", run.threads},
            {"load_s", run.load_s},
            {"encode_s", r.encode_s},
            {"denoise_s", r.denoise_s},
            {"decode_s", r.decode_s},
            {"peak_rss_bytes", util::peak_rss_bytes()},
            {"cache_mode", p.cache.label},
            {"init_image", p.init.init_images.empty() ? nlohmann::json(nullptr) : nlohmann::json(p.init.init_images)},
            {"strength", p.init.enabled() ? nlohmann::json(p.init.strength) : nlohmann::json(nullptr)},
            {"loras", lora_records_json(run.loras)},
            {"output", run.output}};
}

Infotext sd3_infotext(const SD3Txt2ImgParams& p, const SD3Txt2ImgResult& r, const std::string& model,
                      const std::vector<LoraApplied>& loras) {
    namespace fs = std::filesystem;
    Infotext info;
    info.prompt = p.prompts.empty() ? std::string() : p.prompts.front();
    info.negative_prompt = p.negative_prompts.empty() ? std::string() : p.negative_prompts.front();
    info.set("Steps", std::to_string(p.steps));
    info.set("Sampler", "Euler");
    info.set("Schedule type", "Simple");
    info.set("CFG scale", infotext_number(p.guidance_scale));
    info.set("Seed", std::to_string(p.seed));
    info.set("Size", std::to_string(r.width) + "x" + std::to_string(r.height));
    info.set("Model", fs::path(model).filename().empty() ? fs::path(model).parent_path().filename().string()
                                                         : fs::path(model).stem().string());
    info.set("Shift", infotext_number(r.shift));
    if (!r.t5) info.set("T5", "off");
    if (!p.slg.layers.empty()) {
        std::string layers;
        for (int l : p.slg.layers) layers += (layers.empty() ? "" : ",") + std::to_string(l);
        info.set("SLG layers", layers);
        info.set("SLG scale", infotext_number(p.slg.scale));
        info.set("SLG start", infotext_number(p.slg.start));
        info.set("SLG end", infotext_number(p.slg.stop));
    }
    if (p.init.enabled()) info.set("Denoising strength", infotext_number(p.init.strength));
    if (!loras.empty()) {
        std::string s;
        for (const auto& l : loras) // A1111 strips ':' and ',' from the alias so that "name: hash, ..." parses
            s += (s.empty() ? "" : ", ") + std::regex_replace(l.name, std::regex("[:,]"), "") + ": " +
                 l.sha256.substr(0, 12);
        info.set("Lora hashes", s);
    }
    if (p.cache.kind() != CacheKind::Off) info.set("Cache", p.cache.label);
    info.set("Version", std::string("AnchorCache ") + ANCHOR_VERSION);
    return info;
}

} // namespace anchor::unet
