#include "unet/pipeline/infotext.h"
#include "unet/pipeline/hires.h"

#include "cache/io/error.h"
#include "cache/io/sha256.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>

namespace anchor::unet {

namespace fs = std::filesystem;

namespace {

// A1111 names (modules/sd_samplers_kdiffusion.py, sd_samplers_timesteps.py). diffusers' PNDM as SD runs it
// (skip_prk_steps) is the PLMS of the CompVis sampler A1111 lists as "PLMS". "Automatic" is the sampler's default
// schedule, which since A1111 1.9 is Karras for "DPM++ 2M" ({'scheduler': 'karras'}): our plain dpmpp_2m (the
// model's own sigmas) is "Uniform" there. "DPM++ 2M SDE" is k-diffusion's sample_dpmpp_2m_sde (midpoint, eta 1, the
// algorithm of diffusers' sde-dpmsolver++; A1111 draws its noise from a Brownian tree, Gaussian increments over these
// disjoint steps all the same), whose "Automatic" is exponential. "UniPC" is the same predictor-corrector, but
// A1111's settings pick its variant and order (uni_pc_variant, uni_pc_order) where ours come from the scheduler
// config (diffusers' bh2, order 2 by default). A1111's "DPM++ 2S a" is ancestral: not our dpmpp_2s.
const std::vector<std::pair<SamplerKind, A1111Sampler>>& a1111_samplers() {
    static const std::vector<std::pair<SamplerKind, A1111Sampler>> table = {
        {SamplerKind::EulerAncestral, {"Euler a", "Automatic"}},
        {SamplerKind::Euler, {"Euler", "Automatic"}},
        {SamplerKind::DDIM, {"DDIM", "Automatic"}},
        {SamplerKind::PNDM, {"PLMS", "Automatic"}},
        {SamplerKind::DPMPP2M, {"DPM++ 2M", "Uniform"}},
        {SamplerKind::DPMPP2MKarras, {"DPM++ 2M", "Karras"}},
        {SamplerKind::LMS, {"LMS", "Automatic"}},
        {SamplerKind::DPMPP2MSDE, {"DPM++ 2M SDE", "Uniform"}},
        {SamplerKind::UniPC, {"UniPC", "Automatic"}},
        // A1111 has no DDPM or TCD sampler: ComfyUI's and Forge's names, in A1111's spelling.
        {SamplerKind::DDPM, {"DDPM", "Automatic"}},
        {SamplerKind::Heun, {"Heun", "Automatic"}},
        {SamplerKind::KDPM2, {"DPM2", "Automatic"}},
        {SamplerKind::KDPM2Ancestral, {"DPM2 a", "Automatic"}},
        {SamplerKind::LCM, {"LCM", "Automatic"}},
        {SamplerKind::TCD, {"TCD", "Automatic"}},
    };
    return table;
}

// The schedule A1111 runs for `sampler` with schedule type `schedule` ("" when the infotext has none): "Automatic"
// resolves to the sampler's default, a missing field (infotexts before 1.9) to the model's own sigmas.
std::string resolved_schedule(const std::string& sampler, const std::string& schedule) {
    if (schedule.empty()) return "Uniform";
    if (schedule == "Automatic") {
        if (sampler == "DPM++ 2M") return "Karras";
        if (sampler == "DPM++ 2M SDE") return "Exponential"; // A1111's {'scheduler': 'exponential'}
        return "Uniform";
    }
    return schedule;
}

template <class T> std::optional<T> parse_number(const std::string& s) {
    try {
        size_t used = 0;
        T v;
        if constexpr (std::is_same_v<T, double>)
            v = std::stod(s, &used);
        else
            v = T(std::stoll(s, &used));
        if (used != s.size()) return std::nullopt;
        return v;
    } catch (const std::exception&) {
        return std::nullopt;
    }
}

std::string hash_prefix(const std::string& sha, size_t n) {
    return sha.substr(0, std::min(n, sha.size()));
}

// The name a checkpoint is known by: a file's stem, a folder's own name.
std::string model_name_of(const std::string& path) {
    fs::path p = fs::path(path).lexically_normal();
    if (p.filename().empty()) p = p.parent_path();
    return fs::is_directory(p) ? p.filename().string() : p.stem().string();
}

} // namespace

A1111Sampler a1111_sampler(SamplerKind k) {
    for (const auto& [kind, s] : a1111_samplers())
        if (kind == k) return s;
    return {sampler_name(k), "Automatic"};
}

std::optional<SamplerKind> sampler_from_a1111(const std::string& sampler, const std::string& schedule_type) {
    std::string name = sampler, schedule = schedule_type;
    // Before 1.9 the schedule was part of the name: "DPM++ 2M Karras".
    if (name.size() > 7 && name.compare(name.size() - 7, 7, " Karras") == 0) {
        name.resize(name.size() - 7);
        schedule = "Karras";
    }
    schedule = resolved_schedule(name, schedule);
    for (const auto& [kind, s] : a1111_samplers())
        if (s.sampler == name && resolved_schedule(name, s.schedule_type) == schedule) return kind;
    // A sampler A1111 does not have is written under our own name (a1111_sampler): it reads back the same way.
    if (schedule == "Uniform")
        for (const auto& [n, kind] : sampler_table())
            if (n == name && a1111_sampler(kind).sampler == n) return kind;
    return std::nullopt;
}

std::optional<SamplerKind> sampler_from_any_name(const std::string& name, const std::string& schedule_type) {
    if (auto k = sampler_from_a1111(name, schedule_type)) return k;
    auto lookup = [](const std::string& n) -> std::optional<SamplerKind> {
        for (const auto& table : {sampler_table(), sampler_alias_table()})
            for (const auto& [key, kind] : table)
                if (key == n) return kind;
        return std::nullopt;
    };
    if (auto k = lookup(name)) return k;
    // stable-diffusion.cpp's infotext writes its method name and a lower-case " karras" ("dpm++2m karras").
    const std::string suffix = " karras";
    if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
        const auto k = lookup(name.substr(0, name.size() - suffix.size()));
        if (k == SamplerKind::DPMPP2M) return SamplerKind::DPMPP2MKarras;
    }
    return std::nullopt;
}

