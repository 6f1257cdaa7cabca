// Textual-inversion embedding files and the folder of them (A1111's EmbeddingDatabase).
#include "unet/model/embeddings.h"

#include "cache/io/error.h"
#include "cache/io/safetensors.h"
#include "cache/io/sha256.h"
#include "cache/io/torch_checkpoint.h"
#include "unet/model/clip_tokenizer.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <functional>
#include <map>

namespace anchor::unet {

namespace fs = std::filesystem;

int64_t TextualInversion::count() const {
    return sdxl() ? clip_l.size(0) : vectors.size(0);
}

std::string TextualInversion::shape_text() const {
    if (!sdxl()) return shape_str(vectors.sizes().vec());
    return "clip_l " + shape_str(clip_l.sizes().vec()) + ", clip_g " + shape_str(clip_g.sizes().vec());
}

torch::Tensor TextualInversion::for_encoder(size_t encoder, const std::vector<int64_t>& widths) const {
    const int64_t n = count();
    auto expected = [&] {
        if (widths.size() == 1) return shape_str({n, widths[0]});
        std::string s;
        for (size_t i = 0; i < widths.size(); ++i)
            s += std::string(s.empty() ? "" : ", ") + (i == 0 ? "clip_l " : i == 1 ? "clip_g " : "") +
                 shape_str({n, widths[i]});
        return s;
    };
    auto mismatch = [&] {
        return Error("embedding '" + name + "' ('" + file + "') does not fit this model's text encoder" +
                     (widths.size() > 1 ? "s" : "") + ": expected " + expected() + ", the file has " + shape_text() +
                     (sdxl() && widths.size() == 1   ? " (an SDXL embedding)"
                      : !sdxl() && widths.size() > 1 ? " (an SD 1.x / 2.x embedding; SDXL needs clip_l and clip_g)"
                                                     : ""));
    };
    if (encoder >= widths.size() || sdxl() != (widths.size() > 1)) throw mismatch();
    const torch::Tensor& v = !sdxl() ? vectors : encoder == 0 ? clip_l : clip_g;
    for (size_t i = 0; i < widths.size(); ++i) {
        const torch::Tensor& w = !sdxl() ? vectors : i == 0 ? clip_l : clip_g;
        if (w.size(1) != widths[i]) throw mismatch();
    }
    return v;
}

namespace {

// [D] -> [1, D] (diffusers' single-vector concepts), float32; anything else but [N, D] with N, D >= 1 is an error.
torch::Tensor ti_as_vectors(torch::Tensor t, const std::string& path, const std::string& tensor) {
    if (t.dim() == 1) t = t.unsqueeze(0);
    if (t.dim() != 2 || t.size(0) < 1 || t.size(1) < 1)
        throw Error("embedding file '" + path + "': tensor '" + tensor + "' has shape " + shape_str(t.sizes().vec()) +
                    ", expected [vectors, width]");
    if (!t.is_floating_point())
        throw Error("embedding file '" + path + "': tensor '" + tensor + "' is not floating point");
    return t.to(torch::kFloat32).contiguous().clone();
}

std::string ti_lower(std::string s) {
    for (auto& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
    return s;
}

bool ti_embedding_extension(const fs::path& p) {
    const auto e = ti_lower(p.extension().string());
    return e == ".pt" || e == ".bin" || e == ".safetensors";
}

} // namespace

TextualInversion load_textual_inversion(const std::string& path, const std::string& name) {
    TextualInversion e;
    e.file = path;
    e.name = name.empty() ? fs::path(path).stem().string() : name;
    std::error_code ec;
    if (!fs::is_regular_file(path, ec)) throw Error("embedding file '" + path + "' does not exist");
    if (fs::file_size(path, ec) == 0) throw Error("embedding file '" + path + "' is empty");
    // The tensors by name, from either container; what they mean is decided below, the same for both.
    std::vector<std::string> names;
    std::function<torch::Tensor(const std::string&)> get;
    switch (sniff_weight_file(path)) {
    case WeightFileKind::SafeTensors: {
        auto f = SafeTensorsFile::open(path);
        for (const auto& t : f->tensors()) names.push_back(t.name);
        get = [f](const std::string& n) { return f->tensor(n); };
        break;
    }
    case WeightFileKind::TorchZip:
    case WeightFileKind::TorchLegacy: { // the legacy format: TorchCheckpoint says how to convert it
        auto c = TorchCheckpoint::open(path);
        names = c->names();
        get = [c](const std::string& n) { return c->tensor(n); };
        break;
    }
    case WeightFileKind::Other:
        throw Error("embedding file '" + path + "' is neither a safetensors file nor a torch.save archive (corrupt?)");
    }
    auto has = [&](const std::string& n) { return std::find(names.begin(), names.end(), n) != names.end(); };
    auto listing = [&] {
        std::string s;
        for (size_t i = 0; i < names.size() && i < 8; ++i) s += (s.empty() ? "" : ", ") + names[i];
        if (names.size() > 8) s += ", ...";
        return s;
    };
    std::vector<std::string> params; // A1111's string_to_param entries (TorchCheckpoint names nested ones "a.b")
    for (const auto& n : names)
        if (n.rfind("string_to_param.", 0) == 0) params.push_back(n);
    if (has("clip_l") && has("clip_g")) {
        e.clip_l = ti_as_vectors(get("clip_l"), path, "clip_l");
        e.clip_g = ti_as_vectors(get("clip_g"), path, "clip_g");
        if (e.clip_l.size(0) != e.clip_g.size(0))
            throw Error("embedding file '" + path + "': clip_l has " + std::to_string(e.clip_l.size(0)) +
                        " vectors and clip_g " + std::to_string(e.clip_g.size(0)) + ", expected the same count");
    } else if (!params.empty()) {
        if (params.size() != 1)
            throw Error("embedding file '" + path + "' has " + std::to_string(params.size()) +
                        " terms in string_to_param, expected 1");
        e.vectors = ti_as_vectors(get(params[0]), path, params[0]);
    } else if (names.size() == 1) { // emb_params, or a diffusers concept {"<token>": vectors}
        e.vectors = ti_as_vectors(get(names[0]), path, names[0]);
    } else {
        throw Error("embedding file '" + path + "' is not a textual-inversion embedding: expected string_to_param, " +
                    "one tensor (emb_params) or clip_l and clip_g, it has " + std::to_string(names.size()) +
                    " tensors (" + listing() + ")");
    }
    e.sha256 = sha256_file(path);
    return e;
}

void EmbeddingDatabase::add(TextualInversion e) {
    // The tokenizer lower-cases: names that differ in case read as the same tokens, one would hide the other.
    const auto key = ti_lower(e.name);
    for (const auto& o : items_)
        if (ti_lower(o.name) == key)
            throw Error("two embeddings for the token '" + e.name + "': '" + o.file + "' and '" + e.file +
                        "' (rename or remove one; prompts match names case-insensitively, as CLIP's tokenizer)");
    items_.push_back(std::move(e));
}

EmbeddingDatabase EmbeddingDatabase::load_dir(const std::string& dir) {
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) throw Error("embedding folder '" + dir + "' does not exist or is not a folder");
    std::vector<fs::path> files;
    for (auto it = fs::recursive_directory_iterator(dir, fs::directory_options::follow_directory_symlink, ec);
         !ec && it != fs::recursive_directory_iterator(); it.increment(ec))
        if (it->is_regular_file(ec) && ti_embedding_extension(it->path())) files.push_back(it->path());
    if (ec) throw Error("embedding folder '" + dir + "': " + ec.message());
    std::sort(files.begin(), files.end());
    EmbeddingDatabase db;
    db.dir_ = dir;
    for (const auto& f : files) db.add(load_textual_inversion(f.string()));
    return db;
}

const TextualInversion* EmbeddingDatabase::find(const std::string& name) const {
    for (const auto& e : items_)
        if (e.name == name) return &e;
    return nullptr;
}

std::vector<TokenEmbedding> EmbeddingDatabase::lookup(const ClipTokenizer& tok) const {
    std::vector<TokenEmbedding> out;
    for (size_t i = 0; i < items_.size(); ++i) {
        TokenEmbedding t;
        t.ids = tok.encode(items_[i].name);
        if (t.ids.empty()) continue; // a name of only spaces can never be written in a prompt
        t.index = int(i);
        t.vectors = int(items_[i].count());
        out.push_back(std::move(t));
    }
    std::stable_sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.ids.size() > b.ids.size(); });
    return out;
}

} // namespace anchor::unet
