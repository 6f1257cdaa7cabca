#include "cache/io/safetensors.h"

#include "cache/io/atomic_file.h"
#include "cache/io/error.h"
#include "cache/io/mapped_file.h"

#include <functional>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fcntl.h>
#include <limits>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace anchor {

namespace {

// The torch side of the dtype table in safetensors_header.cpp: one row per DType, read both ways.
const std::pair<DType, torch::ScalarType> kTorchTypes[] = {
    {DType::F32, torch::kFloat32}, {DType::F16, torch::kFloat16}, {DType::BF16, torch::kBFloat16},
    {DType::F64, torch::kFloat64}, {DType::I64, torch::kInt64},   {DType::I32, torch::kInt32},
    {DType::U8, torch::kUInt8},    {DType::BOOL, torch::kBool},
};

bool is_float8(DType t) {
    return t == DType::F8_E4M3 || t == DType::F8_E5M2;
}

// The value of each float8 byte as bfloat16 bits. e4m3fn (OCP FP8 E4M3, "fn": no infinities): exponent bias 7, 3
// mantissa bits, S.1111.111 is NaN; e5m2: bias 15, 2 mantissa bits, IEEE-like infinities and NaNs. Exponent 0 is
// subnormal (m / 2^mbits * 2^(1 - bias)). Every such value has at most 4 significant bits and a binary exponent in
// [-16, 15], so bfloat16 (8 significant bits, float32's exponent range) holds each exactly: the float32 value's top
// 16 bits are it.
const std::array<uint16_t, 256>& float8_to_bf16_table(DType t) {
    auto make = [](int ebits, int mbits, bool fn) {
        std::array<uint16_t, 256> table{};
        const int bias = (1 << (ebits - 1)) - 1, emax = (1 << ebits) - 1;
        for (int b = 0; b < 256; ++b) {
            const bool neg = (b & 0x80) != 0;
            const int e = (b >> mbits) & emax, m = b & ((1 << mbits) - 1);
            float v;
            if (fn && e == emax && m == (1 << mbits) - 1)
                v = std::numeric_limits<float>::quiet_NaN();
            else if (!fn && e == emax)
                v = m == 0 ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
            else if (e == 0)
                v = std::ldexp(float(m), 1 - bias - mbits);
            else
                v = std::ldexp(float((1 << mbits) + m), e - bias - mbits);
            if (neg) v = -v;
            uint32_t bits;
            std::memcpy(&bits, &v, 4);
            table[b] = uint16_t(bits >> 16);
        }
        return table;
    };
    static const std::array<uint16_t, 256> e4m3 = make(4, 3, true), e5m2 = make(5, 2, false);
    return t == DType::F8_E4M3 ? e4m3 : e5m2;
}

} // namespace

torch::ScalarType to_torch(DType t) {
    if (is_float8(t)) return torch::kBFloat16; // decoded at read (SafeTensorsFile::tensor)
    for (const auto& [d, st] : kTorchTypes)
        if (d == t) return st;
    throw Error("internal: unknown DType");
}
DType from_torch(torch::ScalarType st) {
    for (const auto& [d, s] : kTorchTypes)
        if (s == st) return d;
    throw Error(std::string("safetensors cannot store torch dtype ") + c10::toString(st));
}

SafeTensorsFile::~SafeTensorsFile() {}

std::shared_ptr<SafeTensorsFile> SafeTensorsFile::open(const std::string& path) {
    MappedFile mapped(path);
    std::shared_ptr<SafeTensorsFile> f(new SafeTensorsFile());
    f->self_ = f;
    f->path_ = path;
    f->mapped_ = std::move(mapped);
    f->parse(f->mapped_.data(), f->mapped_.size());
    return f;
}

std::shared_ptr<SafeTensorsFile> SafeTensorsFile::from_bytes(const std::string& bytes, const std::string& label) {
    std::shared_ptr<SafeTensorsFile> f(new SafeTensorsFile());
    f->self_ = f;
    f->path_ = label;
    f->owned_ = bytes;
    f->parse(f->owned_.data(), f->owned_.size());
    return f;
}

void SafeTensorsFile::parse(const char* base, size_t size) {
    header_ = parse_safetensors_header(base, size, path_);
    data_ = base + header_.data_offset;
}

const TensorInfo& SafeTensorsFile::info(const std::string& name) const {
    auto it = header_.index.find(name);
    if (it == header_.index.end()) throw Error("safetensors file '" + path_ + "' has no tensor '" + name + "'");
    return header_.tensors[it->second];
}

