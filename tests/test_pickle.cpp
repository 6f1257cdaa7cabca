// torch.save checkpoints (.ckpt/.pt): the zip reader (cache/io/zip_file.h), the restricted unpickler
// (cache/io/pickle.h) and their use through WeightMap / resolve_model / load_sd_models.
//
// tests/golden/ckpt/*.pt|ckpt were written by real torch (1.13, tests/golden/ckpt/generate/make_ckpts.py). Archives
// the tests need in other shapes (hostile pickles, corrupt zips, zip64 records, the tiny SD model) are built here by a
// small torch.save-compatible writer (stored or deflated records, 64-byte aligned data, protocol-2 pickle).
#include "cache/io/error.h"
#include "cache/io/model_source.h"
#include "cache/io/pickle.h"
#include "cache/io/safetensors.h"
#include "cache/io/torch_checkpoint.h"
#include "cache/io/weight_map.h"
#include "cache/io/zip_file.h"
#include "tests/test_cli_util.h"
#include "tests/test_util.h"
#include "unet/model/checkpoint.h"

#include <catch2/catch.hpp>
#include <zlib.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

using namespace anchor;
namespace fs = std::filesystem;

namespace {

using test::error_of;
using test::read_bytes;
using test::write_bytes;

void le(std::string& out, uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// ---- a minimal ZIP writer (APPNOTE.TXT): what torch's PyTorchStreamWriter produces ----

struct Record {
    std::string name, data;
    bool deflate = false;
};

std::string deflate_raw(const std::string& in) {
    z_stream zs{};
    REQUIRE(deflateInit2(&zs, 6, Z_DEFLATED, -MAX_WBITS, 8, Z_DEFAULT_STRATEGY) == Z_OK);
    std::string out(deflateBound(&zs, in.size()), '\0');
    zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in.data()));
    zs.avail_in = static_cast<uInt>(in.size());
    zs.next_out = reinterpret_cast<Bytef*>(&out[0]);
    zs.avail_out = static_cast<uInt>(out.size());
    REQUIRE(deflate(&zs, Z_FINISH) == Z_STREAM_END);
    out.resize(zs.total_out);
    deflateEnd(&zs);
    return out;
}

// Stored (or deflated) records, data 64-byte aligned through padding in the local extra field as torch does;
// `zip64`: every size and offset in zip64 extra fields and the zip64 end records, as torch writes large archives.
std::string zip_bytes(const std::vector<Record>& recs, bool zip64 = false) {
    std::string out, cd;
    for (const auto& r : recs) {
        const std::string body = r.deflate ? deflate_raw(r.data) : r.data;
        const uint32_t crc = static_cast<uint32_t>(
            ::crc32(0L, reinterpret_cast<const Bytef*>(r.data.data()), static_cast<uInt>(r.data.size())));
        const uint64_t offset = out.size();
        std::string z64;
        if (zip64) {
            le(z64, 0x0001, 2);
            le(z64, 16, 2);
            le(z64, r.data.size(), 8);
            le(z64, body.size(), 8);
        }
        std::string local;
        le(local, 0x04034b50, 4);
        le(local, zip64 ? 45 : 20, 2);
        le(local, 0, 2);
        le(local, r.deflate ? 8 : 0, 2);
        le(local, 0, 4); // time, date
        le(local, crc, 4);
        le(local, zip64 ? 0xffffffffu : body.size(), 4);
        le(local, zip64 ? 0xffffffffu : r.data.size(), 4);
        le(local, r.name.size(), 2);
        size_t extra = z64.size();
        const size_t unpadded = offset + 30 + r.name.size() + extra;
        size_t pad = (64 - (unpadded + 4) % 64) % 64;
        extra += 4 + pad;
        le(local, extra, 2);
        local += r.name + z64;
        le(local, 0x4246, 2); // "FB": torch's padding field
        le(local, pad, 2);
        local += std::string(pad, 'Z');
        out += local + body;
        std::string cz64;
        if (zip64) {
            le(cz64, 0x0001, 2);
            le(cz64, 24, 2);
            le(cz64, r.data.size(), 8);
            le(cz64, body.size(), 8);
            le(cz64, offset, 8);
        }
        le(cd, 0x02014b50, 4);
        le(cd, zip64 ? 45 : 20, 2);
        le(cd, zip64 ? 45 : 20, 2);
        le(cd, 0, 2);
        le(cd, r.deflate ? 8 : 0, 2);
        le(cd, 0, 4);
        le(cd, crc, 4);
        le(cd, zip64 ? 0xffffffffu : body.size(), 4);
        le(cd, zip64 ? 0xffffffffu : r.data.size(), 4);
        le(cd, r.name.size(), 2);
        le(cd, cz64.size(), 2);
        le(cd, 0, 2); // comment
        le(cd, 0, 2); // disk
        le(cd, 0, 2);
        le(cd, 0, 4);
        le(cd, zip64 ? 0xffffffffu : offset, 4);
        cd += r.name + cz64;
    }
    const uint64_t cd_offset = out.size();
    out += cd;
    if (zip64) {
        const uint64_t z = out.size();
        le(out, 0x06064b50, 4);
        le(out, 44, 8);
        le(out, 45, 2);
        le(out, 45, 2);
        le(out, 0, 4);
        le(out, 0, 4);
        le(out, recs.size(), 8);
        le(out, recs.size(), 8);
        le(out, cd.size(), 8);
        le(out, cd_offset, 8);
        le(out, 0x07064b50, 4);
        le(out, 0, 4);
        le(out, z, 8);
        le(out, 1, 4);
    }
    le(out, 0x06054b50, 4);
    le(out, 0, 4);
    le(out, zip64 ? 0xffff : recs.size(), 2);
    le(out, zip64 ? 0xffff : recs.size(), 2);
    le(out, zip64 ? 0xffffffffu : cd.size(), 4);
    le(out, zip64 ? 0xffffffffu : cd_offset, 4);
    le(out, 0, 2);
    return out;
}

// ---- a pickle writer for the opcodes torch.save uses (CPython Lib/pickletools.py) ----

