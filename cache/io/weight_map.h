// One name -> tensor map with the checkpoint's own names, loaded from a safetensors file, a sharded checkpoint
// (`*.safetensors.index.json`), a folder of safetensors files, or a torch.save checkpoint (.ckpt/.pt/.pth/.bin, read
// without running code: cache/io/torch_checkpoint.h).
//
// Lookups check the expected shape; loading into a module reports every missing and unexpected name at once.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace anchor {

class SafeTensorsFile;

class WeightMap {
public:
    WeightMap() = default;

    // `path`: anything resolve_model (cache/io/model_source.h) understands: a .safetensors or torch.save file, a
    // *.safetensors.index.json, a diffusers component folder, a folder of weights. Throws anchor::Error naming the
    // file.
    static WeightMap load(const std::string& path);
    // The tensors of these safetensors or torch.save files, told apart by their first bytes (a name in two files is an
    // error).
    static WeightMap load_files(const std::vector<std::string>& files);
    // The tensors a sharded checkpoint's index names, each from its shard (every absent one reported at once).
    static WeightMap load_index(const std::string& index);

    // A map built from `other`'s tensors (renamed or reshaped views) gives their file pages back as load_into copies
    // them, as `other` itself would.
    void keep_files_of(const WeightMap& other);
    // Adds a tensor under `name` (the source is recorded for error messages).
    void insert(const std::string& name, torch::Tensor t, const std::string& source = "<memory>");
    bool has(const std::string& name) const { return tensors_.count(name) != 0; }
    size_t size() const { return tensors_.size(); }
    std::vector<std::string> names() const;
    const std::string& source(const std::string& name) const;
    const std::map<std::string, torch::Tensor>& all() const { return tensors_; }

    // The tensor as stored (dtype of the file). Throws naming the file when missing.
    torch::Tensor get(const std::string& name) const;
    // Checks the shape; throws "file 'F', tensor 'T': expected shape [..], got [..]".
    torch::Tensor get(const std::string& name, const std::vector<int64_t>& expected_shape) const;
    // Shape only, without touching the data.
    std::vector<int64_t> shape(const std::string& name) const;

    // A new map with `prefix` stripped from the names that have it (names without it are dropped).
    WeightMap with_prefix_stripped(const std::string& prefix) const;
    // A new map with every name passed through `rename` (an empty result drops the tensor).
    WeightMap renamed(const std::function<std::string(const std::string&)>& rename) const;

    // Copies the map into `module`'s parameters and buffers, converting dtype. Every parameter/buffer name of the
    // module must be present and every map name must be used, except names matched by `ignore` (regex, full match)
    // and module buffers matched by `optional`. All missing, unexpected and wrong-shape names are reported in one
    // error before anything is copied.
    void load_into(torch::nn::Module& module, const std::vector<std::string>& ignore = {},
                   const std::vector<std::string>& optional = {}) const;

    std::string describe() const; // "N tensors from F" for logs

private:
    std::map<std::string, torch::Tensor> tensors_;
    std::map<std::string, std::string> sources_;
    std::vector<std::shared_ptr<SafeTensorsFile>> files_;
};

} // namespace anchor
