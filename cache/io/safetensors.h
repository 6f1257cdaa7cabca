// safetensors reading (memory-mapped, validated before use) and writing (atomic).
//
// The format and the header parser: cache/io/safetensors_header.h.
#pragma once

#include "cache/io/safetensors_header.h"

#include "cache/io/mapped_file.h"

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace anchor {

torch::ScalarType to_torch(DType t);
DType from_torch(torch::ScalarType t); // throws for types safetensors cannot hold

// A validated, memory-mapped safetensors file. Tensors returned by `tensor()` share the mapping (copy-on-write, so
// writing to them never touches the file) and keep it alive.
class SafeTensorsFile {
public:
    // Maps and validates `path`; throws anchor::Error naming the file and the problem.
    static std::shared_ptr<SafeTensorsFile> open(const std::string& path);
    // Validates an in-memory buffer (used by the fuzzer and tests); the buffer is copied.
    static std::shared_ptr<SafeTensorsFile> from_bytes(const std::string& bytes, const std::string& label);
    ~SafeTensorsFile();

    const std::string& path() const { return path_; }
    const std::vector<TensorInfo>& tensors() const { return header_.tensors; } // in header order
    const std::map<std::string, std::string>& metadata() const { return header_.metadata; }
    bool has(const std::string& name) const { return header_.index.count(name) != 0; }
    const TensorInfo& info(const std::string& name) const;
    // Zero-copy view of the tensor data (copied when the data is not aligned to its element size). F8_E4M3 / F8_E5M2
    // tensors come as a bfloat16 copy, decoded exactly (every float8 e4m3fn / e5m2 value is a bfloat16).
    torch::Tensor tensor(const std::string& name) const;
    // MappedFile::release for the bytes of a tensor viewed from this file (nothing for other memory).
    void release_pages(const torch::Tensor& view) const;

private:
    SafeTensorsFile() = default;
    void parse(const char* base, size_t size);

    std::string path_;
    MappedFile mapped_; // empty for from_bytes
    std::string owned_; // from_bytes storage
    SafeTensorsHeader header_;
    const char* data_ = nullptr;
    std::weak_ptr<SafeTensorsFile> self_;
};

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

// Serialises tensors (contiguous CPU copies are made as needed) into safetensors bytes. Tensors are laid out by
// decreasing element size, then by name, so every tensor's data is aligned to its element size.
std::string safetensors_bytes(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata = {});

// Writes a safetensors file atomically (temporary file in the same directory, then rename).
void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata = {}, bool overwrite = true);

} // namespace anchor