SamplerKind parse_sampler_name(const std::string& name, const std::string& field) {
    if (auto k = sampler_from_any_name(name, std::string())) return *k;
    throw ParamError(field, "unknown sampler '" + name + "' (choices: " + enum_choices(sampler_table()) +
                                "; or an A1111 name such as 'DPM++ 2M Karras', 'Euler a', 'DPM2 a', or a "
                                "stable-diffusion.cpp / ComfyUI one such as 'dpm++2m', 'dpm_2_ancestral')");
}

void Infotext::set(const std::string& key, const std::string& value) {
    for (auto& [k, v] : fields)
        if (k == key) {
            v = value;
            return;
        }
    fields.emplace_back(key, value);
}

const std::string* Infotext::get(const std::string& key) const {
    for (const auto& [k, v] : fields)
        if (k == key) return &v;
    return nullptr;
}

std::string infotext_quote(const std::string& value) {
    if (value.find_first_of(",:\n") == std::string::npos) return value;
    return nlohmann::json(value).dump(); // json.dumps(ensure_ascii=False): UTF-8 kept, '"', '\\' and controls escaped
}

std::string infotext_number(double v) {
    if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 1e15) {
        char buf[32];
        std::snprintf(buf, sizeof buf, "%lld", (long long)v);
        return buf;
    }
    // Shortest digits that read back as the same double, as Python's repr.
    char buf[40];
    for (int prec = 1; prec <= 17; ++prec) {
        std::snprintf(buf, sizeof buf, "%.*g", prec, v);
        if (std::strtod(buf, nullptr) == v) break;
    }
    return buf;
}

