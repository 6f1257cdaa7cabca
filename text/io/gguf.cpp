// GGUF reading and ggml dequantisation (gguf.h).
#include "text/io/gguf.h"

#include "cache/io/error.h"
#include "kernels/gemv.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <filesystem>

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
    case GgmlType::Q8_0: // ggml's block layouts are kernels/gemv.h's BlockQ8_0 / BlockQ4_0
        kernels::dequantize_row_q8_0(reinterpret_cast<const kernels::BlockQ8_0*>(src), dst, n);
        return;
    case GgmlType::Q4_0:
        kernels::dequantize_row_q4_0(reinterpret_cast<const kernels::BlockQ4_0*>(src), dst, n);
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

torch::Tensor gguf_stored_view(const std::shared_ptr<const GgufFile>& file, const std::string& name) {
    const auto& t = file->info(name);
    if (!ggml_type_supported(t.type))
        throw Error("GGUF file '" + file->path() + "', tensor '" + name + "': type " + ggml_type_name(t.type) +
                    " is not supported (f32, f16, bf16, q8_0, q4_0 are)");
    auto shape = t.shape;
    torch::ScalarType dt = torch::kUInt8;
    switch (GgmlType(t.type)) {
    case GgmlType::F32: dt = torch::kFloat32; break;
    case GgmlType::F16: dt = torch::kFloat16; break;
    case GgmlType::BF16: dt = torch::kBFloat16; break;
    case GgmlType::Q8_0:
    case GgmlType::Q4_0: shape.back() = ggml_type_bytes(GgmlType(t.type), t.ne[0]); break;
    }
    // The map is read-only and outlives the view through the deleter's reference; nothing writes through it.
    auto* p = const_cast<uint8_t*>(file->data(t));
    return torch::from_blob(p, shape, [keep = file](void*) {}, torch::TensorOptions().dtype(dt));
}

// ---- writing ------------------------------------------------------------------------------------------------------

namespace {

void gguf_put(std::FILE* f, const void* p, size_t n, const std::string& path) {
    if (n && std::fwrite(p, 1, n, f) != n) throw Error("cannot write '" + path + "' (disk full?)");
}
template <class T> void gguf_put_pod(std::FILE* f, T v, const std::string& path) {
    gguf_put(f, &v, sizeof(T), path);
}
void gguf_put_str(std::FILE* f, const std::string& s, const std::string& path) {
    gguf_put_pod<uint64_t>(f, s.size(), path);
    gguf_put(f, s.data(), s.size(), path);
}

void gguf_put_value(std::FILE* f, GgufValueType t, const nlohmann::json& v, const std::string& key,
                    const std::string& path) {
    switch (t) {
    case GgufValueType::U32: return gguf_put_pod<uint32_t>(f, v.get<uint32_t>(), path);
    case GgufValueType::I32: return gguf_put_pod<int32_t>(f, v.get<int32_t>(), path);
    case GgufValueType::F32: return gguf_put_pod<float>(f, v.get<float>(), path);
    case GgufValueType::Bool: return gguf_put_pod<uint8_t>(f, v.get<bool>() ? 1 : 0, path);
    case GgufValueType::String: return gguf_put_str(f, v.get<std::string>(), path);
    case GgufValueType::U64: return gguf_put_pod<uint64_t>(f, v.get<uint64_t>(), path);
    case GgufValueType::Array: break;
    }
    throw Error("GGUF writer: metadata '" + key + "': nested arrays are not written");
}

} // namespace