struct Pickle {
    std::string b = std::string("\x80\x02", 2); // PROTO 2
    Pickle& op(char c) { return b.push_back(c), *this; }
    Pickle& str(const std::string& s) {
        b.push_back('X');
        le(b, s.size(), 4);
        b += s;
        return *this;
    }
    Pickle& global(const std::string& module, const std::string& name) {
        b += "c" + module + "\n" + name + "\n";
        return *this;
    }
    Pickle& integer(int64_t v) {
        if (v >= 0 && v < 256) {
            b.push_back('K');
            b.push_back(static_cast<char>(v));
        } else if (v >= INT32_MIN && v <= INT32_MAX) {
            b.push_back('J');
            le(b, static_cast<uint32_t>(static_cast<int32_t>(v)), 4);
        } else {
            b += "\x8a\x08";
            le(b, static_cast<uint64_t>(v), 8);
        }
        return *this;
    }
    Pickle& ints(const std::vector<int64_t>& v) {
        op('(');
        for (int64_t i : v) integer(i);
        return op('t');
    }
    Pickle& mark() { return op('('); }
    Pickle& tuple() { return op('t'); }
    Pickle& reduce() { return op('R'); }
    Pickle& dict() { return op('}'); }
    Pickle& setitems() { return op('u'); }
    Pickle& empty_tuple() { return op(')'); }
    Pickle& ordered_dict() { return global("collections", "OrderedDict").empty_tuple().reduce(); }
    // torch._utils._rebuild_tensor_v2(persistent storage id, offset, size, stride, False, OrderedDict())
    Pickle& tensor(const std::string& storage_type, const std::string& key, int64_t numel, int64_t offset,
                   const std::vector<int64_t>& size, const std::vector<int64_t>& stride) {
        global("torch._utils", "_rebuild_tensor_v2").mark();
        mark().str("storage").global("torch", storage_type).str(key).str("cpu").integer(numel).tuple().op('Q');
        integer(offset).ints(size).ints(stride).op('\x89').ordered_dict();
        return tuple().reduce();
    }
    std::string done() const { return b + "."; }
};

const char* storage_type(torch::ScalarType t) {
    switch (t) {
    case torch::kFloat32:
        return "FloatStorage";
    case torch::kFloat16:
        return "HalfStorage";
    case torch::kBFloat16:
        return "BFloat16Storage";
    case torch::kFloat64:
        return "DoubleStorage";
    case torch::kInt64:
        return "LongStorage";
    case torch::kInt32:
        return "IntStorage";
    case torch::kUInt8:
        return "ByteStorage";
    case torch::kBool:
        return "BoolStorage";
    default:
        FAIL("no storage type for this dtype");
        return "";
    }
}

// A Lightning-style checkpoint of `tensors` as torch.save writes it: {"epoch", "global_step", "state_dict":
// OrderedDict(name -> tensor), "callbacks": {name: <an unknown class, NEWOBJ + BUILD>}}.
std::string torch_ckpt_bytes(const NamedTensors& tensors, bool lightning = true, bool zip64 = false,
                             bool deflate = false) {
    Pickle p;
    std::vector<Record> recs;
    if (lightning) {
        p.dict().mark().str("epoch").integer(7).str("global_step").integer(70000).str("callbacks").dict();
        p.str("ModelCheckpoint{}").global("pytorch_lightning.callbacks.model_checkpoint", "ModelCheckpoint");
        p.empty_tuple().op('\x81').dict().mark().str("best_model_path").str("/x.ckpt").setitems().op('b').op('s');
        p.str("state_dict");
    }
    p.ordered_dict().mark();
    for (size_t i = 0; i < tensors.size(); ++i) {
        const auto t = tensors[i].second.contiguous();
        std::vector<int64_t> stride = t.strides().vec();
        p.str(tensors[i].first)
            .tensor(storage_type(t.scalar_type()), std::to_string(i), t.numel(), 0, t.sizes().vec(), stride);
        recs.push_back({"archive/data/" + std::to_string(i),
                        std::string(static_cast<const char*>(t.data_ptr()), t.numel() * t.element_size()), deflate});
    }
    p.setitems();
    if (lightning) p.setitems();
    recs.insert(recs.begin(), Record{"archive/data.pkl", p.done(), deflate});
    recs.push_back({"archive/version", "3\n"});
    recs.push_back({"archive/byteorder", "little"}); // torch 2.x writes these two as well
    recs.push_back({"archive/.data/serialization_id", "0123456789"});
    return zip_bytes(recs, zip64);
}

// A checkpoint holding `pickle` as its data.pkl plus storage records "0".."n-1" of `record_bytes` bytes each.
std::string ckpt_with_pickle(const std::string& pickle, int records = 0, size_t record_bytes = 16) {
    std::vector<Record> recs{{"archive/data.pkl", pickle}};
    for (int i = 0; i < records; ++i)
        recs.push_back({"archive/data/" + std::to_string(i), std::string(record_bytes, 0)});
    return zip_bytes(recs);
}

std::string ckpt_error(const std::string& bytes) {
    return error_of([&] { TorchCheckpoint::from_bytes(bytes, "test.ckpt"); });
}
std::string pickle_error(const std::string& pickle, const PickleLimits& lim = {}) {
    return error_of([&] { unpickle_torch(pickle.data(), pickle.size(), "test.pkl", lim); });
}

std::string golden_ckpt(const std::string& name) {
    return test::golden("ckpt/" + name);
}

} // namespace

