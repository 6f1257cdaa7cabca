#include "cache/io/weight_map.h"

#include "cache/io/model_source.h"
#include "cache/util/strings.h"

#include "cache/io/error.h"
#include "cache/io/read_file.h"
#include "cache/io/safetensors.h"
#include "cache/io/torch_checkpoint.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

namespace fs = std::filesystem;

namespace anchor {

namespace {

std::string list_names(const std::vector<std::string>& names, size_t max_show = 400) {
    std::string out;
    for (size_t i = 0; i < names.size() && i < max_show; ++i) out += "\n  " + names[i];
    if (names.size() > max_show) out += "\n  ... and " + std::to_string(names.size() - max_show) + " more";
    return out;
}

} // namespace

WeightMap WeightMap::load(const std::string& path) {
    return resolve_model(path, {nullptr, "weights"}).load_weights();
}

WeightMap WeightMap::load_index(const std::string& index) {
    WeightMap wm;
    nlohmann::json j;
    try {
        j = nlohmann::json::parse(read_file(index));
    } catch (const nlohmann::json::exception& e) {
        throw Error("sharded checkpoint index '" + index + "': invalid JSON: " + e.what());
    }
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
        throw Error("sharded checkpoint index '" + index + "' has no \"weight_map\" object");
    std::set<std::string> shards;
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
        if (!it.value().is_string())
            throw Error("sharded checkpoint index '" + index + "': shard of '" + it.key() + "' is not a string");
        shards.insert(it.value().get<std::string>());
    }
    fs::path dir = fs::path(index).parent_path();
    // Shards are safetensors files, or torch.save files for a pytorch_model.bin.index.json (told apart by their bytes).
    struct Shard {
        std::shared_ptr<SafeTensorsFile> st;
        std::shared_ptr<TorchCheckpoint> torch;
        std::string path;
        bool has(const std::string& n) const { return st ? st->has(n) : torch->has(n); }
        torch::Tensor tensor(const std::string& n) const { return st ? st->tensor(n) : torch->tensor(n); }
    };
    std::map<std::string, Shard> opened;
    for (const auto& s : shards) {
        if (s.find("..") != std::string::npos || (!s.empty() && s[0] == '/'))
            throw Error("sharded checkpoint index '" + index + "': shard name '" + s + "' leaves the folder");
        Shard& sh = opened[s];
        sh.path = (dir / s).string();
        const WeightFileKind kind = sniff_weight_file(sh.path);
        if (kind == WeightFileKind::TorchZip || (has_torch_extension(sh.path) && kind != WeightFileKind::SafeTensors)) {
            sh.torch = TorchCheckpoint::open(sh.path);
        } else {
            sh.st = SafeTensorsFile::open(sh.path);
            wm.files_.push_back(sh.st);
        }
    }
    std::vector<std::string> absent;
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
        const Shard& f = opened[it.value().get<std::string>()];
        if (!f.has(it.key()))
            absent.push_back(it.key() + " (expected in " + f.path + ")");
        else
            wm.insert(it.key(), f.tensor(it.key()), f.path);
    }
    if (!absent.empty())
        throw Error("sharded checkpoint index '" + index + "' names " + std::to_string(absent.size()) +
                    " tensors missing from their shards:" + list_names(absent));
    return wm;
}

WeightMap WeightMap::load_files(const std::vector<std::string>& files) {
    WeightMap wm;
    for (const auto& f : files) {
        // A torch.save archive is recognised by its bytes, whatever its name; a .ckpt/.pt/.pth/.bin that is not
        // safetensors goes to the torch reader too, which says what it is (legacy format, bare pickle, ...).
        const WeightFileKind kind = sniff_weight_file(f);
        if (kind == WeightFileKind::TorchZip || (has_torch_extension(f) && kind != WeightFileKind::SafeTensors)) {
            auto ck = TorchCheckpoint::open(f); // its tensors keep the mapping alive
            for (const auto& name : ck->names()) {
                if (wm.has(name))
                    throw Error("tensor '" + name + "' appears in both '" + wm.source(name) + "' and '" + f + "'");
                wm.insert(name, ck->tensor(name), f);
            }
            continue;
        }
        auto st = SafeTensorsFile::open(f);
        wm.files_.push_back(st);
        for (const auto& ti : st->tensors()) {
            if (wm.has(ti.name))
                throw Error("tensor '" + ti.name + "' appears in both '" + wm.source(ti.name) + "' and '" + f + "'");
            wm.insert(ti.name, st->tensor(ti.name), f);
        }
    }
    return wm;
}

void WeightMap::insert(const std::string& name, torch::Tensor t, const std::string& source) {
    tensors_[name] = std::move(t);
    sources_[name] = source;
}

std::vector<std::string> WeightMap::names() const {
    std::vector<std::string> out;
    for (const auto& kv : tensors_) out.push_back(kv.first);
    return out;
}

const std::string& WeightMap::source(const std::string& name) const {
    static const std::string unknown = "<unknown>";
    auto it = sources_.find(name);
    return it == sources_.end() ? unknown : it->second;
}

