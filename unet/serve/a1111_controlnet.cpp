// sd-webui-controlnet's API units read into ControlParams (see the header).
#include "unet/serve/a1111_controlnet.h"

#include "cache/io/error.h"
#include "cache/serve/http_server.h"
#include "unet/pipeline/control_preprocess.h"
#include "unet/pipeline/infotext.h"
#include "unet/model/unet_perf.h"

#include <cmath>
#include <filesystem>

namespace anchor::unet {

namespace fs = std::filesystem;
using nlohmann::json;

std::map<std::string, std::string> ControlNetLibrary::models() const {
    std::map<std::string, std::string> out;
    std::error_code ec;
    if (dir_.empty() || !fs::is_directory(dir_, ec)) return out;
    for (const auto& e : fs::directory_iterator(dir_, ec)) {
        const auto& p = e.path();
        if (e.is_directory(ec)) {
            if (fs::exists(p / "config.json", ec)) out[p.filename().string()] = p.string();
            continue;
        }
        const auto ext = p.extension().string();
        if (ext == ".safetensors" || ext == ".pth" || ext == ".ckpt" || ext == ".pt") out[p.stem().string()] = p.string();
    }
    return out;
}

std::string ControlNetLibrary::resolve(const std::string& model) const {
    std::string name = model;
    // "control_v11p_sd15_canny [d14c016b]": the extension's listing, the hash in brackets.
    if (const auto b = name.rfind(" ["); b != std::string::npos && name.back() == ']') name = name.substr(0, b);
    const auto all = models();
    if (auto it = all.find(name); it != all.end()) return it->second;
    if (auto it = all.find(fs::path(name).stem().string()); it != all.end() && fs::path(it->second).filename() == name)
        return it->second;
    return "";
}

ControlNetModel ControlNetLibrary::get(const std::string& path, const SDModels& models) {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = loaded_.find(path); it != loaded_.end()) return it->second;
    auto net = load_controlnet(path, models.unet->conv_in->weight.scalar_type());
    match_controlnet_to_unet(net, models); // the UNet's arithmetic and device, as anchor-sd's --control-net
    loaded_.emplace(path, net);
    return net;
}

namespace {

serve::HttpError a1111_unit_error(const std::string& field, const std::string& what) {
    return serve::HttpError(422, field, field + ": " + what);
}

double a1111_unit_number(const json& u, const char* key, double def, double lo, double hi, const std::string& at) {
    if (!u.contains(key) || u[key].is_null()) return def;
    if (!u[key].is_number()) throw a1111_unit_error(at + key, "expected a number, got " + u[key].dump());
    const double v = u[key].get<double>();
    if (!std::isfinite(v) || v < lo || v > hi)
        throw a1111_unit_error(at + key, "must be in [" + infotext_number(lo) + ", " + infotext_number(hi) +
                                             "], got " + u[key].dump());
    return v;
}

} // namespace