TEST_CASE("a torch.save state dict (torch 1.13) reads every dtype, views and shared storages", "[pickle]") {
    auto ck = TorchCheckpoint::open(golden_ckpt("basic.pt"));
    CHECK(ck->names() == std::vector<std::string>{"f32", "f16", "bf16", "i64", "i32", "u8", "b", "f64_scalar", "empty",
                                                  "base", "base_t", "slice", "strided", "param"});
    auto f32 = ck->tensor("f32");
    CHECK(f32.scalar_type() == torch::kFloat32);
    CHECK(torch::equal(f32, torch::arange(6, torch::kFloat32).reshape({2, 3}) / 4));
    auto f16 = ck->tensor("f16");
    CHECK(f16.scalar_type() == torch::kFloat16);
    CHECK(torch::equal(f16, (torch::arange(4, torch::kFloat32) - 1.5).to(torch::kFloat16)));
    auto bf16 = ck->tensor("bf16");
    CHECK(bf16.scalar_type() == torch::kBFloat16);
    CHECK(torch::equal(bf16, (torch::arange(4, torch::kFloat32) * 0.5).to(torch::kBFloat16).reshape({2, 2})));
    auto i64 = ck->tensor("i64");
    CHECK(i64.scalar_type() == torch::kInt64);
    CHECK(i64[0].item<int64_t>() == -3);
    CHECK(i64[2].item<int64_t>() == (int64_t(1) << 40));
    CHECK(torch::equal(ck->tensor("i32"), torch::tensor({7, -7}, torch::dtype(torch::kInt32))));
    CHECK(torch::equal(ck->tensor("u8"), torch::tensor({0, 255}, torch::dtype(torch::kInt32)).to(torch::kUInt8)));
    auto b = ck->tensor("b");
    CHECK(b.scalar_type() == torch::kBool);
    CHECK(b.sizes().vec() == std::vector<int64_t>{3});
    CHECK((b[0].item<bool>() && !b[1].item<bool>() && b[2].item<bool>()));
    auto s = ck->tensor("f64_scalar");
    CHECK(s.dim() == 0);
    CHECK(s.item<double>() == 2.5);
    CHECK(ck->tensor("empty").sizes().vec() == std::vector<int64_t>{0, 3});
    auto base = torch::arange(12, torch::kFloat32).reshape({3, 4});
    CHECK(torch::equal(ck->tensor("base"), base));
    // A transposed view of a shared storage: its own contiguous copy, with the transposed values.
    auto bt = ck->tensor("base_t");
    CHECK(bt.is_contiguous());
    CHECK(torch::equal(bt, base.t()));
    CHECK(bt.data_ptr() != ck->tensor("base").data_ptr());
    auto range = torch::arange(10, torch::kFloat32);
    CHECK(torch::equal(ck->tensor("slice"), range.slice(0, 2, 7)));
    CHECK(torch::equal(ck->tensor("strided"), range.slice(0, 1, 10, 3)));
    CHECK(torch::equal(ck->tensor("param"), torch::full({2}, 0.25)));
    // Writing to a tensor never reaches the file (copy-on-write mapping) nor a tensor copied from the same storage.
    ck->tensor("base").fill_(9);
    CHECK(torch::equal(bt, base.t()));
    ck->tensor("f32").fill_(9); // a view of the mapping
    CHECK(torch::equal(TorchCheckpoint::open(golden_ckpt("basic.pt"))->tensor("f32"),
                       torch::arange(6, torch::kFloat32).reshape({2, 3}) / 4));
}

TEST_CASE("a pickle_protocol=4 torch.save file reads the same tensors", "[pickle]") {
    auto a = TorchCheckpoint::open(golden_ckpt("basic.pt"));
    auto b = TorchCheckpoint::open(golden_ckpt("protocol4.pt"));
    REQUIRE(a->names() == b->names());
    for (const auto& n : a->names()) {
        INFO(n);
        CHECK(a->tensor(n).scalar_type() == b->tensor(n).scalar_type());
        CHECK(torch::equal(a->tensor(n), b->tensor(n)));
    }
}

TEST_CASE("a Lightning checkpoint: state_dict unwrapped, unknown globals in its metadata read as placeholders",
          "[pickle]") {
    auto ck = TorchCheckpoint::open(golden_ckpt("lightning.ckpt"));
    CHECK(ck->names() == std::vector<std::string>{"model.w", "model.b"});
    CHECK(torch::equal(ck->tensor("model.w"), torch::arange(4, torch::kFloat16).reshape({2, 2})));
    CHECK(torch::equal(ck->tensor("model.b"), torch::ones({2})));
    // The metadata, through the unpickler itself.
    const std::string bytes = read_bytes(golden_ckpt("lightning.ckpt"));
    ZipReader zip(bytes.data(), bytes.size(), "lightning.ckpt");
    const ZipEntry* pkl = zip.find("lightning/data.pkl");
    REQUIRE(pkl);
    const std::string pickle = zip.read(*pkl);
    auto doc = unpickle_torch(pickle.data(), pickle.size(), "lightning.ckpt");
    const PickleValue& root = doc.root();
    REQUIRE(root.is(PickleValue::Kind::Dict));
    CHECK(root.get("epoch")->integer == 3);
    CHECK(root.get("global_step")->integer == 1234);
    CHECK(root.get("pytorch-lightning_version")->text == "1.9.0");
    const PickleValue* cb = root.get("callbacks")->get("ModelCheckpoint{'monitor': None}");
    REQUIRE(cb);
    CHECK(cb->is(PickleValue::Kind::Opaque));
    CHECK(cb->text == "pytorch_lightning.callbacks.model_checkpoint.ModelCheckpoint");
    const PickleValue* opt = root.get("optimizer_states");
    REQUIRE(opt->is(PickleValue::Kind::List));
    REQUIRE(opt->items.size() == 1);
    const PickleValue* groups = opt->items[0]->get("param_groups");
    REQUIRE(groups->items.size() == 1);
    CHECK(groups->items[0]->get("lr")->real == 1e-4);
    const PickleValue* hp = root.get("hparams");
    CHECK(hp->get("np_scalar")->is(PickleValue::Kind::Opaque));
    CHECK(hp->get("np_scalar")->text == "numpy.core.multiarray.scalar");
    CHECK(hp->get("bytes")->text == "_codecs.encode");
    CHECK(hp->get("a_set")->is(PickleValue::Kind::Set));
    CHECK(hp->get("a_set")->items.size() == 2);
    CHECK(hp->get("frozen")->items.size() == 1);
    CHECK(hp->get("big")->is(PickleValue::Kind::Opaque)); // 2**70: past int64, metadata only
    CHECK(hp->get("neg")->integer == -(int64_t(1) << 62));
    CHECK(hp->get("float")->real == 1.5);
    CHECK(hp->get("tuple")->items.size() == 4);
    // Through WeightMap: only the state dict.
    auto wm = WeightMap::load(golden_ckpt("lightning.ckpt"));
    CHECK(wm.names() == std::vector<std::string>{"model.b", "model.w"});
    CHECK(wm.source("model.w") == golden_ckpt("lightning.ckpt"));
}