std::string format_infotext(const Infotext& t) {
    std::string params;
    for (const auto& [k, v] : t.fields) params += (params.empty() ? "" : ", ") + k + ": " + infotext_quote(v);
    std::string s =
        t.prompt + (t.negative_prompt.empty() ? "" : "\nNegative prompt: " + t.negative_prompt) + "\n" + params;
    // Python's str.strip(): whitespace at both ends.
    const char* ws = " \t\n\r\f\v";
    const size_t b = s.find_first_not_of(ws);
    return b == std::string::npos ? "" : s.substr(b, s.find_last_not_of(ws) - b + 1);
}

Infotext parse_infotext(const std::string& text) {
    // infotext_utils.re_param: a key of word characters, spaces, '-' or '/', then a quoted value or one up to ','.
    static const std::regex re_param(R"re(\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$))re");
    const char* ws = " \t\n\r\f\v";
    const size_t b = text.find_first_not_of(ws);
    const std::string s = b == std::string::npos ? "" : text.substr(b, text.find_last_not_of(ws) - b + 1);
    std::vector<std::string> lines;
    for (size_t at = 0;;) {
        const size_t nl = s.find('\n', at);
        lines.push_back(s.substr(at, nl == std::string::npos ? std::string::npos : nl - at));
        if (nl == std::string::npos) break;
        at = nl + 1;
    }
    std::string last = lines.back();
    lines.pop_back();
    const auto n_params = std::distance(std::sregex_iterator(last.begin(), last.end(), re_param), {});
    if (n_params < 3) {
        lines.push_back(last);
        last.clear();
    }
    Infotext t;
    bool negative = false;
    for (auto line : lines) {
        const size_t lb = line.find_first_not_of(ws);
        line = lb == std::string::npos ? "" : line.substr(lb, line.find_last_not_of(ws) - lb + 1);
        if (line.rfind("Negative prompt:", 0) == 0) {
            negative = true;
            line = line.substr(16);
            const size_t nb = line.find_first_not_of(ws);
            line = nb == std::string::npos ? "" : line.substr(nb, line.find_last_not_of(ws) - nb + 1);
        }
        std::string& into = negative ? t.negative_prompt : t.prompt;
        into += (into.empty() ? "" : "\n") + line;
    }
    for (std::sregex_iterator it(last.begin(), last.end(), re_param), end; it != end; ++it) {
        std::string v = (*it)[2].str();
        if (v.size() >= 2 && v.front() == '"' && v.back() == '"') {
            const auto j = nlohmann::json::parse(v, nullptr, false);
            if (j.is_string()) v = j.get<std::string>(); // infotext_utils.unquote keeps what json.loads refuses
        }
        t.set((*it)[1].str(), v);
    }
    return t;
}

InfotextFacts infotext_facts(const SDModels& models, const std::string& cache_mode) {
    InfotextFacts f;
    if (!models.weights_file.empty()) f.model_hash = hash_prefix(sha256_file(models.weights_file), 10);
    f.model_name = model_name_of(models.source);
    for (const auto& l : models.loras)
        // A1111 strips ':' and ',' from the alias so that "name: hash, ..." stays parseable.
        f.lora_hashes.emplace_back(std::regex_replace(l.name, std::regex("[:,]"), ""), hash_prefix(l.sha256, 12));
    f.cache_mode = cache_mode;
    f.version = std::string("AnchorCache ") + ANCHOR_VERSION;
    return f;
}

