#include "cache/io/safetensors.h"

#include "cache/io/atomic_file.h"
#include "cache/io/error.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <limits>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace anchor {

namespace {

struct DTypeRow {
    DType t;
    const char* name;
    size_t size;
    torch::ScalarType st;
};

// One table drives parsing, naming, sizes and the torch mapping.
const DTypeRow kDTypes[] = {
    {DType::F32, "F32", 4, torch::kFloat32}, {DType::F16, "F16", 2, torch::kFloat16},
    {DType::BF16, "BF16", 2, torch::kBFloat16}, {DType::F64, "F64", 8, torch::kFloat64},
    {DType::I64, "I64", 8, torch::kInt64},   {DType::I32, "I32", 4, torch::kInt32},
    {DType::U8, "U8", 1, torch::kUInt8},     {DType::BOOL, "BOOL", 1, torch::kBool},
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
const char* dtype_name(DType t) { return row(t).name; }
size_t dtype_size(DType t) { return row(t).size; }
torch::ScalarType to_torch(DType t) { return row(t).st; }
DType from_torch(torch::ScalarType st) {
    for (const auto& r : kDTypes)
        if (r.st == st) return r.t;
    throw Error(std::string("safetensors cannot store torch dtype ") + c10::toString(st));
}

int64_t TensorInfo::numel() const {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    return n;
}

SafeTensorsFile::~SafeTensorsFile() {
    if (map_) ::munmap(map_, map_size_);
}

std::shared_ptr<SafeTensorsFile> SafeTensorsFile::open(const std::string& path) {
    int fd = ::open(path.c_str(), O_RDONLY);
    if (fd < 0) throw Error("cannot open '" + path + "': " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        ::close(fd);
        throw Error("'" + path + "' is not a regular file");
    }
    std::shared_ptr<SafeTensorsFile> f(new SafeTensorsFile());
    f->self_ = f;
    f->path_ = path;
    f->map_size_ = static_cast<size_t>(st.st_size);
    if (f->map_size_ > 0) {
        // MAP_PRIVATE + PROT_WRITE: copy-on-write, so an in-place op on a returned view can never reach the file.
        void* m = ::mmap(nullptr, f->map_size_, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
        if (m == MAP_FAILED) {
            ::close(fd);
            throw Error("cannot memory-map '" + path + "': " + std::strerror(errno));
        }
        f->map_ = m;
    }
    ::close(fd);
    f->parse(static_cast<const char*>(f->map_), f->map_size_);
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
    const std::string& p = path_;
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
    data_ = base + 8 + n;
    data_size_ = size - 8 - n;

    for (auto it = h.begin(); it != h.end(); ++it) {
        const std::string& name = it.key();
        const auto& v = it.value();
        if (name == "__metadata__") {
            if (!v.is_object()) throw Error("safetensors file '" + p + "': __metadata__ is not an object");
            for (auto m = v.begin(); m != v.end(); ++m) {
                if (!m.value().is_string())
                    throw Error("safetensors file '" + p + "': __metadata__ value of '" + m.key() + "' is not a string");
                metadata_[m.key()] = m.value().get<std::string>();
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
            throw Error(where + ": unknown dtype '" + ds + "' (known: F32, F16, BF16, F64, I64, I32, U8, BOOL)");
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
        index_[name] = infos_.size();
        infos_.push_back(std::move(ti));
    }

    // Offsets: sorted by begin they must not overlap and must lie inside the data area.
    std::vector<const TensorInfo*> order;
    for (const auto& t : infos_) order.push_back(&t);
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
    if (prev_end > data_size_) {
        // A complete, gap-free layout that runs past the end of the file means the file was cut short; otherwise one
        // tensor's offsets point outside the data area.
        if (contiguous)
            throw Error("safetensors file '" + p + "' is truncated: the header describes " + std::to_string(prev_end) +
                        " data bytes but only " + std::to_string(data_size_) + " follow the header");
        for (const auto* t : order)
            if (t->end > data_size_)
                throw Error("safetensors file '" + p + "', tensor '" + t->name + "': data_offsets [" +
                            std::to_string(t->begin) + ", " + std::to_string(t->end) +
                            ") are outside the data area of " + std::to_string(data_size_) + " bytes");
    }
}

const TensorInfo& SafeTensorsFile::info(const std::string& name) const {
    auto it = index_.find(name);
    if (it == index_.end()) throw Error("safetensors file '" + path_ + "' has no tensor '" + name + "'");
    return infos_[it->second];
}

torch::Tensor SafeTensorsFile::tensor(const std::string& name) const {
    const TensorInfo& ti = info(name);
    auto opts = torch::TensorOptions().dtype(to_torch(ti.dtype));
    const char* ptr = data_ + ti.begin;
    const size_t es = dtype_size(ti.dtype);
    if (ti.numel() == 0) return torch::empty(ti.shape, opts);
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

std::string safetensors_bytes(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata) {
    struct Item {
        std::string name;
        torch::Tensor t;
        DType dt;
    };
    std::vector<Item> items;
    for (const auto& [name, t] : tensors) {
        if (name == "__metadata__") throw Error("a tensor cannot be named __metadata__");
        items.push_back({name, t.detach().to(torch::kCPU).contiguous(), from_torch(t.scalar_type())});
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
    std::string out;
    out.reserve(8 + hs.size() + off);
    uint64_t n = hs.size();
    for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
    out += hs;
    for (const auto& it : items)
        if (it.t.numel() > 0) out.append(static_cast<const char*>(it.t.data_ptr()), it.t.numel() * dtype_size(it.dt));
    return out;
}

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata, bool overwrite) {
    write_file_atomic(path, safetensors_bytes(tensors, metadata), overwrite);
}

} // namespace anchor