TEST_CASE("the legacy (pre-1.6) torch.save format is refused with advice", "[pickle]") {
    const std::string msg = error_of([] { WeightMap::load(golden_ckpt("legacy.pt")); });
    CHECK_THAT(msg, Catch::Contains("legacy torch.save format"));
    CHECK_THAT(msg, Catch::Contains("convert it to safetensors"));
    CHECK_THAT(msg, Catch::Contains("legacy.pt"));
}

TEST_CASE("a pickle calling os.system is refused, naming the global, and nothing runs", "[pickle]") {
    // Written by real torch: REDUCE(posix.system, ("touch /tmp/anchorcache_pickle_pwned",)).
    fs::remove("/tmp/anchorcache_pickle_pwned");
    std::string msg = error_of([] { WeightMap::load(golden_ckpt("hostile_os_system.pt")); });
    CHECK_THAT(msg, Catch::Contains("refusing the global 'posix.system'"));
    CHECK_THAT(msg, Catch::Contains("hostile_os_system.pt"));
    CHECK(!fs::exists("/tmp/anchorcache_pickle_pwned"));
    // Hand-built, the command creating a file in our scratch folder; nothing creates it.
    const std::string dir = test::scratch_dir("pickle_hostile");
    const std::string marker = dir + "/pwned";
    for (const auto& [module, name] : std::vector<std::pair<std::string, std::string>>{{"os", "system"},
                                                                                       {"posix", "system"},
                                                                                       {"subprocess", "check_call"},
                                                                                       {"builtins", "eval"},
                                                                                       {"__builtin__", "exec"},
                                                                                       {"builtins", "getattr"},
                                                                                       {"builtins", "__import__"},
                                                                                       {"nt", "system"}}) {
        INFO(module << "." << name);
        Pickle p;
        p.dict().str("state_dict").dict().str("w").tensor("FloatStorage", "0", 4, 0, {4}, {1}).op('s').op('s');
        p.str("x").global(module, name).mark().str("touch " + marker).tuple().reduce().op('s');
        const std::string file = dir + "/hostile.ckpt";
        write_bytes(file, ckpt_with_pickle(p.done(), 1));
        msg = error_of([&] { WeightMap::load(file); });
        CHECK_THAT(msg, Catch::Contains("refusing the global '" + module + "." + name + "'"));
        CHECK_THAT(msg, Catch::Contains("hostile.ckpt"));
        CHECK_THAT(msg, Catch::Contains("offset "));
        CHECK(!fs::exists(marker));
    }
    // Through STACK_GLOBAL (protocol 4) and nested inside a placeholder's arguments: refused too.
    Pickle p;
    p.dict().str("a").global("foo", "Bar").mark();
    p.op('\x8c').op(2).b += "os";
    p.op('\x8c').op(6).b += "system";
    p.op('\x93').mark().str("touch " + marker).tuple().reduce().tuple().reduce().op('s');
    msg = pickle_error(p.done());
    CHECK_THAT(msg, Catch::Contains("refusing the global 'os.system'"));
    CHECK(!fs::exists(marker));
}

TEST_CASE("unknown globals are inert placeholders, an error where tensor data is needed", "[pickle]") {
    // Nested REDUCE / NEWOBJ / BUILD / SETITEMS / APPENDS on placeholders: all placeholders, the tensors load.
    Pickle p;
    p.dict().mark().str("state_dict").dict().str("w").tensor("FloatStorage", "0", 4, 0, {2, 2}, {2, 1}).op('s');
    p.str("meta").global("some.module", "Outer").mark().global("some.module", "Inner").empty_tuple().reduce();
    p.tuple().reduce().dict().op('b').mark().integer(1).integer(2).setitems().mark().integer(3).op('e');
    p.str("obj").global("copy_reg", "_reconstructor").mark().global("a.b", "C").global("__builtin__", "object");
    p.op('N').tuple().reduce().setitems();
    auto ck = TorchCheckpoint::from_bytes(ckpt_with_pickle(p.done(), 1), "placeholders.ckpt");
    CHECK(ck->names() == std::vector<std::string>{"w"});
    CHECK(ck->tensor("w").sizes().vec() == std::vector<int64_t>{2, 2});
    auto doc = unpickle_torch(p.done().data(), p.done().size(), "x");
    CHECK(doc.root().get("meta")->text == "some.module.Outer");
    CHECK(doc.root().get("obj")->text == "copy_reg._reconstructor");
    // A placeholder as a tensor's storage, a placeholder function for _rebuild_from_type_v2.
    Pickle q;
    q.dict().str("w").global("torch._utils", "_rebuild_tensor_v2").mark().global("evil", "Storage").empty_tuple();
    q.reduce().integer(0).ints({1}).ints({1}).op('\x89').ordered_dict().tuple().reduce().op('s');
    std::string msg = ckpt_error(ckpt_with_pickle(q.done()));
    CHECK_THAT(msg, Catch::Contains("the storage of a tensor is a placeholder of 'evil.Storage'"));
    Pickle r;
    r.dict().str("w").global("torch._tensor", "_rebuild_from_type_v2").mark().global("evil", "rebuild");
    r.global("torch", "Tensor").empty_tuple().dict().tuple().reduce().op('s');
    msg = pickle_error(r.done());
    CHECK_THAT(msg, Catch::Contains("placeholder of 'evil.rebuild'"));
}