Infotext infotext_of(const Txt2ImgParams& p, int image, const InfotextFacts& facts) {
    Infotext t;
    const size_t prompt = size_t(image / std::max(p.images_per_prompt, 1));
    t.prompt = p.prompts.at(prompt);
    t.negative_prompt = Txt2ImgPipeline::negatives_of(p).at(prompt);
    const auto sampler = a1111_sampler(p.sampler);
    t.set("Steps", std::to_string(p.steps));
    t.set("Sampler", sampler.sampler);
    // An explicit --schedule is the schedule type A1111 names the same way (dpmpp_2m_karras is Karras already).
    const bool own_schedule = p.schedule && *p.schedule != NoiseSchedule::Default;
    t.set("Schedule type", own_schedule ? noise_schedule_label(*p.schedule) : sampler.schedule_type);
    t.set("CFG scale", infotext_number(p.guidance_scale));
    t.set("Seed", std::to_string(p.seed));
    t.set("Size", std::to_string(p.width) + "x" + std::to_string(p.height));
    if (!facts.model_hash.empty()) t.set("Model hash", facts.model_hash);
    if (!facts.model_name.empty()) t.set("Model", facts.model_name);
    if (p.init.enabled()) t.set("Denoising strength", infotext_number(p.init.strength));
    if (p.hires.enabled) t.set("Denoising strength", infotext_number(p.hires.denoise)); // the second pass's
    // Ours counts from 0 = last layer (diffusers); A1111's CLIP_stop_at_last_layers from 1 = last.
    if (p.clip_skip + 1 > 1) t.set("Clip skip", std::to_string(p.clip_skip + 1));
    if (!facts.lora_hashes.empty()) {
        std::string s;
        for (const auto& [name, hash] : facts.lora_hashes) s += (s.empty() ? "" : ", ") + name + ": " + hash;
        t.set("Lora hashes", s);
    }
    // sd-webui-controlnet's per-unit field (its Script.infotext fields), our resize being its "Just Resize".
    for (size_t i = 0; i < p.control.size(); ++i) {
        const auto& c = p.control[i];
        const std::string hash = a1111_legacy_hash(c.source);
        t.set("ControlNet " + std::to_string(i),
              "Module: none, Model: " + model_name_of(c.source) + (hash.empty() ? "" : " [" + hash + "]") +
                  ", Weight: " + infotext_number(c.scale) + ", Resize Mode: Just Resize, Low Vram: False, Guidance "
                  "Start: " + infotext_number(c.start) + ", Guidance End: " + infotext_number(c.end) +
                  ", Pixel Perfect: False, Control Mode: " +
                  (c.guess_mode ? "ControlNet is more important" : "Balanced"));
    }
    add_hires_infotext(p.hires, t); // unet/pipeline/hires.h
    if (!facts.ti_hashes.empty()) {
        std::string s;
        for (const auto& [name, hash] : facts.ti_hashes) s += (s.empty() ? "" : ", ") + name + ": " + hash;
        t.set("TI hashes", s);
    }
    // A1111 writes the eta of DDIM ("Eta DDIM") and of the ancestral samplers ("Eta") when it is not their default.
    if (p.sampler == SamplerKind::DDIM && p.eta.value_or(0.0) != 0) t.set("Eta DDIM", infotext_number(*p.eta));
    if (p.sampler == SamplerKind::EulerAncestral && p.eta.value_or(1.0) != 1) t.set("Eta", infotext_number(*p.eta));
    if (facts.cache_mode != "off" && !facts.cache_mode.empty()) t.set("AnchorCache", facts.cache_mode);
    if (!facts.version.empty()) t.set("Version", facts.version);
    return t;
}

std::vector<PngTextChunk> image_text_chunks(const Infotext& t, const nlohmann::json& record) {
    return {png_text(kInfotextKeyword, format_infotext(t)), png_itext(kRecordKeyword, record.dump())};
}

