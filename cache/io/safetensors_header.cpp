#include "cache/io/safetensors_header.h"

#include "cache/io/error.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <limits>

namespace anchor {

namespace {

struct DTypeRow {
    DType t;
    const char* name;
    size_t size;
};

const DTypeRow kDTypes[] = {
    {DType::F32, "F32", 4},         {DType::F16, "F16", 2},         {DType::BF16, "BF16", 2}, {DType::F64, "F64", 8},
    {DType::I64, "I64", 8},         {DType::I32, "I32", 4},         {DType::U8, "U8", 1},     {DType::BOOL, "BOOL", 1},
    {DType::F8_E4M3, "F8_E4M3", 1}, {DType::F8_E5M2, "F8_E5M2", 1},
};

const DTypeRow& row(DType t) {
    for (const auto& r : kDTypes)
        if (r.t == t) return r;
    throw Error("internal: unknown DType");
}

// Largest header we accept; real checkpoints have headers of a few MB at most.
constexpr uint64_t kMaxHeader = 100ull << 20;

} // namespace

bool dtype_from_string(const std::string& s, DType* out) {
    for (const auto& r : kDTypes)
        if (s == r.name) {
            *out = r.t;
            return true;
        }
    return false;
}
const char* dtype_name(DType t) {
    return row(t).name;
}
size_t dtype_size(DType t) {
    return row(t).size;
}

int64_t TensorInfo::numel() const {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    return n;
}

SafeTensorsHeader parse_safetensors_header(const char* base, size_t size, const std::string& p) {
    SafeTensorsHeader out;
    if (size < 8)
        throw Error("safetensors file '" + p + "' is truncated: " + std::to_string(size) +
                    " bytes, the 8-byte header length alone needs 8");
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(base[i]);
    if (n > size - 8)
        throw Error("safetensors file '" + p + "': header length " + std::to_string(n) + " is larger than the file (" +
                    std::to_string(size) + " bytes)");
    if (n > kMaxHeader)
        throw Error("safetensors file '" + p + "': header length " + std::to_string(n) + " exceeds the 100 MiB limit");
    nlohmann::json h;
    try {
        h = nlohmann::json::parse(base + 8, base + 8 + n);
    } catch (const std::exception& e) {
        throw Error("safetensors file '" + p + "': invalid JSON header: " + e.what());
    }
    if (!h.is_object()) throw Error("safetensors file '" + p + "': invalid JSON header: not an object");
    out.data_offset = 8 + n;
    out.data_size = size - 8 - n;

    for (auto it = h.begin(); it != h.end(); ++it) {
        const std::string& name = it.key();
        const auto& v = it.value();
        if (name == "__metadata__") {
            if (!v.is_object()) throw Error("safetensors file '" + p + "': __metadata__ is not an object");
            for (auto m = v.begin(); m != v.end(); ++m) {
                if (!m.value().is_string())
                    throw Error("safetensors file '" + p + "': __metadata__ value of '" + m.key() +
                                "' is not a string");
                out.metadata[m.key()] = m.value().get<std::string>();
            }
            continue;
        }
        const std::string where = "safetensors file '" + p + "', tensor '" + name + "'";
        if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets"))
            throw Error(where + ": entry needs dtype, shape and data_offsets");
        TensorInfo ti;
        ti.name = name;
        if (!v["dtype"].is_string()) throw Error(where + ": dtype is not a string");
        const std::string ds = v["dtype"].get<std::string>();
        if (!dtype_from_string(ds, &ti.dtype))
            throw Error(where + ": unknown dtype '" + ds +
                        "' (known: F32, F16, BF16, F64, I64, I32, U8, BOOL, F8_E4M3, F8_E5M2)");
        if (!v["shape"].is_array()) throw Error(where + ": shape is not an array");
        // Element count computed in 128-bit-safe steps so a hostile shape cannot overflow.
        unsigned __int128 count = 1;
        for (const auto& d : v["shape"]) {
            if (!d.is_number_unsigned()) throw Error(where + ": shape entries must be non-negative integers");
            uint64_t dv = d.get<uint64_t>();
            if (dv > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
                throw Error(where + ": shape entry too large");
            ti.shape.push_back(static_cast<int64_t>(dv));
            count *= dv;
            if (count > (static_cast<unsigned __int128>(1) << 64)) count = static_cast<unsigned __int128>(1) << 64;
        }
        const auto& off = v["data_offsets"];
        if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
            throw Error(where + ": data_offsets must be two non-negative integers");
        ti.begin = off[0].get<uint64_t>();
        ti.end = off[1].get<uint64_t>();
        if (ti.begin > ti.end)
            throw Error(where + ": data_offsets [" + std::to_string(ti.begin) + ", " + std::to_string(ti.end) +
                        ") are reversed");
        unsigned __int128 need = count * dtype_size(ti.dtype);
        if (need != static_cast<unsigned __int128>(ti.end - ti.begin))
            throw Error(where + ": shape " + shape_str(ti.shape) + " x " + ds + " (" +
                        std::to_string(dtype_size(ti.dtype)) + " bytes) needs " +
                        (count >= (static_cast<unsigned __int128>(1) << 64)
                             ? std::string("more than 2^64")
                             : std::to_string(static_cast<uint64_t>(need))) +
                        " bytes but data_offsets span " + std::to_string(ti.end - ti.begin));
        out.index[name] = out.tensors.size();
        out.tensors.push_back(std::move(ti));
    }

    // Offsets: sorted by begin they must not overlap and must lie inside the data area.
    std::vector<const TensorInfo*> order;
    for (const auto& t : out.tensors) order.push_back(&t);
    std::sort(order.begin(), order.end(), [](const TensorInfo* a, const TensorInfo* b) {
        return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
    });
    uint64_t prev_end = 0;
    const TensorInfo* prev = nullptr;
    bool contiguous = true;
    for (const auto* t : order) {
        if (prev && t->begin < prev_end && t->end > t->begin && prev->end > prev->begin)
            throw Error("safetensors file '" + p + "': data of tensor '" + t->name + "' [" + std::to_string(t->begin) +
                        ", " + std::to_string(t->end) + ") overlaps tensor '" + prev->name + "' [" +
                        std::to_string(prev->begin) + ", " + std::to_string(prev->end) + ")");
        if (t->begin != prev_end) contiguous = false;
        if (t->end > prev_end) {
            prev_end = t->end;
            prev = t;
        }
    }
    if (prev_end > out.data_size) {
        // A complete, gap-free layout that runs past the end of the file means the file was cut short; otherwise one
        // tensor's offsets point outside the data area.
        if (contiguous)
            throw Error("safetensors file '" + p + "' is truncated: the header describes " + std::to_string(prev_end) +
                        " data bytes but only " + std::to_string(out.data_size) + " follow the header");
        for (const auto* t : order)
            if (t->end > out.data_size)
                throw Error("safetensors file '" + p + "', tensor '" + t->name + "': data_offsets [" +
                            std::to_string(t->begin) + ", " + std::to_string(t->end) +
                            ") are outside the data area of " + std::to_string(out.data_size) + " bytes");
    }
    return out;
}

} // namespace anchor