TEST_CASE("hostile pickles: limits and malformed input are errors, never allocations or crashes", "[pickle]") {
    auto raw = [](const std::string& s) { return std::string("\x80\x02", 2) + s; };
    // An oversized memo index.
    CHECK_THAT(pickle_error(raw(std::string("N") + "r\xff\xff\xff\xff" + ".")), Catch::Contains("memo index"));
    CHECK_THAT(pickle_error(raw(std::string("j\x10\x00\x00\x00.", 6))), Catch::Contains("never set"));
    // A 4 GiB string length in a tiny file: refused before anything is allocated.
    CHECK_THAT(pickle_error(raw(std::string("X\x00\xff\xff\x0f"
                                            "abc",
                                            8))),
               Catch::Contains("only 3 left"));
    CHECK_THAT(pickle_error(raw(std::string("\x8d\xff\xff\xff\xff\xff\xff\xff\x7f", 9))), Catch::Contains("more than"));
    PickleLimits small;
    small.max_string = 4;
    CHECK_THAT(pickle_error(raw(std::string("X\x05\x00\x00\x00hello.", 11)), small),
               Catch::Contains("a string of 5 bytes"));
    // Stack depth, element count.
    small = {};
    small.max_stack = 100;
    CHECK_THAT(pickle_error(raw(std::string(200, ']') + "."), small), Catch::Contains("stack deeper"));
    CHECK_THAT(pickle_error(raw(std::string(200, '(') + "."), small), Catch::Contains("stack deeper"));
    small = {};
    small.max_elements = 50;
    CHECK_THAT(pickle_error(raw("](" + std::string(60, 'N') + "e."), small), Catch::Contains("container elements"));
    // Copies count too: set(list) repeated.
    std::string copies = "](" + std::string(40, 'N') + std::string("eq\x00", 3);
    for (int i = 0; i < 5; ++i) copies += "c__builtin__\nset\n" + std::string("h\x00\x85R0", 5);
    CHECK_THAT(pickle_error(raw(copies + "N."), small), Catch::Contains("container elements"));
    small = {};
    small.max_values = 1000;
    CHECK_THAT(pickle_error(raw(std::string(2000, 'N') + "."), small), Catch::Contains("more than 1000 values"));
    // Underflow, no MARK, truncation, unknown and unsupported opcodes.
    CHECK_THAT(pickle_error(raw("s.")), Catch::Contains("stack underflow"));
    CHECK_THAT(pickle_error(raw("]e.")), Catch::Contains("no MARK"));
    CHECK_THAT(pickle_error(raw("]")), Catch::Contains("ends without STOP"));
    CHECK_THAT(pickle_error(raw("\xff.")), Catch::Contains("unknown opcode"));
    CHECK_THAT(pickle_error(raw("(i__main__\nX\n.")), Catch::Contains("opcode INST: opcode not supported"));
    CHECK_THAT(pickle_error(std::string("\x80\x09N.", 4)), Catch::Contains("pickle protocol 9"));
    // A list holding itself and a chain nested 100000 deep through one memo slot: parsed and freed without recursion.
    CHECK(pickle_error(raw(std::string("]q\x00h\x00"
                                       "a.",
                                       7)))
              .empty());
    std::string deep = "]";
    for (int i = 0; i < 100000; ++i)
        deep += std::string("]q\x00"
                            "a0h\x00",
                            7);
    CHECK(pickle_error(raw(deep + ".")).empty());
    // Tensors reaching past their storage, with mismatched size/stride, or overflowing.
    auto tensor_pickle = [](int64_t numel, int64_t offset, const std::vector<int64_t>& size,
                            const std::vector<int64_t>& stride) {
        Pickle p;
        p.dict().str("w").tensor("FloatStorage", "0", numel, offset, size, stride).op('s');
        return p.done();
    };
    CHECK_THAT(pickle_error(tensor_pickle(4, 1, {4}, {1})), Catch::Contains("reaches past the end of storage '0'"));
    CHECK_THAT(pickle_error(tensor_pickle(4, 0, {2, 2}, {3, 1})), Catch::Contains("reaches past the end"));
    CHECK_THAT(pickle_error(tensor_pickle(4, 0, {2, 2}, {1})), Catch::Contains("differ in length"));
    CHECK_THAT(pickle_error(tensor_pickle(4, 0, {int64_t(1) << 40, int64_t(1) << 40}, {0, 0})),
               Catch::Contains("impossibly large"));
    CHECK(pickle_error(tensor_pickle(4, 0, {3, 2}, {1, 1})).empty()); // overlapping strides stay inside: fine
    // A storage record of the wrong size, or referenced twice with different types.
    CHECK_THAT(ckpt_error(ckpt_with_pickle(tensor_pickle(8, 0, {8}, {1}), 1, 16)),
               Catch::Contains("holds 16 bytes, expected 32"));
    Pickle two;
    two.dict().mark().str("a").tensor("FloatStorage", "0", 4, 0, {4}, {1});
    two.str("b").tensor("HalfStorage", "0", 8, 0, {8}, {1}).setitems();
    CHECK_THAT(pickle_error(two.done()), Catch::Contains("different types or sizes"));
}