ImageParameters image_parameters_from_record(const nlohmann::json& r, const std::string& what) {
    ImageParameters ip;
    ip.source = kRecordKeyword;
    if (!r.is_object()) throw Error(what + ": the JSON record is not an object");
    try {
        auto str = [&](const char* k, std::optional<std::string>& out) {
            if (r.contains(k) && r[k].is_string()) out = r[k].get<std::string>();
        };
        str("prompt", ip.prompt);
        str("negative_prompt", ip.negative_prompt);
        str("cache_mode", ip.cache_mode);
        if (r.contains("steps")) ip.steps = r["steps"].get<int>();
        if (r.contains("width")) ip.width = r["width"].get<int>();
        if (r.contains("height")) ip.height = r["height"].get<int>();
        if (r.contains("clip_skip") && r["clip_skip"].get<int>() > 0) ip.clip_skip = r["clip_skip"].get<int>();
        if (r.contains("cfg_scale")) ip.cfg_scale = r["cfg_scale"].get<double>();
        if (r.contains("eta") && !r["eta"].is_null()) ip.eta = r["eta"].get<double>();
        if (r.contains("prompt_syntax") && r["prompt_syntax"].is_string())
            for (const auto& [name, s] : prompt_syntax_table())
                if (name == r["prompt_syntax"].get<std::string>()) ip.prompt_syntax = s;
        if (r.contains("schedule") && r["schedule"].is_string())
            for (const auto& [name, s] : noise_schedule_table())
                if (name == r["schedule"].get<std::string>()) ip.schedule = s;
        if (r.contains("seed")) ip.seed = r["seed"].get<int64_t>();
        if (r.contains("timestep_spacing") && r["timestep_spacing"].is_string()) {
            const auto s = r["timestep_spacing"].get<std::string>();
            for (const auto& [name, v] : timestep_spacing_table())
                if (name == s) ip.timestep_spacing = v;
            if (!ip.timestep_spacing) ip.notes.push_back("timestep_spacing '" + s + "' is unknown here; not applied");
        }
        if (r.contains("vae_decoder")) {
            const auto s = r["vae_decoder"].get<std::string>();
            if (s == "taesd" || s == "full")
                ip.vae_decoder = s == "taesd" ? VaeDecoder::Taesd : VaeDecoder::Full;
            else
                ip.notes.push_back("vae_decoder '" + s + "' is unknown here; not applied");
        }
        if (r.contains("vae_tiling") && r["vae_tiling"].is_object()) {
            VaeTiling t;
            t.enabled = true;
            t.tile_sample_size = r["vae_tiling"].value("tile_size", t.tile_sample_size);
            t.overlap = r["vae_tiling"].value("overlap", t.overlap);
            ip.vae_tiling = t;
        }
        if (r.contains("sampler")) {
            const auto s = r["sampler"].get<std::string>();
            ip.sampler = sampler_from_any_name(s, std::string());
            if (!ip.sampler) ip.notes.push_back("sampler '" + s + "' is unknown here; not applied");
        }
        if (r.value("mode", "txt2img") != "txt2img") {
            if (r.contains("strength")) ip.strength = r["strength"].get<double>();
            if (r.contains("init_image")) ip.init_image = r["init_image"].value("file", "");
            if (r.contains("mask")) ip.mask = r["mask"].value("file", "");
        }
        if (r.value("batch_size", 1) > 1)
            ip.notes.push_back("the image was image " + std::to_string(r.value("index_in_batch", 0)) +
                               " of a batch of " + std::to_string(r["batch_size"].get<int>()) +
                               " drawn from one generator; run alone it is the batch's first image");
        for (const auto& c : r.value("controlnets", nlohmann::json::array())) {
            ImageParameters::ControlUnit u;
            u.module = "none";
            u.model = c.value("model", std::string());
            if (c.contains("image") && c["image"].is_string()) u.image = c["image"].get<std::string>();
            u.weight = c.value("scale", 1.0);
            u.start = c.value("start", 0.0);
            u.end = c.value("end", 1.0);
            u.guess_mode = c.value("guess_mode", false);
            ip.control.push_back(u);
        }
        if (r.contains("hires") && r["hires"].is_object()) ip.hires = hires_from_record(r["hires"]);
        for (const auto& t : r.value("textual_inversion", nlohmann::json::array()))
            ip.ti_hashes.emplace_back(t.value("name", std::string()), t.value("hash", std::string()));
        for (const auto& l : r.value("loras", nlohmann::json::array()))
            ip.notes.push_back("made with LoRA '" + l.value("file", std::string("?")) + "' x " +
                               infotext_number(l.value("multiplier", 1.0)) + ": not applied (give --lora)");
    } catch (const nlohmann::json::exception& e) {
        throw Error(what + ": malformed JSON record: " + e.what());
    }
    return ip;
}

