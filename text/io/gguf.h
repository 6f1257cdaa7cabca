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
#include <cstdio>
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

// A tensor's stored bytes as a torch tensor viewing the map (no copy; it keeps `file` open): f32 / f16 / bf16 as
// that dtype in torch order, q8_0 / q4_0 as uint8 [rows..., blocks per row * block bytes]. anchor::Error naming the
// tensor for an unsupported type.
torch::Tensor gguf_stored_view(const std::shared_ptr<const GgufFile>& file, const std::string& name);

// ---- writing ------------------------------------------------------------------------------------------------------

// One metadata entry with its GGUF value type (llama.cpp reads keys with a fixed type: counts as u32, floats as f32,
// token types as an i32 array).
enum class GgufValueType : uint32_t { U32 = 4, I32 = 5, F32 = 6, Bool = 7, String = 8, Array = 9, U64 = 10 };
struct GgufKv {
    std::string key;
    GgufValueType type = GgufValueType::U32;
    nlohmann::json value;                               // a scalar, or an array for Array
    GgufValueType element = GgufValueType::U32;         // Array's element type
};

// Writes a GGUF v3 file tensor by tensor, so a model larger than memory is streamed to disk: the header (metadata and
// every tensor's name, shape, type and offset) first, then each tensor's values in declaration order, appended a
// few rows at a time as float32 and converted to the tensor's type (q8_0 / q4_0 with ggml's reference rounding, the
// rows' length a multiple of 32). Written to `<path>.tmp` and renamed by finish(); an unfinished writer removes it.
class GgufWriter {
public:
    struct Tensor {
        std::string name;
        std::vector<int64_t> shape; // torch order (ne reversed)
        GgmlType type = GgmlType::F32;
    };
    GgufWriter(std::string path, const std::vector<GgufKv>& kv, std::vector<Tensor> tensors, uint64_t alignment = 32);
    ~GgufWriter();
    GgufWriter(const GgufWriter&) = delete;
    GgufWriter& operator=(const GgufWriter&) = delete;
    // Appends whole rows (n a multiple of the last dimension) of the current tensor; moves to the next once full.
    void append(const float* values, int64_t n);
    // The next tensor still to be filled (nullptr once all are).
    const Tensor* current() const { return next_ < tensors_.size() ? &tensors_[next_] : nullptr; }
    // Checks every tensor was filled, then renames the file into place.
    void finish();

private:
    std::string path_, tmp_;
    std::vector<Tensor> tensors_;
    uint64_t alignment_;
    size_t next_ = 0;
    int64_t filled_ = 0; // values of the current tensor written
    std::FILE* f_ = nullptr;
    void pad();
};

// n weights of a supported type at `src` -> float32 `dst`.
void ggml_dequantize(GgmlType t, const uint8_t* src, float* dst, int64_t n);

} // namespace anchor::text