TEST_CASE("zip archives: truncated, corrupt or incomplete ones are clear errors naming the file", "[pickle]") {
    const std::string good = read_bytes(golden_ckpt("basic.pt"));
    // Truncated anywhere: no end-of-central-directory record (or a central directory outside the file).
    for (size_t keep : {size_t(0), size_t(10), good.size() / 2, good.size() - 30, good.size() - 1}) {
        INFO("kept " << keep << " bytes");
        const std::string msg = ckpt_error(good.substr(0, keep));
        CHECK_THAT(msg, Catch::Contains("test.ckpt"));
        CHECK(!msg.empty());
    }
    CHECK_THAT(ckpt_error(good.substr(0, good.size() / 2)), Catch::Contains("zip archive 'test.ckpt'"));
    CHECK_THAT(ckpt_error(good.substr(0, good.size() - 1)), Catch::Contains("no end-of-central-directory"));
    // A corrupt data record: the CRC check names the entry when the tensor is read.
    {
        std::string bad = good;
        const ZipReader zip(good.data(), good.size(), "x");
        const ZipEntry* e = zip.find("basic/data/0");
        REQUIRE(e);
        bad[e->data_offset] ^= 0x40;
        auto bad_ck = TorchCheckpoint::from_bytes(bad, "corrupt.pt");
        std::string msg = error_of([&] {
            for (const auto& n : bad_ck->names()) bad_ck->tensor(n);
        });
        CHECK_THAT(msg, Catch::Contains("zip archive 'corrupt.pt': entry 'basic/data/0' fails its CRC-32 check"));
        // A corrupt local header.
        bad = good;
        bad[e->header_offset] = 'X';
        CHECK_THAT(ckpt_error(bad), Catch::Contains("entry 'basic/data/0': no local file header"));
    }
    // A missing storage record.
    {
        Pickle p;
        p.dict().str("w").tensor("FloatStorage", "7", 4, 0, {4}, {1}).op('s');
        CHECK_THAT(ckpt_error(ckpt_with_pickle(p.done(), 1)),
                   Catch::Contains("tensor 'w': its storage record 'archive/data/7' is missing"));
    }
    // No data.pkl; not a zip at all; a safetensors file handed to the torch reader.
    CHECK_THAT(ckpt_error(zip_bytes({{"archive/other", "x"}})), Catch::Contains("no <archive>/data.pkl"));
    CHECK_THAT(ckpt_error("hello world, this is text"), Catch::Contains("not a torch.save checkpoint"));
    CHECK_THAT(ckpt_error(std::string("\x80\x02}.", 4)), Catch::Contains("bare pickle"));
    // A big-endian archive (torch 2.x writes <archive>/byteorder).
    {
        Pickle p;
        p.dict().str("w").tensor("FloatStorage", "0", 4, 0, {4}, {1}).op('s');
        CHECK_THAT(ckpt_error(zip_bytes({{"archive/data.pkl", p.done()},
                                         {"archive/byteorder", "big"},
                                         {"archive/data/0", std::string(16, 0)}})),
                   Catch::Contains("'big' byte order"));
    }
    // A tensor torch rebuilds another way (here a quantized one): an error naming it, not a silent gap.
    {
        Pickle p;
        p.dict().mark().str("w").tensor("FloatStorage", "0", 4, 0, {4}, {1});
        p.str("q").global("torch._utils", "_rebuild_qtensor").empty_tuple().reduce().setitems();
        CHECK_THAT(ckpt_error(ckpt_with_pickle(p.done(), 1)),
                   Catch::Contains("tensor 'q' is built by 'torch._utils._rebuild_qtensor'"));
    }
    // A root that is not a dict, and a dict with no tensors (its keys are listed).
    CHECK_THAT(ckpt_error(ckpt_with_pickle(Pickle().str("x").done())),
               Catch::Contains("holds the str 'x', not a dict"));
    CHECK_THAT(ckpt_error(ckpt_with_pickle(Pickle().dict().str("epoch").integer(3).op('s').done())),
               Catch::Contains("holds no tensors (keys: epoch)"));
}

TEST_CASE("zip archives: zip64 records and deflated entries read like stored ones", "[pickle]") {
    const NamedTensors ts = {{"a", torch::arange(10, torch::kFloat32)},
                             {"b", torch::arange(6, torch::kInt64).reshape({2, 3})},
                             {"c", torch::ones({3, 1, 2}, torch::kFloat16)}};
    const std::string dir = test::scratch_dir("pickle_zip64"); // kept: torch.load reads them too
    for (int variant = 0; variant < 4; ++variant) {
        const bool zip64 = variant & 1, deflate = variant & 2;
        INFO("zip64 " << zip64 << " deflate " << deflate);
        const std::string bytes = torch_ckpt_bytes(ts, true, zip64, deflate);
        write_bytes(dir + "/v" + std::to_string(variant) + ".ckpt", bytes);
        const ZipReader zip(bytes.data(), bytes.size(), "v");
        REQUIRE(zip.entries().size() == 7);
        CHECK(zip.find("archive/data/0")->size == 40);
        CHECK(zip.find("archive/data/0")->data_offset % 64 == 0);
        auto ck = TorchCheckpoint::from_bytes(bytes, "v.ckpt");
        REQUIRE(ck->names() == std::vector<std::string>{"a", "b", "c"});
        for (const auto& [n, t] : ts) {
            INFO(n);
            CHECK(ck->tensor(n).scalar_type() == t.scalar_type());
            CHECK(torch::equal(ck->tensor(n), t));
        }
    }
    // A deflated record whose data is cut short.
    std::string bytes = torch_ckpt_bytes(ts, false, false, true);
    const ZipReader zip(bytes.data(), bytes.size(), "d");
    const ZipEntry* e = zip.find("archive/data.pkl");
    bytes[e->data_offset + 2] ^= 0x55;
    CHECK(!ckpt_error(bytes).empty());
}