namespace {
// "Key: value, Key: value" (a ControlNet unit's fields), split at each ", " and each entry's first ": ".
std::vector<std::pair<std::string, std::string>> parse_name_values(const std::string& value) {
    std::vector<std::pair<std::string, std::string>> out;
    size_t begin = 0;
    while (begin < value.size()) {
        size_t end = value.find(", ", begin);
        if (end == std::string::npos) end = value.size();
        const std::string item = value.substr(begin, end - begin);
        const size_t colon = item.find(": ");
        if (colon != std::string::npos) out.emplace_back(item.substr(0, colon), item.substr(colon + 2));
        begin = end + 2;
    }
    return out;
}
} // namespace

ImageParameters image_parameters_from_infotext(const std::string& text, const std::string& what) {
    const Infotext t = parse_infotext(text);
    ImageParameters ip;
    ip.source = kInfotextKeyword;
    ip.prompt = t.prompt;
    ip.negative_prompt = t.negative_prompt;
    ip.prompt_syntax = PromptSyntax::A1111;
    std::vector<std::string> ignored;
    std::string sampler, schedule;
    try {
        ip.hires = hires_from_infotext(t, ip.notes); // unet/pipeline/hires.h
    } catch (const Error& e) {
        throw Error(what + ": " + e.what());
    }
    for (const auto& [k, v] : t.fields) {
        const auto bad = [&, k = k, v = v](const char* expected) {
            return Error(what + ": infotext field '" + k + "' is '" + v + "', expected " + expected);
        };
        if (k == "Steps") {
            if (!(ip.steps = parse_number<int>(v))) throw bad("an integer");
        } else if (k == "Sampler") {
            sampler = v;
        } else if (k == "Schedule type") {
            schedule = v;
        } else if (k == "CFG scale") {
            if (!(ip.cfg_scale = parse_number<double>(v))) throw bad("a number");
        } else if (k == "Seed") {
            if (!(ip.seed = parse_number<int64_t>(v))) throw bad("an integer");
        } else if (k == "Size") {
            const size_t x = v.find('x');
            const auto w = parse_number<int>(v.substr(0, x)),
                       h = x == std::string::npos ? std::nullopt : parse_number<int>(v.substr(x + 1));
            if (!w || !h) throw bad("WIDTHxHEIGHT");
            ip.width = w, ip.height = h;
        } else if (k == "Clip skip") {
            if (!(ip.clip_skip = parse_number<int>(v))) throw bad("an integer");
        } else if (k == "Denoising strength") {
            if (!(ip.strength = parse_number<double>(v))) throw bad("a number");
        } else if (k == "Eta DDIM" || k == "Eta") {
            if (!(ip.eta = parse_number<double>(v))) throw bad("a number");
        } else if (ip.hires && (k == "Hires upscale" || k == "Hires resize" || k == "Hires steps" ||
                                k == "Hires upscaler")) {
            // read by hires_from_infotext
        } else if (k == "AnchorCache") {
            ip.cache_mode = v;
        } else if (k == "TI hashes") {
            ip.ti_hashes = parse_name_hashes(v);
        } else if (k.rfind("ControlNet ", 0) == 0 && parse_number<int>(k.substr(11)) &&
                   *parse_number<int>(k.substr(11)) >= 0 && *parse_number<int>(k.substr(11)) < 64) {
            ImageParameters::ControlUnit u;
            for (const auto& [key, val] : parse_name_values(v)) {
                const auto num = parse_number<double>(val);
                if (key == "Module") u.module = val;
                else if (key == "Model") u.model = val;
                else if (key == "Control Mode") u.guess_mode = val == "ControlNet is more important";
                else if ((key == "Weight" || key == "Guidance Start" || key == "Guidance End") && !num)
                    throw bad("numbers for Weight, Guidance Start and Guidance End");
                else if (key == "Weight") u.weight = *num;
                else if (key == "Guidance Start") u.start = *num;
                else if (key == "Guidance End") u.end = *num;
            }
            const size_t n = size_t(*parse_number<int>(k.substr(11)));
            if (ip.control.size() <= n) ip.control.resize(n + 1);
            ip.control[n] = u;
        } else {
            ignored.push_back(k);
        }
    }
    if (ip.hires) ip.strength.reset(); // the Denoising strength is the hires pass's
    if (!sampler.empty()) {
        ip.sampler = sampler_from_any_name(sampler, schedule);
        // Any other sampler with a schedule type of ours: that sampler on that schedule.
        for (const auto& [name, s] : noise_schedule_table())
            if (!ip.sampler && s != NoiseSchedule::Default && noise_schedule_label(s) == schedule) {
                ip.sampler = sampler_from_a1111(sampler, "Uniform"); // the sampler on its own spacing
                if (ip.sampler) ip.schedule = s;
            }
        if (!ip.sampler)
            ip.notes.push_back("sampler '" + sampler + (schedule.empty() ? "" : "' with schedule '" + schedule) +
                               "' has no equivalent here; not applied");
    }
    if (!ignored.empty()) {
        std::string s;
        for (const auto& k : ignored) s += (s.empty() ? "" : ", ") + k;
        ip.notes.push_back("fields not applied: " + s);
    }
    return ip;
}

