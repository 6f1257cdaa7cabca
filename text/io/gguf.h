// GGUF, llama.cpp's model container (ggml's docs/gguf.md; versions 2 and 3), read from a memory map:
//
//   "GGUF" | version u32 | tensor_count u64 | kv_count u64
//   kv_count x  { key: string | value_type u32 | value }          string = u64 length + UTF-8 bytes (no NUL)
//   tensor_count x { name: string | n_dims u32 | ne[n_dims] u64 | ggml_type u32 | offset u64 }
//   padding to `general.alignment` (default 32) | tensor data (each at data_start + offset, offsets aligned)
//
// ne[0] is the fastest-varying dimension: a ggml [ne0, ne1] weight is the row-major torch tensor [ne1, ne0] (an
// nn.Linear weight [out, in] is stored with ne0 = in). Dequantisation follows ggml's block layouts (ggml-common.h):
//   q8_0: 32 weights per 34-byte block { f16 d; i8 qs[32] },          w = d * qs[j]
//   q4_0: 32 weights per 18-byte block { f16 d; u8 qs[16] },          w[j] = d * ((qs[j] & 15) - 8),
//                                                                      w[j + 16] = d * ((qs[j] >> 4) - 8)
//   f32, f16 (IEEE half), bf16 (the top 16 bits of a float32).
// K-quants (q4_K, q6_K, ...) and the other formats are refused naming the tensor and its type.
#pragma once

#include "cache/io/mapped_file.h"

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace anchor::text {

enum class GgmlType : uint32_t { F32 = 0, F16 = 1, Q4_0 = 2, Q8_0 = 8, BF16 = 30 };
// The name ggml gives a type id ("q4_K" for 12, ...; "type N" for an unknown one).
std::string ggml_type_name(uint32_t type);
// True for the types dequantize() reads.
bool ggml_type_supported(uint32_t type);
// Bytes of n weights of a supported type (n a multiple of the block size for quantised types).
int64_t ggml_type_bytes(GgmlType t, int64_t n);

struct GgufTensorInfo {
    std::string name;
    std::vector<int64_t> ne;    // as stored: ne[0] fastest
    std::vector<int64_t> shape; // torch order (ne reversed)
    uint32_t type = 0;
    uint64_t offset = 0; // from the start of the data section
    int64_t numel() const;
};

class GgufFile {
public:
    // Throws anchor::Error naming the file and what is wrong (magic, version, a truncated header, a tensor outside
    // the file, misaligned offsets).
    static std::shared_ptr<GgufFile> open(const std::string& path);

    uint32_t version() const { return version_; }
    uint64_t alignment() const { return alignment_; }
    // Every key: numbers, bools and strings as JSON scalars, arrays as JSON arrays.
    const nlohmann::json& metadata() const { return kv_; }
    const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
    bool has(const std::string& name) const { return index_.count(name) != 0; }
    const GgufTensorInfo& info(const std::string& name) const; // anchor::Error naming the file when absent
    // The stored bytes of a tensor (inside the map).
    const uint8_t* data(const GgufTensorInfo& t) const;
    // The tensor as float32 in torch order; anchor::Error naming the tensor for an unsupported type.
    torch::Tensor dequantize(const std::string& name) const;
    const std::string& path() const { return path_; }

private:
    std::string path_;
    MappedFile map_;
    uint32_t version_ = 0;
    uint64_t alignment_ = 32, data_start_ = 0;
    nlohmann::json kv_ = nlohmann::json::object();
    std::vector<GgufTensorInfo> tensors_;
    std::map<std::string, size_t> index_;
};

// n weights of a supported type at `src` -> float32 `dst`.
void ggml_dequantize(GgmlType t, const uint8_t* src, float* dst, int64_t n);

} // namespace anchor::text