TEST_CASE("torch 2.x forms: untyped storages with _rebuild_tensor_v3, _rebuild_from_type_v2, parameters", "[pickle]") {
    Pickle p;
    p.dict().mark();
    // _rebuild_tensor_v3(UntypedStorage of 8 bytes, 0, (4,), (1,), False, OrderedDict(), torch.float16)
    p.str("v3").global("torch._utils", "_rebuild_tensor_v3").mark();
    p.mark().str("storage").global("torch", "UntypedStorage").str("0").str("cpu").integer(8).tuple().op('Q');
    p.integer(0).ints({4}).ints({1}).op('\x89').ordered_dict().global("torch", "float16").tuple().reduce();
    // _rebuild_from_type_v2(_rebuild_tensor_v2, torch.Tensor, (storage 1 args...), {})
    p.str("typed").global("torch._tensor", "_rebuild_from_type_v2").mark();
    p.global("torch._utils", "_rebuild_tensor_v2").global("torch", "Tensor").mark();
    p.mark().str("storage").global("torch", "FloatStorage").str("1").str("cpu").integer(2).tuple().op('Q');
    p.integer(0).ints({2}).ints({1}).op('\x89').ordered_dict().tuple().dict().tuple().reduce();
    // _rebuild_parameter(tensor, True, OrderedDict())
    p.str("param").global("torch._utils", "_rebuild_parameter").mark();
    p.tensor("FloatStorage", "1", 2, 1, {1}, {1}).op('\x88').ordered_dict().tuple().reduce();
    p.setitems();
    auto h = torch::tensor({1.0, -2.0, 0.5, 4.0}).to(torch::kFloat16);
    auto f = torch::tensor({3.0f, 5.0f});
    auto ck = TorchCheckpoint::from_bytes(
        zip_bytes({{"archive/data.pkl", p.done()},
                   {"archive/data/0", std::string(static_cast<const char*>(h.data_ptr()), 8)},
                   {"archive/data/1", std::string(static_cast<const char*>(f.data_ptr()), 8)}}),
        "torch2.pt");
    CHECK(ck->names() == std::vector<std::string>{"v3", "typed", "param"});
    CHECK(ck->tensor("v3").scalar_type() == torch::kFloat16);
    CHECK(torch::equal(ck->tensor("v3"), h));
    CHECK(torch::equal(ck->tensor("typed"), f));
    CHECK(torch::equal(ck->tensor("param"), f.slice(0, 1, 2)));
}

TEST_CASE("WeightMap and resolve_model take torch.save files by their bytes", "[pickle]") {
    const std::string dir = test::scratch_dir("pickle_dispatch");
    const std::string bytes = read_bytes(golden_ckpt("basic.pt"));
    // Any name: the bytes decide (a torch archive named .safetensors, a safetensors file named .ckpt).
    for (const char* name : {"w.ckpt", "w.pt", "w.pth", "w.bin", "w.safetensors"}) {
        INFO(name);
        write_bytes(dir + "/" + name, bytes);
        auto wm = WeightMap::load(dir + "/" + name);
        CHECK(wm.size() == 14);
        CHECK(torch::equal(wm.get("base_t"), torch::arange(12, torch::kFloat32).reshape({3, 4}).t()));
    }
    save_safetensors(dir + "/st.ckpt", {{"x", torch::ones({2})}});
    CHECK(torch::equal(WeightMap::load(dir + "/st.ckpt").get("x"), torch::ones({2})));
    // A sharded torch.save checkpoint through its index (pytorch_model.bin.index.json).
    write_bytes(dir + "/m-1.bin", torch_ckpt_bytes({{"x", torch::ones({2})}}, false));
    write_bytes(dir + "/m-2.bin", torch_ckpt_bytes({{"y", torch::full({3}, 2.0)}}, false));
    write_bytes(dir + "/pytorch_model.bin.index.json", R"({"weight_map": {"x": "m-1.bin", "y": "m-2.bin"}})");
    auto sharded = WeightMap::load(dir + "/pytorch_model.bin.index.json");
    CHECK(sharded.size() == 2);
    CHECK(torch::equal(sharded.get("y"), torch::full({3}, 2.0)));
    CHECK(sharded.source("y") == dir + "/m-2.bin");
    // A folder with only torch files: its weights.
    const std::string folder = test::scratch_dir("pickle_folder");
    write_bytes(folder + "/pytorch_model.bin", bytes);
    write_bytes(folder + "/training_args.bin", "not read");
    auto src = resolve_model(folder);
    CHECK(src.weight_files == std::vector<std::string>{folder + "/pytorch_model.bin"});
    CHECK(src.load_weights().size() == 14);
}

TEST_CASE("a diffusers component folder with only diffusion_pytorch_model.bin loads it", "[pickle][sd]") {
    const std::string golden = test::golden("sd/vae_tiny");
    auto st = SafeTensorsFile::open(golden + "/diffusion_pytorch_model.safetensors");
    NamedTensors ts;
    for (const auto& ti : st->tensors()) ts.emplace_back(ti.name, st->tensor(ti.name));
    const std::string dir = test::scratch_dir("pickle_vae_bin");
    fs::copy_file(golden + "/config.json", dir + "/config.json");
    write_bytes(dir + "/diffusion_pytorch_model.bin", torch_ckpt_bytes(ts, false)); // a bare state dict
    auto src = resolve_model(dir);
    CHECK(src.weight_files == std::vector<std::string>{dir + "/diffusion_pytorch_model.bin"});
    auto a = unet::load_vae_folder(golden);
    auto b = unet::load_vae_folder(dir);
    auto pa = a->named_parameters(true), pb = b->named_parameters(true);
    REQUIRE(pa.size() == pb.size());
    for (const auto& p : pa) {
        INFO(p.key());
        CHECK(torch::equal(p.value(), pb[p.key()]));
    }
}

