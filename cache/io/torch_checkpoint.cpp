#include "cache/io/torch_checkpoint.h"

#include "cache/io/error.h"
#include "cache/io/mapped_file.h"
#include "cache/io/pickle.h"
#include "cache/io/zip_file.h"
#include "cache/util/strings.h"

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <map>
#include <mutex>
#include <set>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace anchor {

namespace {

// The pre-1.6 torch.save format begins with the pickled magic number 0x1950a86a20f9469cfc6c (torch/serialization.py,
// MAGIC_NUMBER): PROTO 2, LONG1 of 10 bytes.
const unsigned char kLegacyMagic[] = {0x80, 0x02, 0x8a, 0x0a, 0x6c, 0xfc, 0x9c,
                                      0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19};

WeightFileKind sniff_bytes(const char* d, size_t n) {
    if (looks_like_zip(d, n)) return WeightFileKind::TorchZip;
    if (n >= sizeof(kLegacyMagic) && std::memcmp(d, kLegacyMagic, sizeof(kLegacyMagic)) == 0)
        return WeightFileKind::TorchLegacy;
    if (n >= 262 && std::memcmp(d + 257, "ustar", 5) == 0) return WeightFileKind::TorchLegacy; // torch < 0.4: tar
    // safetensors: an 8-byte little-endian header length, then the JSON header's '{'.
    if (n >= 9 && d[5] == 0 && d[6] == 0 && d[7] == 0 && d[8] == '{') return WeightFileKind::SafeTensors;
    return WeightFileKind::Other;
}

torch::ScalarType scalar_type(StorageDType t) {
    switch (t) {
    case StorageDType::Float:
        return torch::kFloat32;
    case StorageDType::Half:
        return torch::kFloat16;
    case StorageDType::BFloat16:
        return torch::kBFloat16;
    case StorageDType::Double:
        return torch::kFloat64;
    case StorageDType::Long:
        return torch::kInt64;
    case StorageDType::Int:
        return torch::kInt32;
    case StorageDType::Short:
        return torch::kInt16;
    case StorageDType::Char:
        return torch::kInt8;
    case StorageDType::Byte:
        return torch::kUInt8;
    case StorageDType::Bool:
        return torch::kBool;
    }
    return torch::kFloat32;
}

} // namespace

WeightFileKind sniff_weight_file(const std::string& path) {
    int fd = ::open(path.c_str(), O_RDONLY);
    if (fd < 0) return WeightFileKind::Other;
    char buf[512];
    size_t got = 0;
    while (got < sizeof(buf)) {
        const ssize_t r = ::read(fd, buf + got, sizeof(buf) - got);
        if (r <= 0) break;
        got += static_cast<size_t>(r);
    }
    ::close(fd);
    return sniff_bytes(buf, got);
}

bool has_torch_extension(const std::string& path) {
    for (const char* e : {".ckpt", ".pt", ".pth", ".bin"})
        if (ends_with(path, e)) return true;
    return false;
}

struct TorchCheckpoint::Impl {
    std::unique_ptr<ZipReader> zip;
    PickleDocument doc;
    std::string prefix; // "<archive>/"
    std::map<std::string, const PickleValue*> tensors;
    std::map<const PickleValue*, int> storage_uses;
    std::map<const PickleValue*, const ZipEntry*> records;
    mutable std::mutex mu;
    mutable std::set<const PickleValue*> checked;               // storages whose CRC was verified
    mutable std::map<const PickleValue*, std::string> inflated; // deflated records, read once
};

TorchCheckpoint::TorchCheckpoint() : impl_(new Impl) {}

TorchCheckpoint::~TorchCheckpoint() {
    impl_.reset();
}

std::shared_ptr<TorchCheckpoint> TorchCheckpoint::open(const std::string& path) {
    MappedFile mapped(path);
    std::shared_ptr<TorchCheckpoint> c(new TorchCheckpoint());
    c->self_ = c;
    c->path_ = path;
    c->mapped_ = std::move(mapped);
    c->base_ = c->mapped_.data();
    c->size_ = c->mapped_.size();
    c->parse();
    return c;
}

