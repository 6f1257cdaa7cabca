// safetensors header parsing and validation, free of LibTorch so that the parser that sees untrusted bytes can be
// built alone under AddressSanitizer + UndefinedBehaviorSanitizer (tests/sanitize, run in CI).
//
// Format: 8-byte little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets: [b, e)}, ...,
// "__metadata__": {str: str}}, then the data area; offsets are relative to the data area.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace anchor {

// F8_E4M3 / F8_E5M2: float8 e4m3fn and e5m2 (OCP FP8; fp8 T5-XXL files ship as F8_E4M3), one byte each.
enum class DType { F32, F16, BF16, F64, I64, I32, U8, BOOL, F8_E4M3, F8_E5M2 };

// "F32" -> DType::F32 ...; returns false for an unknown name.
bool dtype_from_string(const std::string& s, DType* out);
const char* dtype_name(DType t);
size_t dtype_size(DType t);

struct TensorInfo {
    std::string name;
    DType dtype = DType::F32;
    std::vector<int64_t> shape;
    uint64_t begin = 0; // data_offsets [begin, end) relative to the data area
    uint64_t end = 0;
    int64_t numel() const;
};

struct SafeTensorsHeader {
    std::vector<TensorInfo> tensors; // in header order
    std::map<std::string, size_t> index;
    std::map<std::string, std::string> metadata;
    uint64_t data_offset = 0; // 8 + N: where the data area starts in the file
    uint64_t data_size = 0;   // bytes after the header
};

// Parses and validates the header of the `size` bytes at `base` (the whole file): JSON syntax, entry fields, dtypes,
// shape x dtype size == data_offsets span (no overflow), offsets inside the data area and not overlapping.
// Throws anchor::Error naming `path` and the offending tensor.
SafeTensorsHeader parse_safetensors_header(const char* base, size_t size, const std::string& path);

} // namespace anchor
