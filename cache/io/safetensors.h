// safetensors reading (memory-mapped, validated before use) and writing (atomic).
//
// Format: 8-byte little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets: [b, e)}, ...,
// "__metadata__": {str: str}}, then the data area; offsets are relative to the data area.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace anchor {

enum class DType { F32, F16, BF16, F64, I64, I32, U8, BOOL };

// "F32" -> DType::F32 ...; returns false for an unknown name.
bool dtype_from_string(const std::string& s, DType* out);
const char* dtype_name(DType t);
size_t dtype_size(DType t);
torch::ScalarType to_torch(DType t);
DType from_torch(torch::ScalarType t); // throws for types safetensors cannot hold

struct TensorInfo {
    std::string name;
    DType dtype = DType::F32;
    std::vector<int64_t> shape;
    uint64_t begin = 0; // data_offsets [begin, end) relative to the data area
    uint64_t end = 0;
    int64_t numel() const;
};

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
    const std::vector<TensorInfo>& tensors() const { return infos_; } // in header order
    const std::map<std::string, std::string>& metadata() const { return metadata_; }
    bool has(const std::string& name) const { return index_.count(name) != 0; }
    const TensorInfo& info(const std::string& name) const;
    // Zero-copy view of the tensor data (copied when the data is not aligned to its element size).
    torch::Tensor tensor(const std::string& name) const;

private:
    SafeTensorsFile() = default;
    void parse(const char* base, size_t size);

    std::string path_;
    void* map_ = nullptr;
    size_t map_size_ = 0;
    std::string owned_; // from_bytes storage
    const char* data_ = nullptr;
    uint64_t data_size_ = 0;
    std::vector<TensorInfo> infos_;
    std::map<std::string, size_t> index_;
    std::map<std::string, std::string> metadata_;
    std::weak_ptr<SafeTensorsFile> self_;
    friend struct SafeTensorsAccess;
};

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

// Serialises tensors (contiguous CPU copies are made as needed) into safetensors bytes. Tensors are laid out by
// decreasing element size, then by name, so every tensor's data is aligned to its element size.
std::string safetensors_bytes(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata = {});

// Writes a safetensors file atomically (temporary file in the same directory, then rename).
void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata = {}, bool overwrite = true);

} // namespace anchor