torch::Tensor SafeTensorsFile::tensor(const std::string& name) const {
    const TensorInfo& ti = info(name);
    auto opts = torch::TensorOptions().dtype(to_torch(ti.dtype));
    const char* ptr = data_ + ti.begin;
    const size_t es = dtype_size(ti.dtype);
    if (ti.numel() == 0) return torch::empty(ti.shape, opts);
    if (is_float8(ti.dtype)) {
        // LibTorch has no float8 type: the bytes are decoded into a bfloat16 copy, exactly (float8_to_bf16_table).
        const auto& table = float8_to_bf16_table(ti.dtype);
        auto t = torch::empty(ti.shape, opts);
        auto* out = reinterpret_cast<uint16_t*>(t.data_ptr());
        const auto* in = reinterpret_cast<const uint8_t*>(ptr);
        const int64_t n = ti.numel();
        for (int64_t i = 0; i < n; ++i) out[i] = table[in[i]];
        return t;
    }
    if (reinterpret_cast<uintptr_t>(ptr) % es != 0) {
        // Unaligned data (legal in the format): copy instead of handing vector code a misaligned pointer.
        auto t = torch::empty(ti.shape, opts);
        std::memcpy(t.data_ptr(), ptr, ti.end - ti.begin);
        return t;
    }
    auto keep = self_.lock();
    return torch::from_blob(
        const_cast<char*>(ptr), ti.shape, [keep](void*) mutable { keep.reset(); }, opts);
}

namespace {

// The header (length prefix included, padded to 8 bytes) and the tensors in file order; `sink` gets the bytes.
void write_safetensors_to(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata,
                          const std::function<void(const char*, size_t)>& sink) {
    struct Item {
        std::string name;
        torch::Tensor t;
        DType dt;
    };
    std::vector<Item> items;
    for (const auto& [name, t] : tensors) {
        if (name == "__metadata__") throw Error("a tensor cannot be named __metadata__");
        items.push_back({name, t.detach(), from_torch(t.scalar_type())});
    }
    std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
        size_t sa = dtype_size(a.dt), sb = dtype_size(b.dt);
        return sa != sb ? sa > sb : a.name < b.name;
    });
    nlohmann::ordered_json h = nlohmann::ordered_json::object();
    if (!metadata.empty()) {
        nlohmann::ordered_json m = nlohmann::ordered_json::object();
        for (const auto& [k, v] : metadata) m[k] = v;
        h["__metadata__"] = m;
    }
    uint64_t off = 0;
    for (const auto& it : items) {
        uint64_t nb = static_cast<uint64_t>(it.t.numel()) * dtype_size(it.dt);
        if (h.contains(it.name)) throw Error("duplicate tensor name '" + it.name + "'");
        h[it.name] = {{"dtype", dtype_name(it.dt)}, {"shape", it.t.sizes().vec()}, {"data_offsets", {off, off + nb}}};
        off += nb;
    }
    std::string hs = h.dump();
    // Pad the header with spaces so the data area starts 8-byte aligned (as the reference writer does).
    while ((8 + hs.size()) % 8 != 0) hs.push_back(' ');
    char len[8];
    const uint64_t n = hs.size();
    for (int i = 0; i < 8; ++i) len[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    sink(len, 8);
    sink(hs.data(), hs.size());
    for (const auto& it : items) {
        if (it.t.numel() == 0) continue;
        const auto c = it.t.to(torch::kCPU).contiguous(); // one tensor at a time: no second copy of the file
        sink(static_cast<const char*>(c.data_ptr()), size_t(c.numel()) * dtype_size(it.dt));
    }
}

} // namespace

void SafeTensorsFile::release_pages(const torch::Tensor& view) const {
    if (view.defined() && view.is_contiguous() && view.device().is_cpu())
        mapped_.release(view.data_ptr(), size_t(view.numel()) * view.element_size());
}

std::string safetensors_bytes(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata) {
    std::string out;
    write_safetensors_to(tensors, metadata, [&](const char* p, size_t n) { out.append(p, n); });
    return out;
}

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata, bool overwrite) {
    // Streamed to the temporary file: a multi-GB checkpoint is not built in memory first.
    write_via_temp(
        path,
        [&](const std::string& tmp) {
            FILE* f = std::fopen(tmp.c_str(), "wb");
            if (!f) throw Error("cannot create '" + tmp + "': " + std::strerror(errno));
            bool ok = true;
            try {
                write_safetensors_to(tensors, metadata,
                                     [&](const char* p, size_t n) { ok = ok && std::fwrite(p, 1, n, f) == n; });
            } catch (...) {
                std::fclose(f);
                throw;
            }
            if (std::fclose(f) != 0 || !ok) throw Error("cannot write '" + tmp + "': " + std::strerror(errno));
        },
        overwrite);
}

} // namespace anchor