torch::Tensor WeightMap::get(const std::string& name) const {
    auto it = tensors_.find(name);
    if (it == tensors_.end()) {
        std::set<std::string> srcs;
        for (const auto& kv : sources_) srcs.insert(kv.second);
        std::string where;
        for (const auto& s : srcs) where += (where.empty() ? "" : ", ") + s;
        throw Error("missing tensor '" + name + "' (looked in " + (where.empty() ? "<empty map>" : where) + ")");
    }
    return it->second;
}

torch::Tensor WeightMap::get(const std::string& name, const std::vector<int64_t>& expected) const {
    torch::Tensor t = get(name);
    if (t.sizes().vec() != expected)
        throw Error("file '" + source(name) + "', tensor '" + name + "': expected shape " + shape_str(expected) +
                    ", got " + shape_str(t.sizes().vec()));
    return t;
}

std::vector<int64_t> WeightMap::shape(const std::string& name) const {
    return get(name).sizes().vec();
}

WeightMap WeightMap::with_prefix_stripped(const std::string& prefix) const {
    WeightMap out;
    out.files_ = files_;
    for (const auto& [k, v] : tensors_)
        if (k.compare(0, prefix.size(), prefix) == 0) out.insert(k.substr(prefix.size()), v, source(k));
    return out;
}

WeightMap WeightMap::renamed(const std::function<std::string(const std::string&)>& rename) const {
    WeightMap out;
    out.files_ = files_;
    for (const auto& [k, v] : tensors_) {
        std::string n = rename(k);
        if (n.empty()) continue;
        if (out.has(n)) throw Error("renaming maps both '" + k + "' and another tensor to '" + n + "'");
        out.insert(n, v, source(k));
    }
    return out;
}

void WeightMap::keep_files_of(const WeightMap& other) {
    for (const auto& f : other.files_)
        if (std::find(files_.begin(), files_.end(), f) == files_.end()) files_.push_back(f);
}

void WeightMap::load_into(torch::nn::Module& module, const std::vector<std::string>& ignore,
                          const std::vector<std::string>& optional) const {
    std::vector<std::regex> ign, opt;
    for (const auto& s : ignore) ign.emplace_back(s);
    for (const auto& s : optional) opt.emplace_back(s);
    auto matches = [](const std::vector<std::regex>& rs, const std::string& n) {
        for (const auto& r : rs)
            if (std::regex_match(n, r)) return true;
        return false;
    };
    std::map<std::string, torch::Tensor> targets;
    for (const auto& p : module.named_parameters(true)) targets[p.key()] = p.value();
    std::set<std::string> buffer_names;
    for (const auto& b : module.named_buffers(true)) {
        targets[b.key()] = b.value();
        buffer_names.insert(b.key());
    }
    std::vector<std::string> missing, unexpected, bad_shape, bad_dtype;
    for (const auto& [name, t] : targets) {
        auto it = tensors_.find(name);
        if (it == tensors_.end()) {
            if (!(buffer_names.count(name) && matches(opt, name)))
                missing.push_back(name + " " + shape_str(t.sizes().vec()));
        } else if (it->second.sizes() != t.sizes()) {
            bad_shape.push_back(name + ": expected " + shape_str(t.sizes().vec()) + ", got " +
                                shape_str(it->second.sizes().vec()) + " in '" + source(name) + "'");
        } else if (t.is_floating_point() && !it->second.is_floating_point()) {
            // Integer or bool data where weights belong would be converted silently into nonsense.
            bad_dtype.push_back(name + ": expected a floating-point tensor (F32/F16/BF16), got " +
                                std::string(c10::toString(it->second.scalar_type())) + " in '" + source(name) + "'");
        }
    }
    for (const auto& [name, t] : tensors_)
        if (!targets.count(name) && !matches(ign, name)) unexpected.push_back(name + " (" + source(name) + ")");
    if (!missing.empty() || !unexpected.empty() || !bad_shape.empty() || !bad_dtype.empty()) {
        std::string msg = "weights do not fit the model (" + describe() + "):";
        if (!missing.empty())
            msg += "\n" + std::to_string(missing.size()) + " missing tensor(s):" + list_names(missing);
        if (!bad_shape.empty())
            msg += "\n" + std::to_string(bad_shape.size()) + " tensor(s) with the wrong shape:" + list_names(bad_shape);
        if (!bad_dtype.empty())
            msg += "\n" + std::to_string(bad_dtype.size()) + " tensor(s) with the wrong dtype:" + list_names(bad_dtype);
        if (!unexpected.empty())
            msg += "\n" + std::to_string(unexpected.size()) + " unexpected tensor(s):" + list_names(unexpected);
        throw Error(msg);
    }
    torch::NoGradGuard ng;
    for (auto& [name, t] : targets) {
        auto it = tensors_.find(name);
        if (it == tensors_.end()) continue;
        t.copy_(it->second.to(t.scalar_type()));
        // The file's copy of it is not needed in memory any more: a multi-GB checkpoint's pages are given back as
        // it is read instead of staying resident beside the loaded weights.
        for (const auto& f : files_) f->release_pages(it->second);
    }
}

std::string WeightMap::describe() const {
    std::set<std::string> srcs;
    for (const auto& kv : sources_) srcs.insert(kv.second);
    std::string s = std::to_string(tensors_.size()) + " tensors from ";
    size_t i = 0;
    for (const auto& f : srcs) s += (i++ ? ", " : "") + f;
    if (srcs.empty()) s += "<memory>";
    return s;
}

} // namespace anchor
