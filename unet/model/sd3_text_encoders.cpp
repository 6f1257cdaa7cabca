// SD 3 / 3.5 single-file text encoders (unet/model/sd3_text_encoders.h).
#include "unet/model/sd3_text_encoders.h"

#include "cache/io/error.h"
#include "cache/io/safetensors.h"
#include "cache/io/weight_map.h"
#include "unet/model/checkpoint.h"

#include <filesystem>

namespace anchor::unet {

namespace fs = std::filesystem;

namespace {

struct Sd3RoleInfo {
    Sd3TextRole role;
    const char* label;     // for messages
    const char* folder;    // a diffusers folder's component
    const char* file_stem; // Stability's text_encoders/ file (clip_l.safetensors, t5xxl_fp16.safetensors, ...)
};
const Sd3RoleInfo kSd3Roles[] = {{Sd3TextRole::ClipL, "CLIP-L", "text_encoder", "clip_l"},
                                 {Sd3TextRole::ClipG, "CLIP-G (OpenCLIP bigG)", "text_encoder_2", "clip_g"},
                                 {Sd3TextRole::T5xxl, "T5-XXL", "text_encoder_3", "t5xxl"}};

// `<stem>.safetensors`, `<stem>_fp16.safetensors` (Stability's text_encoders/ ships t5xxl_fp16 next to
// t5xxl_fp8_e4m3fn: the exact one is preferred), else the one `<stem>*.safetensors` in `dir` (empty when none; an
// error when several could be meant).
std::string sd3_role_file(const std::string& dir, const std::string& stem) {
    if (dir.empty() || !fs::is_directory(dir)) return "";
    for (const char* tail : {".safetensors", "_fp16.safetensors"})
        if (fs::is_regular_file(fs::path(dir) / (stem + tail))) return (fs::path(dir) / (stem + tail)).string();
    std::vector<std::string> hits;
    for (const auto& e : fs::directory_iterator(dir)) {
        const std::string name = e.path().filename().string();
        if (e.is_regular_file() && e.path().extension() == ".safetensors" && name.rfind(stem, 0) == 0)
            hits.push_back(e.path().string());
    }
    if (hits.size() > 1) {
        std::string list;
        for (const auto& h : hits) list += " '" + h + "'";
        throw Error("text encoder folder '" + dir + "' has several " + stem + "*.safetensors files:" + list +
                    "; keep one");
    }
    return hits.empty() ? "" : hits.front();
}

ClipTokenizer sd3_clip_tokenizer(const std::string& dir, const char* sub, int64_t pad) {
    const fs::path t = dir.empty() ? fs::path() : fs::path(dir) / sub;
    if (!t.empty() && fs::exists(t / "vocab.json")) return ClipTokenizer::from_folder(t.string());
    ClipTokenizer tok = ClipTokenizer::bundled();
    tok.set_pad_id(pad);
    if (!t.empty() && fs::is_directory(t)) tok.read_special_tokens(t.string());
    return tok;
}

// `dir`'s config.json of the role's diffusers component, empty when there is none.
std::string sd3_role_config(const std::string& dir, const Sd3RoleInfo& r) {
    if (dir.empty()) return "";
    const fs::path c = fs::path(dir) / r.folder / "config.json";
    return fs::exists(c) ? c.string() : "";
}

ClipTextModel sd3_clip_from_weights(WeightMap w, const Sd3RoleInfo& r, const std::string& config,
                                    const std::string& where) {
    ClipTextConfig c = config.empty() ? ClipTextConfig::detect_from_weights(w) : ClipTextConfig::from_json_file(config);
    if (r.role == Sd3TextRole::ClipL) {
        // Stability's files carry no CLIP-L projection that SD 3 uses: diffusers puts torch.eye(hidden) in its place,
        // ComfyUI takes the unprojected pooled output; the same numbers.
        if (config.empty()) c.projection_dim = c.hidden_size;
        if (c.projection_dim != c.hidden_size)
            throw Error(where + ": CLIP-L's projection is the identity in a single file, but '" + config +
                        "' says projection_dim " + std::to_string(c.projection_dim) + " (hidden_size " +
                        std::to_string(c.hidden_size) + ")");
        WeightMap with_eye;
        for (const auto& [n, t] : w.all())
            if (n != "text_projection.weight") with_eye.insert(n, t, w.source(n));
        with_eye.keep_files_of(w);
        with_eye.insert("text_projection.weight", torch::eye(c.hidden_size), "identity (CLIP-L of a single file)");
        w = std::move(with_eye);
    } else if (config.empty()) {
        c.hidden_act = "gelu"; // OpenCLIP bigG (shapes cannot tell; ClipTextConfig guesses quick_gelu below 1024)
        if (!w.has("text_projection.weight"))
            throw Error(where + ": CLIP-G has no text_projection.weight (SD 3's pooled embedding needs it)");
    }
    ClipTextModel m(c);
    m->load(w);
    return m;
}

// Loads one role; returns a description of the source, empty when no place has it.
std::string sd3_load_role(const WeightMap& file, const std::string& path, const std::string& dir, const Sd3RoleInfo& r,
                          torch::ScalarType dtype, SD3TextEncoders& out) {
    const std::string prefix = sd3_text_encoder_prefix(r.role);
    const std::string config = sd3_role_config(dir, r);
    auto finish_clip = [&](ClipTextModel m) {
        m->eval();
        if (dtype != torch::kFloat) m->to(dtype);
        (r.role == Sd3TextRole::ClipL ? out.text_encoder : out.text_encoder_2) = m;
    };
    auto finish_t5 = [&](T5EncoderModel m) {
        m->eval();
        if (dtype != torch::kFloat) m->to(dtype);
        out.text_encoder_3 = m;
    };
    auto from_weights = [&](const WeightMap& w, const std::string& where) {
        if (r.role == Sd3TextRole::T5xxl) {
            T5EncoderModel m(config.empty() ? T5EncoderConfig::detect_from_weights(w)
                                            : T5EncoderConfig::from_json_file(config));
            m->load(w);
            finish_t5(m);
        } else {
            finish_clip(sd3_clip_from_weights(w, r, config, where));
        }
    };
    bool in_file = false;
    for (const auto& [n, t] : file.all())
        if (n.rfind(prefix, 0) == 0) {
            in_file = true;
            break;
        }
    if (in_file) {
        WeightMap w = file.with_prefix_stripped(prefix);
        w.keep_files_of(file);
        from_weights(w, "'" + path + "' (" + prefix + "*)");
        return "'" + path + "'" + (config.empty() ? "" : " with " + config);
    }
    if (dir.empty()) return "";
    const fs::path folder = fs::path(dir) / r.folder;
    if (fs::is_directory(folder)) {
        if (r.role == Sd3TextRole::T5xxl)
            finish_t5(load_t5_encoder_folder(folder.string(), dtype));
        else
            finish_clip(load_text_encoder_folder(folder.string(), dtype));
        return "'" + folder.string() + "'";
    }
    const std::string f = sd3_role_file(dir, r.file_stem);
    if (f.empty()) return "";
    const WeightMap w = WeightMap::load(f);
    check_sd3_single_file_weights(w, f);
    from_weights(w, "'" + f + "'");
    return "'" + f + "'";
}

} // namespace

std::string sd3_text_encoder_prefix(Sd3TextRole role) {
    switch (role) {
    case Sd3TextRole::ClipL:
        return "text_encoders.clip_l.transformer.";
    case Sd3TextRole::ClipG:
        return "text_encoders.clip_g.transformer.";
    case Sd3TextRole::T5xxl:
        return "text_encoders.t5xxl.transformer.";
    }
    return "";
}

void check_sd3_single_file_weights(const WeightMap& file, const std::string& path) {
    for (const auto& [n, t] : file.all()) {
        const bool marker = n == "scaled_fp8" || (n.size() >= 11 && n.compare(n.size() - 11, 11, ".scaled_fp8") == 0);
        const bool scale = n.size() >= 13 && (n.compare(n.size() - 13, 13, ".scale_weight") == 0);
        if (marker || scale)
            throw Error("'" + path + "': tensor '" + n + "' (" + std::string(c10::toString(t.scalar_type())) +
                        ") marks ComfyUI's scaled fp8 weights (F8_E4M3 values times a per-tensor scale_weight), "
                        "which this loader does not read; use the f16 / bf16 file, or plain F8_E4M3 weights");
    }
}

SD3TextEncoders load_sd3_text_encoders(const WeightMap& file, const std::string& path, const std::string& dir,
                                       torch::ScalarType dtype, bool load_t5) {
    if (!dir.empty() && !fs::is_directory(dir)) throw Error("text encoder folder '" + dir + "' does not exist");
    SD3TextEncoders out;
    std::vector<std::string> errors;
    for (const auto& r : kSd3Roles) {
        if (r.role == Sd3TextRole::T5xxl && !load_t5) continue;
        try {
            const std::string from = sd3_load_role(file, path, dir, r, dtype, out);
            if (!from.empty()) out.sources.push_back(std::string(r.label) + ": " + from);
        } catch (const std::exception& e) {
            errors.push_back(std::string(r.label) + ": " + e.what());
        }
    }
    if (!errors.empty()) {
        std::string msg = "'" + path + "': " + std::to_string(errors.size()) + " text encoder(s) do not load:";
        for (const auto& e : errors) msg += "\n" + e;
        throw Error(msg);
    }
    const std::string looked = "'" + path + "' (" + sd3_text_encoder_prefix(Sd3TextRole::ClipL) + "*, " +
                               sd3_text_encoder_prefix(Sd3TextRole::ClipG) + "*)" +
                               (dir.empty() ? std::string(" and no --text-encoders folder")
                                            : " and '" + dir +
                                                  "' (text_encoder/, text_encoder_2/, clip_l.safetensors, "
                                                  "clip_g.safetensors)");
    if (bool(out.text_encoder) != bool(out.text_encoder_2))
        throw Error(std::string("SD 3 needs both CLIP encoders; ") + (out.text_encoder ? "CLIP-G" : "CLIP-L") +
                    " is in neither " + looked);
    out.tokenizer = sd3_clip_tokenizer(dir, "tokenizer", ClipTokenizer::kEos);
    out.tokenizer_2 = sd3_clip_tokenizer(dir, "tokenizer_2", 0);
    if (out.text_encoder_3) {
        const fs::path t3 = dir.empty() ? fs::path() : fs::path(dir) / "tokenizer_3";
        if (!t3.empty() && fs::exists(t3 / "spiece.model"))
            out.tokenizer_3 = T5Tokenizer::from_folder(t3.string());
        else if (!dir.empty() && fs::exists(fs::path(dir) / "spiece.model"))
            out.tokenizer_3 = T5Tokenizer::from_folder(dir);
        else
            throw Error("'" + path + "' holds T5-XXL (" + sd3_text_encoder_prefix(Sd3TextRole::T5xxl) +
                        "*) but no T5 tokenizer comes with it: give --text-encoders DIR with tokenizer_3/spiece.model "
                        "(an SD 3 diffusers folder) or spiece.model, or run with --no-t5" +
                        (dir.empty() ? std::string() : " ('" + dir + "' has neither)"));
    }
    return out;
}

} // namespace anchor::unet
