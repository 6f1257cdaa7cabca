#include "cache/io/model_source.h"

#include "cache/io/error.h"
#include "cache/io/safetensors.h"
#include "cache/io/torch_checkpoint.h"
#include "cache/io/weight_map.h"
#include "cache/util/strings.h"

#include <algorithm>
#include <filesystem>
#include <fstream>

namespace anchor {

namespace fs = std::filesystem;

const EnumTable<ModelLayout>& model_layout_table() {
    static const EnumTable<ModelLayout> t = {{"single-file", ModelLayout::WeightsFile},
                                             {"sharded", ModelLayout::ShardedIndex},
                                             {"weights-folder", ModelLayout::WeightsFolder},
                                             {"diffusers", ModelLayout::DiffusersPipeline},
                                             {"diffusers-component", ModelLayout::DiffusersComponent}};
    return t;
}

const EnumTable<ModelArch>& model_arch_table() {
    static const EnumTable<ModelArch> t = {{"unknown", ModelArch::Unknown},
                                           {"stable-diffusion", ModelArch::StableDiffusion},
                                           {"unet2d-condition", ModelArch::UNet2DCondition},
                                           {"autoencoder-kl", ModelArch::AutoencoderKL},
                                           {"clip-text", ModelArch::ClipText},
                                           {"gpt2", ModelArch::Gpt2},
                                           {"masked-diffusion-lm", ModelArch::MaskedDiffusionLM}};
    return t;
}

namespace {

nlohmann::json read_json(const fs::path& p) {
    std::ifstream f(p);
    if (!f) throw Error("cannot open '" + p.string() + "'");
    try {
        return nlohmann::json::parse(f);
    } catch (const nlohmann::json::exception& e) {
        throw Error("cannot parse '" + p.string() + "': " + e.what());
    }
}

// The architecture a config names: diffusers' _class_name, Hugging Face's architectures / model_type.
ModelArch arch_of_config(const nlohmann::json& j) {
    if (!j.is_object()) return ModelArch::Unknown;
    const std::string cls = j.value("_class_name", std::string());
    if (cls.find("StableDiffusion") != std::string::npos) return ModelArch::StableDiffusion;
    if (cls == "UNet2DConditionModel") return ModelArch::UNet2DCondition;
    if (cls == "AutoencoderKL") return ModelArch::AutoencoderKL;
    const std::string type = j.value("model_type", std::string());
    if (type == "gpt2") return ModelArch::Gpt2;
    if (type == "mdlm") return ModelArch::MaskedDiffusionLM;
    if (j.contains("architectures") && j["architectures"].is_array())
        for (const auto& a : j["architectures"]) {
            if (!a.is_string()) continue;
            const std::string s = a.get<std::string>();
            if (s.rfind("CLIPTextModel", 0) == 0) return ModelArch::ClipText;
            if (s.rfind("GPT2", 0) == 0) return ModelArch::Gpt2;
        }
    if (type == "clip_text_model") return ModelArch::ClipText;
    return ModelArch::Unknown;
}

bool is_torch_file(const std::string& f) {
    const WeightFileKind k = sniff_weight_file(f);
    return k == WeightFileKind::TorchZip || (has_torch_extension(f) && k != WeightFileKind::SafeTensors);
}

// The tensor names of a weights file without reading the data (a safetensors header, a torch.save pickle).
std::vector<std::string> tensor_names(const std::string& f) {
    if (is_torch_file(f)) return TorchCheckpoint::open(f)->names();
    std::vector<std::string> out;
    const auto st = SafeTensorsFile::open(f); // header only; kept alive while its names are copied
    for (const auto& t : st->tensors()) out.push_back(t.name);
    return out;
}

// The architecture tensor names give away (a file without a config).
ModelArch arch_of_tensors(const std::vector<std::string>& files) {
    for (const auto& f : files) {
        for (const auto& n : tensor_names(f)) {
            if (n.rfind("model.diffusion_model.", 0) == 0) return ModelArch::StableDiffusion;
            if (n == "wte.weight" || n == "transformer.wte.weight") return ModelArch::Gpt2;
            if (n == "vocab_embed.embedding" || n == "backbone.vocab_embed.embedding")
                return ModelArch::MaskedDiffusionLM;
        }
    }
    return ModelArch::Unknown;
}

// A diffusers component's weights: the standard names first (index, then file; the plain before the .fp16 variant),
// else the one .safetensors file of the folder, else the standard torch.save names (.bin).
void component_weights(const fs::path& dir, ModelSource& s) {
    for (const char* base : {"diffusion_pytorch_model", "model"})
        for (const char* variant : {"", ".fp16"}) {
            const std::string b = std::string(base) + variant;
            if (fs::exists(dir / (b + ".safetensors.index.json"))) {
                s.index_file = (dir / (b + ".safetensors.index.json")).string();
                return;
            }
            if (fs::exists(dir / (b + ".safetensors"))) {
                s.weight_files = {(dir / (b + ".safetensors")).string()};
                return;
            }
        }
    std::vector<std::string> found;
    bool pickle = false;
    for (const auto& e : fs::directory_iterator(dir)) {
        if (e.path().extension() == ".safetensors") found.push_back(e.path().string());
        if (e.path().extension() == ".bin" || e.path().extension() == ".ckpt") pickle = true;
    }
    if (found.size() == 1) {
        s.weight_files = found;
        return;
    }
    if (found.empty())
        for (const char* b : {"diffusion_pytorch_model.bin", "pytorch_model.bin", "model.bin",
                              "diffusion_pytorch_model.fp16.bin", "pytorch_model.fp16.bin"})
            if (fs::exists(dir / b)) {
                s.weight_files = {(dir / b).string()};
                return;
            }
    throw Error("no safetensors weights in '" + dir.string() + "'" +
                (pickle ? " (its .bin/.ckpt files do not have the standard names: name the file)" : "") +
                (found.size() > 1 ? " (several unrelated .safetensors files)" : ""));
}

// A folder of loose weights: its index if it has exactly one, else its .safetensors files (those the filter keeps).
void folder_weights(const fs::path& dir, const ResolveOptions& o, ModelSource& s) {
    std::vector<std::string> indexes, loose, torch_files;
    for (const auto& e : fs::directory_iterator(dir)) {
        const std::string p = e.path().string();
        if (ends_with(p, ".safetensors.index.json"))
            indexes.push_back(p);
        else if (ends_with(p, ".safetensors"))
            loose.push_back(p);
        else if (e.is_regular_file() && has_torch_extension(p))
            torch_files.push_back(p);
    }
    // torch.save files are the weights of a folder only when it has no safetensors (Hugging Face's pytorch_model.bin
    // alone when present: a trainer folder also holds pickles of its own state).
    std::sort(torch_files.begin(), torch_files.end());
    const std::string hf_bin = (dir / "pytorch_model.bin").string();
    if (std::find(torch_files.begin(), torch_files.end(), hf_bin) != torch_files.end()) torch_files = {hf_bin};
    if (indexes.empty() && loose.empty()) loose = torch_files;
    std::sort(indexes.begin(), indexes.end());
    std::sort(loose.begin(), loose.end());
    if (indexes.size() > 1)
        throw Error("folder '" + dir.string() + "' holds several *.safetensors.index.json files; name one");
    if (indexes.size() == 1) {
        s.index_file = indexes[0];
        s.layout = ModelLayout::ShardedIndex;
        return;
    }
    if (loose.empty())
        throw Error(o.what + " folder '" + dir.string() + "' holds no .safetensors (or .ckpt/.pt/.pth/.bin) file");
    // A training run folder holds model.safetensors beside its training state: the model file is the model.
    const std::string model_file = (dir / "model.safetensors").string();
    if (std::find(loose.begin(), loose.end(), model_file) != loose.end()) loose = {model_file};
    if (!o.tensor_filter) {
        s.weight_files = loose;
        return;
    }
    for (const auto& f : loose) {
        for (const auto& t : tensor_names(f)) // header only; corrupt files fail here, naming the file
            if (o.tensor_filter(t)) {
                s.weight_files.push_back(f);
                break;
            }
    }
    if (s.weight_files.empty()) {
        std::string seen;
        for (const auto& f : loose) seen += " " + fs::path(f).filename().string();
        throw Error(o.what + " folder '" + dir.string() +
                    "' holds no safetensors file with its tensors (files:" + seen + ")");
    }
}

ModelSource resolve_component(const fs::path& dir, const std::string& name) {
    ModelSource c;
    c.path = dir.string();
    c.layout = ModelLayout::DiffusersComponent;
    if (name == "scheduler" || name == "tokenizer" || name == "tokenizer_2") return c; // no weights
    if (fs::exists(dir / "config.json")) {
        c.config_file = (dir / "config.json").string();
        c.config = read_json(dir / "config.json");
        c.arch = arch_of_config(c.config);
    }
    component_weights(dir, c);
    return c;
}

} // namespace

const ModelSource& ModelSource::component(const std::string& name) const {
    auto it = components.find(name);
    if (it != components.end()) return it->second;
    std::string have;
    for (const auto& [n, c] : components) have += (have.empty() ? "" : ", ") + n;
    throw Error("'" + path + "' has no '" + name + "/' component" + (have.empty() ? "" : " (it has " + have + ")"));
}

std::string ModelSource::file(const std::string& name) const {
    auto it = files.find(name);
    return it == files.end() ? std::string() : it->second;
}

WeightMap ModelSource::load_weights() const {
    if (!index_file.empty()) return WeightMap::load_index(index_file);
    if (weight_files.empty()) throw Error("'" + path + "' has no weight files");
    return WeightMap::load_files(weight_files);
}

std::string ModelSource::describe() const {
    return enum_name(model_layout_table(), layout) + " " + enum_name(model_arch_table(), arch) + " '" + path + "'";
}

ModelSource resolve_model(const std::string& path, const ResolveOptions& o) {
    std::error_code ec;
    const fs::path p(path);
    if (!fs::exists(p, ec)) throw Error(o.what + " '" + path + "' does not exist");
    ModelSource s;
    s.path = path;
    if (!fs::is_directory(p, ec)) {
        if (ends_with(path, ".index.json")) {
            s.layout = ModelLayout::ShardedIndex;
            s.index_file = path;
        } else if (ends_with(path, ".safetensors") || has_torch_extension(path) ||
                   sniff_weight_file(path) != WeightFileKind::Other) {
            s.layout = ModelLayout::WeightsFile; // safetensors or torch.save, told apart by the bytes when loading
            s.weight_files = {path};
        } else {
            throw Error(o.what + " '" + path +
                        "' is not a .safetensors or torch.save (.ckpt/.pt/.pth/.bin) file, a "
                        "*.safetensors.index.json or a folder");
        }
        // A config next to a weights file describes it (e.g. a training run's model.safetensors + config.json).
        if (fs::exists(p.parent_path() / "config.json")) {
            s.config_file = (p.parent_path() / "config.json").string();
            s.config = read_json(s.config_file);
            s.arch = arch_of_config(s.config);
        }
        if (s.arch == ModelArch::Unknown && s.layout == ModelLayout::WeightsFile)
            s.arch = arch_of_tensors(s.weight_files);
        return s;
    }
    // A diffusers pipeline: model_index.json, or the three component folders SD needs.
    if (fs::exists(p / "model_index.json") || fs::is_directory(p / "unet")) {
        s.layout = ModelLayout::DiffusersPipeline;
        if (fs::exists(p / "model_index.json")) {
            s.config_file = (p / "model_index.json").string();
            s.config = read_json(s.config_file);
        }
        s.arch = ModelArch::StableDiffusion;
        for (const auto& e : fs::directory_iterator(p)) {
            if (!e.is_directory()) continue;
            const std::string name = e.path().filename().string();
            if (name == "unet" || name == "vae" || name.rfind("text_encoder", 0) == 0)
                s.components.emplace(name, resolve_component(e.path(), name));
            else if (name == "scheduler" || name.rfind("tokenizer", 0) == 0)
                s.components.emplace(name, resolve_component(e.path(), name));
        }
        if (fs::exists(p / "scheduler" / "scheduler_config.json"))
            s.files["scheduler_config"] = (p / "scheduler" / "scheduler_config.json").string();
        if (fs::exists(p / "anchorcache.json")) s.files["hints"] = (p / "anchorcache.json").string();
        return s;
    }
    // A component folder on its own, or a Hugging Face style folder (config.json + weights).
    if (fs::exists(p / "config.json")) {
        s.config_file = (p / "config.json").string();
        s.config = read_json(s.config_file);
        s.arch = arch_of_config(s.config);
    }
    if (s.arch == ModelArch::UNet2DCondition || s.arch == ModelArch::AutoencoderKL || s.arch == ModelArch::ClipText) {
        const auto config = s.config;
        const auto cfile = s.config_file;
        const auto arch = s.arch;
        s = resolve_component(p, "component");
        s.path = path;
        s.config = config;
        s.config_file = cfile;
        s.arch = arch;
        return s;
    }
    s.layout = ModelLayout::WeightsFolder;
    folder_weights(p, o, s);
    if (s.arch == ModelArch::Unknown && !s.weight_files.empty()) s.arch = arch_of_tensors(s.weight_files);
    return s;
}

} // namespace anchor