std::shared_ptr<TorchCheckpoint> TorchCheckpoint::from_bytes(const std::string& bytes, const std::string& label) {
    std::shared_ptr<TorchCheckpoint> c(new TorchCheckpoint());
    c->self_ = c;
    c->path_ = label;
    c->owned_ = bytes;
    c->base_ = c->owned_.data();
    c->size_ = c->owned_.size();
    c->parse();
    return c;
}

void TorchCheckpoint::parse() {
    const std::string& p = path_;
    switch (sniff_bytes(base_, size_)) {
    case WeightFileKind::TorchZip:
        break;
    case WeightFileKind::TorchLegacy:
        throw Error("'" + p +
                    "' is in the legacy torch.save format (torch < 1.6), which is not read: re-save it with torch >= "
                    "1.6 or convert it to safetensors");
    case WeightFileKind::SafeTensors:
        throw Error("'" + p + "' is a safetensors file, not a torch.save archive");
    case WeightFileKind::Other:
        if (size_ >= 2 && static_cast<unsigned char>(base_[0]) == 0x80)
            throw Error("'" + p + "' is a bare pickle, not a torch.save zip archive (not read)");
        throw Error("'" + p + "' is not a torch.save checkpoint (no zip signature)");
    }
    Impl& m = *impl_;
    m.zip.reset(new ZipReader(base_, size_, p));
    // Every record sits under one folder named after the archive (torch's PyTorchStreamWriter); find its data.pkl.
    for (const auto& e : m.zip->entries()) {
        const size_t slash = e.name.find('/');
        if (slash != std::string::npos && e.name.compare(slash, std::string::npos, "/data.pkl") == 0) {
            if (!m.prefix.empty())
                throw Error("torch checkpoint '" + p + "' holds two pickles ('" + m.prefix + "data.pkl' and '" +
                            e.name + "')");
            m.prefix = e.name.substr(0, slash + 1);
        }
    }
    if (m.prefix.empty())
        throw Error("torch checkpoint '" + p + "' has no <archive>/data.pkl record (not torch.save?)");
    if (const ZipEntry* bo = m.zip->find(m.prefix + "byteorder")) {
        const std::string order = m.zip->read(*bo, 64);
        if (order != "little")
            throw Error("torch checkpoint '" + p + "' stores its data in '" + order +
                        "' byte order; only little-endian checkpoints are read");
    }
    const bool torchscript = m.zip->find(m.prefix + "constants.pkl") != nullptr;
    const ZipEntry* pkl = m.zip->find(m.prefix + "data.pkl");
    const std::string pickle = m.zip->read(*pkl, uint64_t(1) << 30);
    m.doc = unpickle_torch(pickle.data(), pickle.size(), p + ":" + pkl->name);
    const PickleValue& root = m.doc.root();
    if (!root.is(PickleValue::Kind::Dict))
        throw Error("torch checkpoint '" + p + "' holds " + root.describe() + ", not a dict of tensors" +
                    (torchscript ? " (it is a TorchScript archive, torch.jit.save; save its state_dict instead)" : ""));
    const PickleValue* sd = root.get("state_dict");
    if (!sd || !sd->is(PickleValue::Kind::Dict)) sd = &root;
    std::vector<std::string> order;
    for (const auto& [k, v] : sd->entries) {
        // A tensor torch rebuilds some other way (quantized, sparse, a subclass) must not vanish without a word.
        if (k->is(PickleValue::Kind::String) && v->is(PickleValue::Kind::Opaque) && v->text.rfind("torch.", 0) == 0)
            throw Error("torch checkpoint '" + p + "', tensor '" + k->text + "' is built by '" + v->text +
                        "', which this reader does not support (only dense tensors are read)");
        if (!k->is(PickleValue::Kind::String) || !v->is(PickleValue::Kind::Tensor)) continue;
        if (!m.tensors.count(k->text)) order.push_back(k->text);
        m.tensors[k->text] = v; // a repeated key: the last value wins, as in Python
    }
    // No tensor at the top: one level of nested dicts, named "outer.inner" (A1111's textual-inversion .pt keeps its
    // vectors as {"string_to_param": {"*": tensor}}). A state dict with tensors at the top is never read this way.
    if (m.tensors.empty())
        for (const auto& [k, v] : sd->entries) {
            if (!k->is(PickleValue::Kind::String) || !v->is(PickleValue::Kind::Dict)) continue;
            for (const auto& [k2, v2] : v->entries) {
                if (!k2->is(PickleValue::Kind::String) || !v2->is(PickleValue::Kind::Tensor)) continue;
                const std::string name = k->text + "." + k2->text;
                if (!m.tensors.count(name)) order.push_back(name);
                m.tensors[name] = v2;
            }
        }
    if (m.tensors.empty()) {
        std::string keys;
        size_t shown = 0;
        for (const auto& [k, v] : sd->entries) {
            if (shown++ == 20) {
                keys += ", ...";
                break;
            }
            keys += (keys.empty() ? "" : ", ") + (k->is(PickleValue::Kind::String) ? k->text : k->describe());
        }
        throw Error("torch checkpoint '" + p + "' holds no tensors" + (sd == &root ? "" : " under \"state_dict\"") +
                    " (keys: " + (keys.empty() ? "none" : keys) + ")");
    }
    for (const auto& [name, t] : m.tensors) {
        const PickleValue* s = t->storage;
        ++m.storage_uses[s];
        if (m.records.count(s)) continue;
        const ZipEntry* e = m.zip->find(m.prefix + "data/" + s->key);
        if (!e)
            throw Error("torch checkpoint '" + p + "', tensor '" + name + "': its storage record '" + m.prefix +
                        "data/" + s->key + "' is missing from the archive");
        const uint64_t want = s->untyped ? s->numel : s->numel * storage_dtype_size(s->dtype);
        if (e->size != want)
            throw Error("torch checkpoint '" + p + "', tensor '" + name + "': storage record '" + e->name + "' holds " +
                        std::to_string(e->size) + " bytes, expected " + std::to_string(want) + " (" +
                        std::to_string(s->numel) +
                        (s->untyped ? " bytes" : std::string(" x ") + storage_dtype_name(s->dtype)) + ")");
        m.records[s] = e;
    }
    names_ = order;
}