std::vector<ControlParams>
a1111_control_units(const json& body, ControlNetLibrary& lib, const SDModels& models,
                    const std::function<torch::Tensor(const std::string& b64, const std::string& field)>& decode,
                    const torch::Tensor& init_image) {
    std::vector<ControlParams> out;
    if (!body.contains("alwayson_scripts") || !body["alwayson_scripts"].is_object()) return out;
    const auto& scripts = body["alwayson_scripts"];
    // The extension registers itself as "controlnet" (clients also send "ControlNet").
    const json* cn = nullptr;
    for (const char* k : {"controlnet", "ControlNet"})
        if (scripts.contains(k)) cn = &scripts[k];
    if (!cn) return out;
    const std::string base = "alwayson_scripts.controlnet.args";
    if (!cn->is_object() || !cn->contains("args") || !(*cn)["args"].is_array())
        throw a1111_unit_error(base, "expected an array of ControlNet units");
    const auto& args = (*cn)["args"];
    for (size_t i = 0; i < args.size(); ++i) {
        const auto& u = args[i];
        const std::string at = base + "[" + std::to_string(i) + "].";
        if (!u.is_object()) throw a1111_unit_error(base + "[" + std::to_string(i) + "]", "expected an object");
        if (u.contains("enabled") && !u["enabled"].is_boolean())
            throw a1111_unit_error(at + "enabled", "expected true or false, got " + u["enabled"].dump());
        if (!u.value("enabled", true)) continue;
        const std::string module = u.contains("module") && u["module"].is_string() ? u["module"].get<std::string>()
                                                                                  : std::string("none");
        ControlPreprocessSpec pre;
        if (module == "canny") { // sd-webui-controlnet's thresholds: threshold_a low, threshold_b high
            pre.kind = ControlPreprocess::Canny;
            pre.low = a1111_unit_number(u, "threshold_a", 100.0, 0.0, 1000.0, at);
            pre.high = a1111_unit_number(u, "threshold_b", 200.0, 0.0, 1000.0, at);
            if (pre.low > pre.high)
                throw a1111_unit_error(at + "threshold_a", "must be <= threshold_b, got " + u["threshold_a"].dump());
        } else if (module != "none") {
            throw a1111_unit_error(at + "module", "'" + module +
                                                      "' is not run by this server (none or canny); send the "
                                                      "preprocessed control image with module \"none\"");
        }
        // control_mode: 0 / "Balanced" as diffusers; 2 / "ControlNet is more important" is diffusers' guess mode
        // (the conditional rows only); 1 / "My prompt is more important" (the extension's per-level scaling) is not.
        bool guess = u.value("guessmode", false) == true;
        if (u.contains("control_mode")) {
            const auto& m = u["control_mode"];
            const std::string s = m.is_string() ? m.get<std::string>() : m.is_number_integer() ? m.dump() : "";
            if (s == "2" || s == "ControlNet is more important")
                guess = true;
            else if (s != "0" && s != "Balanced")
                throw a1111_unit_error(at + "control_mode",
                                       m.dump() + " is not run by this server (0 / \"Balanced\" or 2 / \"ControlNet is "
                                                  "more important\", diffusers' guess mode)");
        }
        ControlParams c;
        c.scale = a1111_unit_number(u, "weight", 1.0, 0.0, 2.0, at);
        c.start = a1111_unit_number(u, "guidance_start", 0.0, 0.0, 1.0, at);
        c.end = a1111_unit_number(u, "guidance_end", 1.0, 0.0, 1.0, at);
        if (c.start >= c.end)
            throw a1111_unit_error(at + "guidance_start", "must be below guidance_end, got " + u["guidance_start"].dump() +
                                                              " and " + (u.contains("guidance_end") ? u["guidance_end"].dump() : "1"));
        c.guess_mode = guess;
        // The image: a base64 string, {"image": ..., "mask": ...} (the mask is the extension's inpaint hint, not run
        // here), or the older field name input_image.
        const json* img = u.contains("image") ? &u["image"] : u.contains("input_image") ? &u["input_image"] : nullptr;
        const std::string img_field = at + (u.contains("image") ? "image" : "input_image");
        if (img && img->is_object()) {
            if (img->contains("mask") && !(*img)["mask"].is_null())
                throw a1111_unit_error(img_field + ".mask", "a ControlNet mask is not run by this server");
            img = img->contains("image") ? &(*img)["image"] : nullptr;
        }
        const bool no_image = !img || img->is_null() || (img->is_string() && img->get<std::string>().empty());
        if (no_image && init_image.defined()) { // img2img: the extension's fallback to the init image
            c.pixels = init_image;
            c.image = "request init_images[0]";
        } else {
            if (!img || !img->is_string() || img->get<std::string>().empty())
                throw a1111_unit_error(at + "image",
                                       init_image.defined()
                                           ? "expected the control image (base64), or none to use the init image"
                                           : "expected the control image (base64)");
            c.pixels = decode(img->get<std::string>(), img_field);
            c.image = "request " + img_field;
        }
        try {
            c.pixels = preprocess_control_image(c.pixels, pre, at + "module");
        } catch (const ParamError& e) {
            throw a1111_unit_error(at + "module", e.detail());
        }
        if (!u.contains("model") || !u["model"].is_string())
            throw a1111_unit_error(at + "model", "expected a model name of GET /controlnet/model_list");
        const std::string model = u["model"].get<std::string>();
        if (lib.empty())
            throw a1111_unit_error(at + "model", "'" + model + "': this server has no --control-net-dir");
        const std::string path = lib.resolve(model);
        if (path.empty()) {
            std::string names;
            for (const auto& [n, p] : lib.models()) names += (names.empty() ? "" : ", ") + n;
            throw a1111_unit_error(at + "model", "'" + model + "' is not in --control-net-dir (" +
                                                     (names.empty() ? std::string("empty") : names) + ")");
        }
        c.source = path;
        try {
            c.net = lib.get(path, models);
        } catch (const std::exception& e) {
            throw a1111_unit_error(at + "model", e.what());
        }
        const std::string mismatch = controlnet_mismatch(*c.net, models.unet->config());
        if (!mismatch.empty()) throw a1111_unit_error(at + "model", mismatch);
        out.push_back(std::move(c));
    }
    return out;
}

} // namespace anchor::unet