std::string a1111_legacy_hash(const std::string& path) {
    std::error_code ec;
    if (path.empty() || !fs::is_regular_file(path, ec)) return "";
    std::ifstream in(path, std::ios::binary);
    in.seekg(0x100000);
    std::string block(0x10000, '\0');
    in.read(&block[0], std::streamsize(block.size()));
    block.resize(size_t(std::max<std::streamsize>(in.gcount(), 0)));
    return sha256_hex(block).substr(0, 8);
}

std::vector<std::pair<std::string, std::string>> parse_name_hashes(const std::string& value) {
    std::vector<std::pair<std::string, std::string>> out;
    size_t begin = 0;
    auto trim = [](std::string x) {
        const auto a = x.find_first_not_of(' '), b = x.find_last_not_of(' ');
        return a == std::string::npos ? std::string() : x.substr(a, b - a + 1);
    };
    while (begin <= value.size()) {
        const size_t end = std::min(value.find(',', begin), value.size());
        const std::string item = value.substr(begin, end - begin);
        const size_t colon = item.rfind(':');
        if (colon != std::string::npos && !trim(item.substr(0, colon)).empty())
            out.emplace_back(trim(item.substr(0, colon)), trim(item.substr(colon + 1)));
        begin = end + 1;
    }
    return out;
}

ImageParameters read_image_parameters(const std::string& png) {
    const auto chunks = read_png_text_chunks(png);
    if (const auto* c = find_png_text(chunks, kRecordKeyword)) {
        const auto j = nlohmann::json::parse(c->text, nullptr, false);
        if (j.is_discarded()) throw Error("'" + png + "': the '" + kRecordKeyword + "' chunk is not valid JSON");
        return image_parameters_from_record(j, "'" + png + "'");
    }
    if (const auto* c = find_png_text(chunks, kInfotextKeyword))
        return image_parameters_from_infotext(c->text, "'" + png + "'");
    throw Error("'" + png + "' has no generation parameters: neither an '" + std::string(kRecordKeyword) + "' nor a '" +
                kInfotextKeyword + "' text chunk");
}

} // namespace anchor::unet