bool TorchCheckpoint::has(const std::string& name) const {
    return impl_->tensors.count(name) != 0;
}

torch::Tensor TorchCheckpoint::tensor(const std::string& name) const {
    const Impl& m = *impl_;
    auto it = m.tensors.find(name);
    if (it == m.tensors.end()) throw Error("torch checkpoint '" + path_ + "' has no tensor '" + name + "'");
    const PickleValue* t = it->second;
    const PickleValue* s = t->storage;
    const ZipEntry* e = m.records.at(s);
    const char* data;
    {
        std::lock_guard<std::mutex> lock(m.mu);
        if (e->method == 0) {
            data = m.zip->stored_data(*e);
            if (!m.checked.count(s)) {
                m.zip->check_crc(*e);
                m.checked.insert(s);
            }
        } else {
            auto in = m.inflated.find(s);
            if (in == m.inflated.end()) in = m.inflated.emplace(s, m.zip->read(*e)).first; // CRC checked there
            data = in->second.data();
        }
    }
    const auto dtype = scalar_type(t->dtype);
    const auto opts = torch::TensorOptions().dtype(dtype);
    const int64_t es = static_cast<int64_t>(storage_dtype_size(t->dtype));
    const int64_t elems = static_cast<int64_t>(e->size) / es;
    int64_t numel = 1;
    for (int64_t d : t->shape) numel *= d;
    if (numel == 0) return torch::empty(t->shape, opts);
    torch::Tensor base;
    if (reinterpret_cast<uintptr_t>(data) % static_cast<uintptr_t>(es) != 0 || e->method != 0) {
        // Unaligned (legal in a zip) or inflated into a buffer we keep: an aligned copy of the storage.
        base = torch::empty({elems}, opts);
        std::memcpy(base.data_ptr(), data, static_cast<size_t>(elems * es));
    } else {
        auto keep = self_.lock();
        base = torch::from_blob(
            const_cast<char*>(data), {elems}, [keep](void*) mutable { keep.reset(); }, opts);
    }
    // Bounds were checked by the unpickler (offset + sum (size-1)*stride < elements of the storage).
    torch::Tensor v = base.as_strided(t->shape, t->stride, t->offset);
    const bool whole = v.is_contiguous() && t->offset == 0 && numel == elems && m.storage_uses.at(s) == 1;
    if (whole) return v;
    return v.clone(at::MemoryFormat::Contiguous);
}

} // namespace anchor