GgufWriter::GgufWriter(std::string path, const std::vector<GgufKv>& kv, std::vector<Tensor> tensors,
                       uint64_t alignment)
    : path_(std::move(path)), tmp_(path_ + ".tmp"), tensors_(std::move(tensors)), alignment_(alignment) {
    if (alignment_ == 0 || (alignment_ & (alignment_ - 1))) throw Error("GGUF writer: alignment must be a power of two");
    for (const auto& t : tensors_) {
        if (t.shape.empty() || t.shape.size() > 4) throw Error("GGUF writer: tensor '" + t.name + "' needs 1 to 4 dims");
        if ((t.type == GgmlType::Q8_0 || t.type == GgmlType::Q4_0) && t.shape.back() % 32 != 0)
            throw Error("GGUF writer: tensor '" + t.name + "' (" + ggml_type_name(uint32_t(t.type)) + ") has rows of " +
                        std::to_string(t.shape.back()) + " values, not a multiple of 32");
    }
    f_ = std::fopen(tmp_.c_str(), "wb");
    if (!f_) throw Error("cannot create '" + tmp_ + "'");
    gguf_put(f_, "GGUF", 4, tmp_);
    gguf_put_pod<uint32_t>(f_, 3, tmp_);
    gguf_put_pod<uint64_t>(f_, tensors_.size(), tmp_);
    const bool own_alignment = alignment_ != 32;
    gguf_put_pod<uint64_t>(f_, kv.size() + (own_alignment ? 1 : 0), tmp_);
    if (own_alignment) {
        gguf_put_str(f_, "general.alignment", tmp_);
        gguf_put_pod<uint32_t>(f_, uint32_t(GgufValueType::U32), tmp_);
        gguf_put_pod<uint32_t>(f_, uint32_t(alignment_), tmp_);
    }
    for (const auto& e : kv) {
        gguf_put_str(f_, e.key, tmp_);
        gguf_put_pod<uint32_t>(f_, uint32_t(e.type), tmp_);
        if (e.type != GgufValueType::Array) {
            gguf_put_value(f_, e.type, e.value, e.key, tmp_);
            continue;
        }
        gguf_put_pod<uint32_t>(f_, uint32_t(e.element), tmp_);
        gguf_put_pod<uint64_t>(f_, e.value.size(), tmp_);
        for (const auto& v : e.value) gguf_put_value(f_, e.element, v, e.key, tmp_);
    }
    uint64_t offset = 0;
    for (const auto& t : tensors_) {
        gguf_put_str(f_, t.name, tmp_);
        gguf_put_pod<uint32_t>(f_, uint32_t(t.shape.size()), tmp_);
        int64_t n = 1;
        for (auto it = t.shape.rbegin(); it != t.shape.rend(); ++it) gguf_put_pod<uint64_t>(f_, uint64_t(*it), tmp_), n *= *it;
        gguf_put_pod<uint32_t>(f_, uint32_t(t.type), tmp_);
        gguf_put_pod<uint64_t>(f_, offset, tmp_);
        offset += (uint64_t(ggml_type_bytes(t.type, n)) + alignment_ - 1) / alignment_ * alignment_;
    }
    pad();
}

GgufWriter::~GgufWriter() {
    if (f_) {
        std::fclose(f_);
        std::error_code ec;
        std::filesystem::remove(tmp_, ec);
    }
}

void GgufWriter::pad() {
    const long pos = std::ftell(f_);
    static const char zeros[64] = {};
    uint64_t n = (alignment_ - uint64_t(pos) % alignment_) % alignment_;
    while (n > 0) {
        const uint64_t k = std::min<uint64_t>(n, sizeof(zeros));
        gguf_put(f_, zeros, k, tmp_);
        n -= k;
    }
}

void GgufWriter::append(const float* v, int64_t n) {
    const Tensor* t = current();
    if (!t) throw Error("GGUF writer: more values than the declared tensors hold");
    const int64_t row = t->shape.back();
    int64_t total = 1;
    for (auto d : t->shape) total *= d;
    if (n % row != 0 || filled_ + n > total)
        throw Error("GGUF writer: tensor '" + t->name + "': " + std::to_string(n) + " values are not whole rows of " +
                    std::to_string(row) + " within its " + std::to_string(total));
    std::vector<uint8_t> buf(size_t(ggml_type_bytes(t->type, n)));
    switch (t->type) {
    case GgmlType::F32: std::memcpy(buf.data(), v, size_t(n) * 4); break;
    case GgmlType::F16:
        for (int64_t i = 0; i < n; ++i) {
            const uint16_t h = c10::Half(v[i]).x;
            std::memcpy(buf.data() + 2 * i, &h, 2);
        }
        break;
    case GgmlType::BF16:
        for (int64_t i = 0; i < n; ++i) {
            const uint16_t h = c10::BFloat16(v[i]).x; // round to nearest even, as ggml's fp32_to_bf16
            std::memcpy(buf.data() + 2 * i, &h, 2);
        }
        break;
    case GgmlType::Q8_0:
        for (int64_t r = 0; r < n / row; ++r)
            kernels::quantize_row_q8_0(v + r * row, reinterpret_cast<kernels::BlockQ8_0*>(buf.data()) + r * row / 32, row);
        break;
    case GgmlType::Q4_0:
        for (int64_t r = 0; r < n / row; ++r)
            kernels::quantize_row_q4_0(v + r * row, reinterpret_cast<kernels::BlockQ4_0*>(buf.data()) + r * row / 32, row);
        break;
    }
    gguf_put(f_, buf.data(), buf.size(), tmp_);
    filled_ += n;
    if (filled_ == total) {
        pad();
        ++next_, filled_ = 0;
    }
}

void GgufWriter::finish() {
    if (const Tensor* t = current())
        throw Error("GGUF writer: tensor '" + t->name + "' and " + std::to_string(tensors_.size() - next_ - 1) +
                    " more were not written");
    if (std::fclose(f_) != 0) {
        f_ = nullptr;
        throw Error("cannot write '" + tmp_ + "'");
    }
    f_ = nullptr;
    std::error_code ec;
    std::filesystem::rename(tmp_, path_, ec);
    if (ec) throw Error("cannot rename '" + tmp_ + "' to '" + path_ + "': " + ec.message());
}

} // namespace anchor::text
