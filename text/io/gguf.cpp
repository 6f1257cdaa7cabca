// GGUF reading and ggml dequantisation (gguf.h).
#include "text/io/gguf.h"

#include "cache/io/error.h"

#include <cstring>

namespace anchor::text {

namespace {

const char* const kGgmlNames[] = {"f32",  "f16",  "q4_0", "q4_1", "type 4", "type 5", "q5_0", "q5_1",
                                  "q8_0", "q8_1", "q2_K", "q3_K", "q4_K",   "q5_K",   "q6_K", "q8_K"};

float gguf_half_to_float(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { // subnormal: normalise
            uint32_t e = 127 - 15 + 1, m = man;
            while ((m & 0x400) == 0) m <<= 1, --e;
            bits = sign | (e << 23) | ((m & 0x3FF) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

uint16_t gguf_u16(const uint8_t* p) {
    return uint16_t(p[0] | (p[1] << 8));
}

// A bounds-checked little-endian reader over the header.
class GgufCursor {
public:
    GgufCursor(const uint8_t* p, size_t n, const std::string& path) : p_(p), n_(n), path_(path) {}
    template <class T> T get(const char* what) {
        need(sizeof(T), what);
        T v;
        std::memcpy(&v, p_ + pos_, sizeof(T));
        pos_ += sizeof(T);
        return v;
    }
    std::string str(const char* what) {
        const uint64_t len = get<uint64_t>(what);
        need(len, what);
        std::string s(reinterpret_cast<const char*>(p_ + pos_), len);
        pos_ += len;
        return s;
    }
    size_t pos() const { return pos_; }
    [[noreturn]] void fail(const std::string& why) const {
        throw Error("GGUF file '" + path_ + "': " + why + " (at byte " + std::to_string(pos_) + ")");
    }

private:
    void need(uint64_t k, const char* what) {
        if (k > n_ - pos_) fail(std::string("truncated while reading ") + what);
    }
    const uint8_t* p_;
    size_t n_, pos_ = 0;
    std::string path_;
};

nlohmann::json gguf_value(GgufCursor& c, uint32_t type, int depth = 0) {
    switch (type) {
    case 0: return c.get<uint8_t>("a u8 value");
    case 1: return c.get<int8_t>("an i8 value");
    case 2: return c.get<uint16_t>("a u16 value");
    case 3: return c.get<int16_t>("an i16 value");
    case 4: return c.get<uint32_t>("a u32 value");
    case 5: return c.get<int32_t>("an i32 value");
    case 6: return c.get<float>("an f32 value");
    case 7: return c.get<uint8_t>("a bool value") != 0;
    case 8: return c.str("a string value");
    case 9: {
        if (depth > 4) c.fail("arrays nested too deeply");
        const uint32_t et = c.get<uint32_t>("an array type");
        const uint64_t n = c.get<uint64_t>("an array length");
        nlohmann::json a = nlohmann::json::array();
        for (uint64_t i = 0; i < n; ++i) a.push_back(gguf_value(c, et, depth + 1));
        return a;
    }
    case 10: return c.get<uint64_t>("a u64 value");
    case 11: return c.get<int64_t>("an i64 value");
    case 12: return c.get<double>("an f64 value");
    default: c.fail("unknown metadata value type " + std::to_string(type));
    }
}

} // namespace

std::string ggml_type_name(uint32_t type) {
    if (type < sizeof(kGgmlNames) / sizeof(kGgmlNames[0])) return kGgmlNames[type];
    if (type == 30) return "bf16";
    return "type " + std::to_string(type);
}

bool ggml_type_supported(uint32_t t) {
    return t == uint32_t(GgmlType::F32) || t == uint32_t(GgmlType::F16) || t == uint32_t(GgmlType::Q4_0) ||
           t == uint32_t(GgmlType::Q8_0) || t == uint32_t(GgmlType::BF16);
}

int64_t ggml_type_bytes(GgmlType t, int64_t n) {
    switch (t) {
    case GgmlType::F32: return 4 * n;
    case GgmlType::F16:
    case GgmlType::BF16: return 2 * n;
    case GgmlType::Q8_0: return n / 32 * 34;
    case GgmlType::Q4_0: return n / 32 * 18;
    }
    return 0;
}

void ggml_dequantize(GgmlType t, const uint8_t* src, float* dst, int64_t n) {
    switch (t) {
    case GgmlType::F32:
        std::memcpy(dst, src, size_t(n) * 4);
        return;
    case GgmlType::F16:
        for (int64_t i = 0; i < n; ++i) dst[i] = gguf_half_to_float(gguf_u16(src + 2 * i));
        return;
    case GgmlType::BF16:
        for (int64_t i = 0; i < n; ++i) {
            const uint32_t bits = uint32_t(gguf_u16(src + 2 * i)) << 16;
            std::memcpy(dst + i, &bits, 4);
        }
        return;
    case GgmlType::Q8_0:
        for (int64_t b = 0; b < n / 32; ++b) {
            const uint8_t* blk = src + b * 34;
            const float d = gguf_half_to_float(gguf_u16(blk));
            for (int j = 0; j < 32; ++j) dst[b * 32 + j] = d * float(static_cast<int8_t>(blk[2 + j]));
        }
        return;
    case GgmlType::Q4_0:
        for (int64_t b = 0; b < n / 32; ++b) {
            const uint8_t* blk = src + b * 18;
            const float d = gguf_half_to_float(gguf_u16(blk));
            for (int j = 0; j < 16; ++j) {
                dst[b * 32 + j] = d * float(int(blk[2 + j] & 0x0F) - 8);
                dst[b * 32 + j + 16] = d * float(int(blk[2 + j] >> 4) - 8);
            }
        }
        return;
    }
}

int64_t GgufTensorInfo::numel() const {
    int64_t n = 1;
    for (auto d : ne) n *= d;
    return n;
}

std::shared_ptr<GgufFile> GgufFile::open(const std::string& path) {
    auto f = std::shared_ptr<GgufFile>(new GgufFile());
    f->path_ = path;
    f->map_ = MappedFile(path);
    const auto* base = reinterpret_cast<const uint8_t*>(f->map_.data());
    const size_t size = f->map_.size();
    GgufCursor c(base, size, path);
    if (size < 4 || std::memcmp(base, "GGUF", 4) != 0) c.fail("not a GGUF file (magic is not 'GGUF')");
    c.get<uint32_t>("the magic");
    f->version_ = c.get<uint32_t>("the version");
    if (f->version_ != 2 && f->version_ != 3)
        c.fail("version " + std::to_string(f->version_) + " is not supported (2 and 3 are)");
    const uint64_t n_tensors = c.get<uint64_t>("the tensor count"), n_kv = c.get<uint64_t>("the metadata count");
    if (n_tensors > size || n_kv > size) c.fail("implausible tensor/metadata counts");
    for (uint64_t i = 0; i < n_kv; ++i) {
        const std::string key = c.str("a metadata key");
        const uint32_t type = c.get<uint32_t>("a metadata type");
        f->kv_[key] = gguf_value(c, type);
    }
    if (f->kv_.contains("general.alignment")) {
        const auto& a = f->kv_["general.alignment"];
        if (!a.is_number_unsigned() || a.get<uint64_t>() == 0 || (a.get<uint64_t>() & (a.get<uint64_t>() - 1)))
            c.fail("general.alignment must be a power of two");
        f->alignment_ = a.get<uint64_t>();
    }
    for (uint64_t i = 0; i < n_tensors; ++i) {
        GgufTensorInfo t;
        t.name = c.str("a tensor name");
        const uint32_t nd = c.get<uint32_t>("a tensor's dimension count");
        if (nd < 1 || nd > 4) c.fail("tensor '" + t.name + "' has " + std::to_string(nd) + " dimensions");
        for (uint32_t d = 0; d < nd; ++d) {
            const uint64_t v = c.get<uint64_t>("a tensor dimension");
            if (v == 0 || v > (uint64_t(1) << 40)) c.fail("tensor '" + t.name + "' has a dimension of " + std::to_string(v));
            t.ne.push_back(int64_t(v));
        }
        t.shape.assign(t.ne.rbegin(), t.ne.rend());
        t.type = c.get<uint32_t>("a tensor type");
        t.offset = c.get<uint64_t>("a tensor offset");
        if (f->index_.count(t.name)) c.fail("tensor '" + t.name + "' appears twice");
        f->index_[t.name] = f->tensors_.size();
        f->tensors_.push_back(t);
    }
    const uint64_t a = f->alignment_;
    f->data_start_ = (c.pos() + a - 1) / a * a;
    for (const auto& t : f->tensors_) {
        if (t.offset % a != 0)
            c.fail("tensor '" + t.name + "' offset " + std::to_string(t.offset) + " is not aligned to " + std::to_string(a));
        if (!ggml_type_supported(t.type)) continue; // its size is checked only when it is read
        if ((t.type == uint32_t(GgmlType::Q8_0) || t.type == uint32_t(GgmlType::Q4_0)) && t.ne[0] % 32 != 0)
            c.fail("tensor '" + t.name + "' (" + ggml_type_name(t.type) + ") has a row of " + std::to_string(t.ne[0]) +
                   " weights, not a multiple of 32");
        const uint64_t bytes = uint64_t(ggml_type_bytes(GgmlType(t.type), t.numel()));
        if (f->data_start_ + t.offset + bytes > size)
            c.fail("tensor '" + t.name + "' (" + std::to_string(bytes) + " bytes at offset " + std::to_string(t.offset) +
                   ") runs past the end of the file");
    }
    return f;
}

const GgufTensorInfo& GgufFile::info(const std::string& name) const {
    auto it = index_.find(name);
    if (it == index_.end()) throw Error("GGUF file '" + path_ + "' has no tensor '" + name + "'");
    return tensors_[it->second];
}

const uint8_t* GgufFile::data(const GgufTensorInfo& t) const {
    return reinterpret_cast<const uint8_t*>(map_.data()) + data_start_ + t.offset;
}

torch::Tensor GgufFile::dequantize(const std::string& name) const {
    const auto& t = info(name);
    if (!ggml_type_supported(t.type))
        throw Error("GGUF file '" + path_ + "', tensor '" + name + "': type " + ggml_type_name(t.type) +
                    " is not supported (f32, f16, bf16, q8_0, q4_0 are)");
    auto out = torch::empty(t.shape, torch::kFloat32);
    ggml_dequantize(GgmlType(t.type), data(t), out.data_ptr<float>(), t.numel());
    return out;
}

} // namespace anchor::text