TEST_CASE("a .ckpt of the tiny SD model loads bit-identical to its safetensors file, and the same models",
          "[pickle][sd]") {
    const std::string st_path = test::golden("sd/sd15_tiny_single_file/sd15_tiny_single_file.safetensors");
    auto st = SafeTensorsFile::open(st_path);
    NamedTensors ts;
    for (const auto& ti : st->tensors()) ts.emplace_back(ti.name, st->tensor(ti.name));
    const std::string dir = test::scratch_dir("pickle_sd");
    const std::string ckpt = dir + "/sd15_tiny.ckpt";
    write_bytes(ckpt, torch_ckpt_bytes(ts)); // Lightning layout: state_dict + epoch + callbacks
    auto a = WeightMap::load(st_path);
    auto b = WeightMap::load(ckpt);
    REQUIRE(a.names() == b.names());
    for (const auto& n : a.names()) {
        INFO(n);
        REQUIRE(a.get(n).scalar_type() == b.get(n).scalar_type());
        REQUIRE(torch::equal(a.get(n), b.get(n)));
    }
    auto src = resolve_model(ckpt);
    CHECK(src.layout == ModelLayout::WeightsFile);
    CHECK(src.arch == ModelArch::StableDiffusion);
    auto ma = unet::load_sd_models(st_path);
    auto mb = unet::load_sd_models(ckpt);
    CHECK(mb.layout == "single-file");
    CHECK(mb.family == ma.family);
    auto same = [](torch::nn::Module& x, torch::nn::Module& y) {
        auto px = x.named_parameters(true), py = y.named_parameters(true);
        REQUIRE(px.size() == py.size());
        for (const auto& p : px) {
            INFO(p.key());
            REQUIRE(py.contains(p.key()));
            CHECK(torch::equal(p.value(), py[p.key()]));
        }
    };
    same(*ma.unet, *mb.unet);
    same(*ma.vae, *mb.vae);
    same(*ma.text_encoder, *mb.text_encoder);
    torch::NoGradGuard ng;
    auto in = WeightMap::load(test::golden("sd/unet_sd15_tiny/golden_inputs.safetensors"));
    CHECK(torch::equal(ma.unet->forward(in.get("sample"), in.get("timesteps_a"), in.get("encoder_hidden_states")),
                       mb.unet->forward(in.get("sample"), in.get("timesteps_a"), in.get("encoder_hidden_states"))));
    auto vin = WeightMap::load(test::golden("sd/vae_tiny/golden_inputs.safetensors"));
    CHECK(torch::equal(ma.vae->decode(vin.get("latent")), mb.vae->decode(vin.get("latent"))));
}

TEST_CASE("anchor-sd -m model.ckpt gives the same latents as the safetensors file", "[pickle][cli][sd]") {
    const std::string st_path = test::golden("sd/sd15_tiny_single_file/sd15_tiny_single_file.safetensors");
    auto st = SafeTensorsFile::open(st_path);
    NamedTensors ts;
    for (const auto& ti : st->tensors()) ts.emplace_back(ti.name, st->tensor(ti.name));
    const std::string dir = test::scratch_dir("pickle_cli");
    write_bytes(dir + "/tiny.ckpt", torch_ckpt_bytes(ts));
    std::map<std::string, torch::Tensor> latents;
    for (const std::string model : {st_path, dir + "/tiny.ckpt"}) {
        const std::string tag = model == st_path ? "st" : "ckpt";
        auto r = test::run_program(test::sd_bin(), {"-m",
                                                    model,
                                                    "-p",
                                                    "a red fox",
                                                    "--steps",
                                                    "3",
                                                    "-s",
                                                    "11",
                                                    "-W",
                                                    "16",
                                                    "-H",
                                                    "16",
                                                    "--sampler",
                                                    "ddim",
                                                    "-o",
                                                    dir + "/" + tag + ".png",
                                                    "--save-latents",
                                                    dir + "/" + tag + ".safetensors",
                                                    "--threads",
                                                    "1"});
        INFO(r.output);
        REQUIRE(r.exit_code == 0);
        latents[tag] = SafeTensorsFile::open(dir + "/" + tag + ".safetensors")->tensor("final_latents").clone();
    }
    CHECK(torch::equal(latents["st"], latents["ckpt"]));
    // The same image: the PNGs without their text chunks, which differ by the model file's hash and the timings.
    const auto image_chunks = [](const std::string& png) {
        std::string out = png.substr(0, 8);
        for (size_t at = 8; at + 12 <= png.size();) {
            const size_t len = size_t(uint8_t(png[at])) << 24 | size_t(uint8_t(png[at + 1])) << 16 |
                               size_t(uint8_t(png[at + 2])) << 8 | size_t(uint8_t(png[at + 3]));
            const std::string type = png.substr(at + 4, 4);
            if (type != "tEXt" && type != "iTXt" && type != "zTXt") out += png.substr(at, 12 + len);
            at += 12 + len;
        }
        return out;
    };
    CHECK(image_chunks(read_bytes(dir + "/st.png")) == image_chunks(read_bytes(dir + "/ckpt.png")));
}

TEST_CASE("weight storage dtype (--weights-dtype) f16 with a .ckpt: the same half-precision weights and outputs as "
          "from safetensors",
          "[pickle][sd][sd_load]") {
    const std::string st_path = test::golden("sd/sd15_tiny_single_file/sd15_tiny_single_file.safetensors");
    auto st = SafeTensorsFile::open(st_path);
    NamedTensors ts;
    for (const auto& ti : st->tensors()) ts.emplace_back(ti.name, st->tensor(ti.name));
    const std::string dir = test::scratch_dir("pickle_sd_f16");
    const std::string ckpt = dir + "/sd15_tiny.ckpt";
    write_bytes(ckpt, torch_ckpt_bytes(ts));
    unet::LoadOptions o;
    o.weights_dtype = torch::kHalf;
    auto ma = unet::load_sd_models(st_path, o);
    auto mb = unet::load_sd_models(ckpt, o);
    auto f32 = unet::load_sd_models(ckpt);
    CHECK(mb.unet->conv_in->weight.scalar_type() == torch::kHalf);
    CHECK(mb.unet->conv_in->bias.scalar_type() == torch::kFloat);
    CHECK(unet::parameter_bytes(*mb.unet) < unet::parameter_bytes(*f32.unet));
    for (const auto& p : ma.unet->named_parameters(true)) {
        INFO(p.key());
        CHECK(torch::equal(p.value(), mb.unet->named_parameters(true)[p.key()]));
    }
    torch::NoGradGuard ng;
    auto in = WeightMap::load(test::golden("sd/unet_sd15_tiny/golden_inputs.safetensors"));
    const auto out = mb.unet->forward(in.get("sample"), in.get("timesteps_a"), in.get("encoder_hidden_states"));
    CHECK(out.scalar_type() == torch::kFloat); // the compute stays float32
    CHECK(
        torch::equal(ma.unet->forward(in.get("sample"), in.get("timesteps_a"), in.get("encoder_hidden_states")), out));
    auto vin = WeightMap::load(test::golden("sd/vae_tiny/golden_inputs.safetensors"));
    CHECK(torch::equal(ma.vae->decode(vin.get("latent")), mb.vae->decode(vin.get("latent"))));
}
