#include "cache/io/pickle.h"

#include "cache/io/error.h"

#include <cstdio>
#include <cstring>
#include <map>
#include <unordered_map>

namespace anchor {

size_t storage_dtype_size(StorageDType t) {
    switch (t) {
    case StorageDType::Double:
    case StorageDType::Long:
        return 8;
    case StorageDType::Float:
    case StorageDType::Int:
        return 4;
    case StorageDType::Half:
    case StorageDType::BFloat16:
    case StorageDType::Short:
        return 2;
    case StorageDType::Char:
    case StorageDType::Byte:
    case StorageDType::Bool:
        return 1;
    }
    return 1;
}

const char* storage_dtype_name(StorageDType t) {
    switch (t) {
    case StorageDType::Float:
        return "float32";
    case StorageDType::Half:
        return "float16";
    case StorageDType::BFloat16:
        return "bfloat16";
    case StorageDType::Double:
        return "float64";
    case StorageDType::Long:
        return "int64";
    case StorageDType::Int:
        return "int32";
    case StorageDType::Short:
        return "int16";
    case StorageDType::Char:
        return "int8";
    case StorageDType::Byte:
        return "uint8";
    case StorageDType::Bool:
        return "bool";
    }
    return "?";
}

const PickleValue* PickleValue::get(const std::string& k) const {
    if (kind != Kind::Dict) return nullptr;
    for (auto it = entries.rbegin(); it != entries.rend(); ++it)
        if (it->first->kind == Kind::String && it->first->text == k) return it->second;
    return nullptr;
}

std::string PickleValue::describe() const {
    auto quoted = [](const std::string& s) { return "'" + (s.size() > 60 ? s.substr(0, 60) + "..." : s) + "'"; };
    switch (kind) {
    case Kind::None:
        return "None";
    case Kind::Bool:
        return boolean ? "True" : "False";
    case Kind::Int:
        return "the int " + std::to_string(integer);
    case Kind::Float:
        return "a float";
    case Kind::String:
        return "the str " + quoted(text);
    case Kind::Bytes:
        return "a bytes of " + std::to_string(text.size());
    case Kind::Tuple:
        return "a tuple of " + std::to_string(items.size());
    case Kind::List:
        return "a list of " + std::to_string(items.size());
    case Kind::Set:
        return "a set of " + std::to_string(items.size());
    case Kind::Dict:
        return "a dict of " + std::to_string(entries.size());
    case Kind::Global:
        return "the global " + quoted(text);
    case Kind::Opaque:
        return "a placeholder of " + quoted(text) + " (an unknown global, never called)";
    case Kind::Storage:
        return "the storage " + quoted(key);
    case Kind::Tensor:
        return "a tensor";
    case Kind::DType:
        return std::string("the dtype ") + storage_dtype_name(dtype);
    }
    return "?";
}

namespace {

using Kind = PickleValue::Kind;

// The globals this reader evaluates itself (Global values carry one in `integer`).
enum class Builtin {
    OrderedDict,
    List,
    Set,
    Tuple,
    Size,
    RebuildTensor,
    RebuildTensorV2,
    RebuildTensorV3,
    RebuildParameter,
    RebuildFromTypeV2,
    StorageType,
    DType,
    TensorType
};

struct Named {
    const char* name;
    StorageDType t;
};
const Named kStorageTypes[] = {{"FloatStorage", StorageDType::Float},       {"HalfStorage", StorageDType::Half},
                               {"BFloat16Storage", StorageDType::BFloat16}, {"DoubleStorage", StorageDType::Double},
                               {"LongStorage", StorageDType::Long},         {"IntStorage", StorageDType::Int},
                               {"ShortStorage", StorageDType::Short},       {"CharStorage", StorageDType::Char},
                               {"ByteStorage", StorageDType::Byte},         {"BoolStorage", StorageDType::Bool}};
const Named kDTypes[] = {
    {"float32", StorageDType::Float}, {"float", StorageDType::Float},       {"float16", StorageDType::Half},
    {"half", StorageDType::Half},     {"bfloat16", StorageDType::BFloat16}, {"float64", StorageDType::Double},
    {"double", StorageDType::Double}, {"int64", StorageDType::Long},        {"long", StorageDType::Long},
    {"int32", StorageDType::Int},     {"int", StorageDType::Int},           {"int16", StorageDType::Short},
    {"short", StorageDType::Short},   {"int8", StorageDType::Char},         {"uint8", StorageDType::Byte},
    {"bool", StorageDType::Bool}};

bool in_module(const std::string& module, const char* m) {
    const size_t n = std::strlen(m);
    return module.compare(0, n, m) == 0 && (module.size() == n || module[n] == '.');
}

// Code that runs programs, evaluates or imports: refused wherever it appears (pickle.h, "Globals").
bool denied(const std::string& module, const std::string& name) {
    static const char* const kModules[] = {
        "os",        "posix",   "nt",        "subprocess", "_posixsubprocess", "sys",
        "runpy",     "pty",     "importlib", "ctypes",     "pickle",           "_pickle",
        "cPickle",   "marshal", "shutil",    "socket",     "webbrowser",       "multiprocessing",
        "code",      "codeop",  "commands",  "popen2",     "timeit",           "pdb",
        "bdb",       "profile", "cProfile",  "trace",      "signal",           "_thread",
        "threading", "asyncio"};
    for (const char* m : kModules)
        if (in_module(module, m)) return true;
    if (module == "builtins" || module == "__builtin__") {
        static const char* const kNames[] = {"eval",    "exec",    "execfile",   "compile",    "getattr",
                                             "setattr", "delattr", "__import__", "open",       "globals",
                                             "locals",  "vars",    "input",      "breakpoint", "apply",
                                             "exit",    "quit",    "help",       "memoryview"};
        for (const char* n : kNames)
            if (name == n) return true;
    }
    if (module == "operator" && (name == "attrgetter" || name == "methodcaller")) return true;
    return false;
}

// Known globals: sets `b` (and `t` for storage types and dtypes).
bool known_global(const std::string& module, const std::string& name, Builtin* b, StorageDType* t, bool* untyped) {
    *untyped = false;
    if (module == "collections" && name == "OrderedDict") return *b = Builtin::OrderedDict, true;
    if (module == "builtins" || module == "__builtin__") {
        if (name == "dict") return *b = Builtin::OrderedDict, true;
        if (name == "list") return *b = Builtin::List, true;
        if (name == "set" || name == "frozenset") return *b = Builtin::Set, true;
        if (name == "tuple") return *b = Builtin::Tuple, true;
        return false;
    }
    if (module == "torch._utils") {
        if (name == "_rebuild_tensor") return *b = Builtin::RebuildTensor, true;
        if (name == "_rebuild_tensor_v2") return *b = Builtin::RebuildTensorV2, true;
        if (name == "_rebuild_tensor_v3") return *b = Builtin::RebuildTensorV3, true;
        if (name == "_rebuild_parameter" || name == "_rebuild_parameter_with_state")
            return *b = Builtin::RebuildParameter, true;
        return false;
    }
    if (module == "torch._tensor" && name == "_rebuild_from_type_v2") return *b = Builtin::RebuildFromTypeV2, true;
    if ((module == "torch" && name == "Tensor") || (module == "torch.nn.parameter" && name == "Parameter"))
        return *b = Builtin::TensorType, true;
    if (module == "torch") {
        if (name == "Size") return *b = Builtin::Size, true;
        if (name == "UntypedStorage") {
            *untyped = true;
            *t = StorageDType::Byte;
            return *b = Builtin::StorageType, true;
        }
        for (const auto& s : kStorageTypes)
            if (name == s.name) return *t = s.t, *b = Builtin::StorageType, true;
        for (const auto& s : kDTypes)
            if (name == s.name) return *t = s.t, *b = Builtin::DType, true;
    }
    return false;
}

const char* opcode_name(uint8_t op) {
    switch (op) {
    case 0x80:
        return "PROTO";
    case 0x95:
        return "FRAME";
    case '}':
        return "EMPTY_DICT";
    case ']':
        return "EMPTY_LIST";
    case ')':
        return "EMPTY_TUPLE";
    case 0x8f:
        return "EMPTY_SET";
    case '(':
        return "MARK";
    case 'X':
        return "BINUNICODE";
    case 0x8c:
        return "SHORT_BINUNICODE";
    case 0x8d:
        return "BINUNICODE8";
    case 'T':
        return "BINSTRING";
    case 'U':
        return "SHORT_BINSTRING";
    case 'B':
        return "BINBYTES";
    case 'C':
        return "SHORT_BINBYTES";
    case 0x8e:
        return "BINBYTES8";
    case 0x96:
        return "BYTEARRAY8";
    case 'q':
        return "BINPUT";
    case 'r':
        return "LONG_BINPUT";
    case 0x94:
        return "MEMOIZE";
    case 'h':
        return "BINGET";
    case 'j':
        return "LONG_BINGET";
    case 'J':
        return "BININT";
    case 'K':
        return "BININT1";
    case 'M':
        return "BININT2";
    case 0x8a:
        return "LONG1";
    case 0x8b:
        return "LONG4";
    case 0x88:
        return "NEWTRUE";
    case 0x89:
        return "NEWFALSE";
    case 'N':
        return "NONE";
    case 't':
        return "TUPLE";
    case 0x85:
        return "TUPLE1";
    case 0x86:
        return "TUPLE2";
    case 0x87:
        return "TUPLE3";
    case 'l':
        return "LIST";
    case 'd':
        return "DICT";
    case 0x91:
        return "FROZENSET";
    case 's':
        return "SETITEM";
    case 'u':
        return "SETITEMS";
    case 'a':
        return "APPEND";
    case 'e':
        return "APPENDS";
    case 0x90:
        return "ADDITEMS";
    case 'c':
        return "GLOBAL";
    case 0x93:
        return "STACK_GLOBAL";
    case 'R':
        return "REDUCE";
    case 0x81:
        return "NEWOBJ";
    case 0x92:
        return "NEWOBJ_EX";
    case 'b':
        return "BUILD";
    case 'Q':
        return "BINPERSID";
    case 'P':
        return "PERSID";
    case 'G':
        return "BINFLOAT";
    case '.':
        return "STOP";
    case '0':
        return "POP";
    case '1':
        return "POP_MARK";
    case '2':
        return "DUP";
    case 'i':
        return "INST";
    case 'o':
        return "OBJ";
    case 0x82:
        return "EXT1";
    case 0x83:
        return "EXT2";
    case 0x84:
        return "EXT4";
    case 0x97:
        return "NEXT_BUFFER";
    case 0x98:
        return "READONLY_BUFFER";
    default:
        return nullptr;
    }
}

} // namespace

class Unpickler {
public:
    Unpickler(const char* data, size_t size, const std::string& label, const PickleLimits& limits, PickleDocument& doc)
        : p_(reinterpret_cast<const unsigned char*>(data)), n_(size), label_(label), lim_(limits), doc_(doc) {}

    void run() {
        while (true) {
            if (pos_ >= n_) {
                op_pos_ = pos_;
                op_ = 0;
                fail("the pickle ends without STOP (truncated)");
            }
            op_pos_ = pos_;
            op_ = p_[pos_++];
            if (step()) return;
        }
    }

private:
    [[noreturn]] void fail(const std::string& what) const {
        const char* name = op_ ? opcode_name(op_) : nullptr;
        char hex[8];
        std::snprintf(hex, sizeof(hex), "0x%02x", op_);
        throw Error("pickle '" + label_ + "', offset " + std::to_string(op_pos_) +
                    (op_ ? std::string(", opcode ") + (name ? name : hex) : std::string()) + ": " + what);
    }

    PickleValue* make(Kind k) {
        if (doc_.values_.size() >= lim_.max_values)
            fail("more than " + std::to_string(lim_.max_values) + " values (limit)");
        doc_.values_.emplace_back();
        doc_.values_.back().kind = k;
        return &doc_.values_.back();
    }
    const unsigned char* take(uint64_t n) {
        if (n > n_ - pos_)
            fail("needs " + std::to_string(n) + " bytes, only " + std::to_string(n_ - pos_) + " left (truncated)");
        const unsigned char* r = p_ + pos_;
        pos_ += static_cast<size_t>(n);
        return r;
    }
    uint64_t le(int bytes) {
        const unsigned char* b = take(bytes);
        uint64_t v = 0;
        for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | b[i];
        return v;
    }
    std::string line() { // GLOBAL's "module\n" and "name\n"
        const size_t start = pos_;
        while (pos_ < n_ && p_[pos_] != '\n') {
            if (pos_ - start > 1024) fail("a name longer than 1024 bytes");
            ++pos_;
        }
        if (pos_ >= n_) fail("a name runs past the end (truncated)");
        std::string s(reinterpret_cast<const char*>(p_ + start), pos_ - start);
        ++pos_;
        return s;
    }
    void count(uint64_t n) {
        elements_ += n;
        if (elements_ > lim_.max_elements)
            fail("more than " + std::to_string(lim_.max_elements) + " container elements (limit)");
    }

    void push(PickleValue* v) {
        if (stack_.size() + marks_.size() >= lim_.max_stack)
            fail("stack deeper than " + std::to_string(lim_.max_stack) + " (limit)");
        stack_.push_back(v);
    }
    size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
    PickleValue* pop() {
        if (stack_.size() <= floor()) fail("stack underflow");
        PickleValue* v = stack_.back();
        stack_.pop_back();
        return v;
    }
    PickleValue* top() {
        if (stack_.size() <= floor()) fail("stack underflow");
        return stack_.back();
    }
    std::vector<PickleValue*> pop_mark() {
        if (marks_.empty()) fail("no MARK on the stack");
        const size_t m = marks_.back();
        marks_.pop_back();
        std::vector<PickleValue*> items(stack_.begin() + static_cast<std::ptrdiff_t>(m), stack_.end());
        stack_.resize(m);
        return items;
    }

    PickleValue* text_value(Kind k, uint64_t n) {
        if (n > lim_.max_string)
            fail("a string of " + std::to_string(n) + " bytes, more than the " + std::to_string(lim_.max_string) +
                 " allowed");
        const unsigned char* b = take(n);
        PickleValue* v = make(k);
        v->text.assign(reinterpret_cast<const char*>(b), static_cast<size_t>(n));
        return v;
    }
    PickleValue* int_value(int64_t i) {
        PickleValue* v = make(Kind::Int);
        v->integer = i;
        return v;
    }
    PickleValue* long_value(uint64_t n) { // LONG1 / LONG4: little-endian two's complement
        if (n > lim_.max_string) fail("an integer of " + std::to_string(n) + " bytes (limit)");
        const unsigned char* b = take(n);
        if (n == 0) return int_value(0);
        const bool negative = b[n - 1] & 0x80;
        for (uint64_t i = 8; i < n; ++i)
            if (b[i] != (negative ? 0xff : 0x00)) {
                PickleValue* v = make(Kind::Opaque); // an int past int64: metadata only
                v->text = "int of " + std::to_string(n) + " bytes";
                return v;
            }
        uint64_t u = negative ? ~uint64_t(0) : 0;
        for (uint64_t i = 0; i < n && i < 8; ++i) {
            u &= ~(uint64_t(0xff) << (8 * i));
            u |= uint64_t(b[i]) << (8 * i);
        }
        if (n >= 8 && ((u >> 63) != 0) != negative) {
            PickleValue* v = make(Kind::Opaque);
            v->text = "int of " + std::to_string(n) + " bytes";
            return v;
        }
        int64_t s;
        std::memcpy(&s, &u, sizeof(s));
        return int_value(s);
    }
    PickleValue* sequence(Kind k, const std::vector<PickleValue*>& items) {
        count(items.size());
        PickleValue* v = make(k);
        v->items.assign(items.begin(), items.end());
        return v;
    }
    PickleValue* global(const std::string& module, const std::string& name) {
        if (denied(module, name))
            fail("refusing the global '" + module + "." + name +
                 "': it can run code, and a checkpoint has no use for it (the file is hostile or not a state dict)");
        Builtin b{};
        StorageDType t{};
        bool untyped = false;
        PickleValue* v;
        if (known_global(module, name, &b, &t, &untyped) && b == Builtin::DType) {
            v = make(Kind::DType); // torch.float16 ... (an argument of _rebuild_tensor_v3)
            v->dtype = t;
        } else if (known_global(module, name, &b, &t, &untyped)) {
            v = make(Kind::Global);
            v->integer = static_cast<int64_t>(b);
            v->dtype = t;
            v->untyped = untyped;
        } else {
            v = make(Kind::Opaque);
        }
        v->text = module + "." + name;
        return v;
    }
    void memo_put(uint64_t index, PickleValue* v) {
        if (index >= lim_.max_memo)
            fail("memo index " + std::to_string(index) + " beyond the limit of " + std::to_string(lim_.max_memo));
        memo_[index] = v;
        if (memo_.size() > lim_.max_memo) fail("more than " + std::to_string(lim_.max_memo) + " memo entries");
    }
    PickleValue* memo_get(uint64_t index) {
        auto it = memo_.find(index);
        if (it == memo_.end()) fail("memo index " + std::to_string(index) + " was never set");
        return it->second;
    }

    // ('storage', <storage type>, key, location, numel): the archive's data/<key> record.
    PickleValue* persistent(const PickleValue* pid) {
        if (pid->kind != Kind::Tuple || pid->items.size() != 5 || pid->items[0]->kind != Kind::String ||
            pid->items[0]->text != "storage")
            fail("unsupported persistent id (" + pid->describe() + "; torch.save writes ('storage', type, key, " +
                 "location, numel))");
        const PickleValue* type = pid->items[1];
        if (type->kind != Kind::Global || type->integer != static_cast<int64_t>(Builtin::StorageType))
            fail("persistent id: the storage type is " + type->describe());
        const PickleValue* key = pid->items[2];
        const PickleValue* loc = pid->items[3];
        const PickleValue* numel = pid->items[4];
        if (key->kind != Kind::String || key->text.empty() || key->text.size() > 256)
            fail("persistent id: the storage key is " + key->describe());
        if (loc->kind != Kind::String) fail("persistent id: the storage location is " + loc->describe());
        if (numel->kind != Kind::Int || numel->integer < 0)
            fail("persistent id: the storage size is " + numel->describe());
        auto it = storages_.find(key->text);
        if (it != storages_.end()) {
            const PickleValue* s = it->second;
            if (s->dtype != type->dtype || s->untyped != type->untyped ||
                s->numel != static_cast<uint64_t>(numel->integer))
                fail("storage '" + key->text + "' is referenced with different types or sizes");
            return it->second;
        }
        PickleValue* s = make(Kind::Storage);
        s->dtype = type->dtype;
        s->untyped = type->untyped;
        s->key = key->text;
        s->location = loc->text;
        s->numel = static_cast<uint64_t>(numel->integer);
        storages_[key->text] = s;
        return s;
    }

    std::vector<int64_t> ints(const PickleValue* v, const char* what) {
        if (v->kind != Kind::Tuple && v->kind != Kind::List)
            fail(std::string("tensor ") + what + " is " + v->describe() + ", not a tuple of ints");
        if (v->items.size() > static_cast<size_t>(lim_.max_dims))
            fail(std::string("tensor ") + what + " has " + std::to_string(v->items.size()) + " dimensions (limit " +
                 std::to_string(lim_.max_dims) + ")");
        std::vector<int64_t> out;
        for (const PickleValue* i : v->items) {
            if (i->kind != Kind::Int || i->integer < 0)
                fail(std::string("tensor ") + what + " holds " + i->describe() + ", not a non-negative int");
            out.push_back(i->integer);
        }
        return out;
    }

    // A strided view (torch._utils._rebuild_tensor*): checked to lie inside its storage.
    PickleValue* tensor(const std::vector<const PickleValue*>& a, const PickleValue* dtype) {
        const PickleValue* s = a[0];
        if (s->kind != Kind::Storage) fail("the storage of a tensor is " + s->describe());
        if (a[1]->kind != Kind::Int || a[1]->integer < 0) fail("the storage offset of a tensor is " + a[1]->describe());
        PickleValue* t = make(Kind::Tensor);
        t->storage = s;
        t->offset = a[1]->integer;
        t->shape = ints(a[2], "size");
        t->stride = ints(a[3], "stride");
        if (t->shape.size() != t->stride.size())
            fail("tensor size " + shape_str(t->shape) + " and stride " + shape_str(t->stride) + " differ in length");
        if (dtype) {
            if (dtype->kind != Kind::DType) fail("the dtype of a tensor is " + dtype->describe());
            t->dtype = dtype->dtype;
        } else {
            if (s->untyped) fail("a tensor of an untyped storage without a dtype");
            t->dtype = s->dtype;
        }
        const uint64_t es = storage_dtype_size(t->dtype);
        const uint64_t bytes = s->untyped ? s->numel : s->numel * storage_dtype_size(s->dtype);
        if (s->numel > (uint64_t(1) << 62) / 8) fail("storage '" + s->key + "' claims an impossible size");
        if (bytes % es != 0)
            fail("storage '" + s->key + "' of " + std::to_string(bytes) + " bytes is not a whole number of " +
                 storage_dtype_name(t->dtype) + " elements");
        const uint64_t elems = bytes / es;
        // The last element's index: offset + sum (size_i - 1) * stride_i, overflow-checked.
        unsigned __int128 last = static_cast<uint64_t>(t->offset), numel = 1;
        bool empty = false;
        for (size_t i = 0; i < t->shape.size(); ++i) {
            if (t->shape[i] == 0) empty = true;
            numel *= static_cast<uint64_t>(t->shape[i]);
            if (numel > (static_cast<unsigned __int128>(1) << 62))
                fail("tensor size " + shape_str(t->shape) + " is impossibly large");
            if (t->shape[i] > 0) last += static_cast<unsigned __int128>(t->shape[i] - 1) * uint64_t(t->stride[i]);
        }
        if (!empty && last >= elems)
            fail("tensor (offset " + std::to_string(t->offset) + ", size " + shape_str(t->shape) + ", stride " +
                 shape_str(t->stride) + ") reaches past the end of storage '" + s->key + "' (" + std::to_string(elems) +
                 " elements)");
        return t;
    }

    // REDUCE / NEWOBJ: our own implementation of a known global, a placeholder for an unknown one.
    PickleValue* call(PickleValue* fn, PickleValue* args) {
        if (fn->kind == Kind::Opaque) {
            PickleValue* v = make(Kind::Opaque);
            v->text = fn->text;
            return v;
        }
        if (fn->kind != Kind::Global) fail("cannot call " + fn->describe());
        if (args->kind != Kind::Tuple) fail("the arguments of '" + fn->text + "' are " + args->describe());
        const auto& a = args->items;
        auto want = [&](size_t lo, size_t hi) {
            if (a.size() < lo || a.size() > hi)
                fail("'" + fn->text + "' takes " + std::to_string(lo) + (lo == hi ? "" : ".." + std::to_string(hi)) +
                     " arguments, got " + std::to_string(a.size()));
        };
        switch (static_cast<Builtin>(fn->integer)) {
        case Builtin::OrderedDict: {
            want(0, 1);
            PickleValue* d = make(Kind::Dict);
            if (a.empty()) return d;
            if (a[0]->kind == Kind::Dict) {
                count(a[0]->entries.size());
                d->entries = a[0]->entries;
                return d;
            }
            if (a[0]->kind != Kind::List && a[0]->kind != Kind::Tuple)
                fail("'" + fn->text + "' of " + a[0]->describe());
            count(a[0]->items.size());
            for (const PickleValue* kv : a[0]->items) {
                if ((kv->kind != Kind::Tuple && kv->kind != Kind::List) || kv->items.size() != 2)
                    fail("'" + fn->text + "' of an item that is " + kv->describe() + ", not a pair");
                d->entries.emplace_back(kv->items[0], kv->items[1]);
            }
            return d;
        }
        case Builtin::List:
        case Builtin::Set:
        case Builtin::Tuple:
        case Builtin::Size: {
            const Builtin b = static_cast<Builtin>(fn->integer);
            const Kind k = b == Builtin::List ? Kind::List : b == Builtin::Set ? Kind::Set : Kind::Tuple;
            want(0, 1);
            PickleValue* v = make(k);
            if (a.empty()) return v;
            if (a[0]->kind != Kind::List && a[0]->kind != Kind::Tuple && a[0]->kind != Kind::Set)
                fail("'" + fn->text + "' of " + a[0]->describe());
            count(a[0]->items.size());
            v->items = a[0]->items;
            return v;
        }
        case Builtin::RebuildTensor: // (storage, storage_offset, size, stride)
            want(4, 4);
            return tensor(a, nullptr);
        case Builtin::RebuildTensorV2: // (storage, storage_offset, size, stride, requires_grad, backward_hooks[,
                                       // metadata])
            want(4, 7);
            return tensor(a, nullptr);
        case Builtin::RebuildTensorV3: // (... backward_hooks, dtype[, metadata])
            want(7, 8);
            return tensor(a, a[6]);
        case Builtin::RebuildParameter: // (data, requires_grad, backward_hooks[, state])
            want(1, 4);
            if (a[0]->kind != Kind::Tensor) fail("the data of a parameter is " + a[0]->describe());
            return const_cast<PickleValue*>(a[0]);
        case Builtin::RebuildFromTypeV2: { // (func, new_type, args, state): func(*args), its type aside
            want(4, 4);
            if (a[0]->kind != Kind::Global)
                fail("_rebuild_from_type_v2 of " + a[0]->describe() + ", which cannot build a tensor");
            if (depth_ > 4) fail("_rebuild_from_type_v2 nested too deeply");
            ++depth_;
            PickleValue* r = call(const_cast<PickleValue*>(a[0]), const_cast<PickleValue*>(a[2]));
            --depth_;
            return r;
        }
        case Builtin::StorageType:
        case Builtin::DType:
        case Builtin::TensorType: {
            // Constructing these from data is not part of a state dict; keep it as inert metadata.
            PickleValue* v = make(Kind::Opaque);
            v->text = fn->text;
            return v;
        }
        }
        fail("internal: unknown builtin");
    }

    void add_items(PickleValue* target, const std::vector<PickleValue*>& items, bool pairs) {
        if (pairs && items.size() % 2 != 0) fail("an odd number of items for SETITEMS");
        if (target->kind == Kind::Opaque) return; // metadata of an unknown object: dropped
        count(pairs ? items.size() / 2 : items.size());
        if (pairs) {
            if (target->kind != Kind::Dict) fail("setting items on " + target->describe());
            for (size_t i = 0; i < items.size(); i += 2) target->entries.emplace_back(items[i], items[i + 1]);
        } else {
            if (target->kind != Kind::List && target->kind != Kind::Set) fail("appending to " + target->describe());
            target->items.insert(target->items.end(), items.begin(), items.end());
        }
    }

    bool step() {
        switch (op_) {
        case 0x80: { // PROTO
            const uint64_t v = le(1);
            if (v > 5) fail("pickle protocol " + std::to_string(v) + " (this reader knows 0..5)");
            return false;
        }
        case 0x95:
            le(8);
            return false; // FRAME: a length hint only
        case '}':
            push(make(Kind::Dict));
            return false;
        case ']':
            push(make(Kind::List));
            return false;
        case ')':
            push(make(Kind::Tuple));
            return false;
        case 0x8f:
            push(make(Kind::Set));
            return false;
        case '(':
            if (stack_.size() + marks_.size() >= lim_.max_stack)
                fail("stack deeper than " + std::to_string(lim_.max_stack) + " (limit)");
            marks_.push_back(stack_.size());
            return false;
        case 'X':
            push(text_value(Kind::String, le(4)));
            return false;
        case 0x8c:
            push(text_value(Kind::String, le(1)));
            return false;
        case 0x8d:
            push(text_value(Kind::String, le(8)));
            return false;
        case 'T': {
            const uint64_t n = le(4);
            if (n & 0x80000000u) fail("a negative string length");
            push(text_value(Kind::String, n)); // a Python 2 str: its bytes as text
            return false;
        }
        case 'U':
            push(text_value(Kind::String, le(1)));
            return false;
        case 'B':
            push(text_value(Kind::Bytes, le(4)));
            return false;
        case 'C':
            push(text_value(Kind::Bytes, le(1)));
            return false;
        case 0x8e:
        case 0x96:
            push(text_value(Kind::Bytes, le(8)));
            return false;
        case 'q':
            memo_put(le(1), top());
            return false;
        case 'r':
            memo_put(le(4), top());
            return false;
        case 0x94:
            memo_put(memo_.size(), top());
            return false;
        case 'h':
            push(memo_get(le(1)));
            return false;
        case 'j':
            push(memo_get(le(4)));
            return false;
        case 'J': {
            const uint32_t u = static_cast<uint32_t>(le(4));
            int32_t s;
            std::memcpy(&s, &u, sizeof(s));
            push(int_value(s));
            return false;
        }
        case 'K':
            push(int_value(static_cast<int64_t>(le(1))));
            return false;
        case 'M':
            push(int_value(static_cast<int64_t>(le(2))));
            return false;
        case 0x8a:
            push(long_value(le(1)));
            return false;
        case 0x8b: {
            const uint64_t n = le(4);
            if (n & 0x80000000u) fail("a negative integer length");
            push(long_value(n));
            return false;
        }
        case 0x88:
        case 0x89: {
            PickleValue* v = make(Kind::Bool);
            v->boolean = op_ == 0x88;
            push(v);
            return false;
        }
        case 'N':
            push(make(Kind::None));
            return false;
        case 'G': {
            const unsigned char* b = take(8); // big-endian IEEE 754 double
            uint64_t u = 0;
            for (int i = 0; i < 8; ++i) u = (u << 8) | b[i];
            PickleValue* v = make(Kind::Float);
            std::memcpy(&v->real, &u, sizeof(double));
            push(v);
            return false;
        }
        case 't':
            push(sequence(Kind::Tuple, pop_mark()));
            return false;
        case 0x85:
        case 0x86:
        case 0x87: {
            const size_t n = static_cast<size_t>(op_ - 0x84);
            std::vector<PickleValue*> items(n);
            for (size_t i = n; i-- > 0;) items[i] = pop();
            push(sequence(Kind::Tuple, items));
            return false;
        }
        case 'l':
            push(sequence(Kind::List, pop_mark()));
            return false;
        case 0x91:
            push(sequence(Kind::Set, pop_mark()));
            return false;
        case 'd': {
            auto items = pop_mark();
            PickleValue* d = make(Kind::Dict);
            add_items(d, items, true);
            push(d);
            return false;
        }
        case 's': {
            PickleValue* v = pop();
            PickleValue* k = pop();
            add_items(top(), {k, v}, true);
            return false;
        }
        case 'u': {
            auto items = pop_mark();
            add_items(top(), items, true);
            return false;
        }
        case 'a': {
            PickleValue* v = pop();
            add_items(top(), {v}, false);
            return false;
        }
        case 'e':
        case 0x90: {
            auto items = pop_mark();
            add_items(top(), items, false);
            return false;
        }
        case 'c': {
            const std::string module = line();
            const std::string name = line();
            push(global(module, name));
            return false;
        }
        case 0x93: {
            PickleValue* name = pop();
            PickleValue* module = pop();
            if (module->kind != Kind::String || name->kind != Kind::String)
                fail("STACK_GLOBAL of " + module->describe() + " and " + name->describe());
            push(global(module->text, name->text));
            return false;
        }
        case 'R':
        case 0x81: {
            PickleValue* args = pop();
            PickleValue* fn = pop();
            push(call(fn, args));
            return false;
        }
        case 0x92: {
            PickleValue* kwargs = pop();
            PickleValue* args = pop();
            PickleValue* fn = pop();
            if (fn->kind == Kind::Global && !(kwargs->kind == Kind::Dict && kwargs->entries.empty()))
                fail("keyword arguments for '" + fn->text + "'");
            push(call(fn, args));
            return false;
        }
        case 'b': {
            PickleValue* state = pop();
            (void)state;
            PickleValue* obj = top();
            // The state of an OrderedDict (its _metadata attribute), a tensor or a placeholder is metadata.
            if (obj->kind != Kind::Dict && obj->kind != Kind::List && obj->kind != Kind::Set &&
                obj->kind != Kind::Tensor && obj->kind != Kind::Opaque)
                fail("BUILD on " + obj->describe());
            return false;
        }
        case 'Q':
            push(persistent(pop()));
            return false;
        case 'P':
            fail("text persistent ids (protocol 0) are not written by torch.save");
        case '.':
            doc_.root_ = pop();
            return true;
        case '0':
            if (stack_.size() > floor())
                stack_.pop_back();
            else
                pop_mark();
            return false;
        case '1':
            pop_mark();
            return false;
        case '2':
            push(top());
            return false;
        default: {
            const char* name = opcode_name(op_);
            fail(name ? std::string("opcode not supported (torch.save does not write it)")
                      : std::string("unknown opcode (corrupt pickle)"));
        }
        }
    }

    const unsigned char* p_;
    size_t n_;
    size_t pos_ = 0, op_pos_ = 0;
    uint8_t op_ = 0;
    const std::string& label_;
    const PickleLimits& lim_;
    PickleDocument& doc_;
    std::vector<PickleValue*> stack_;
    std::vector<size_t> marks_;
    std::unordered_map<uint64_t, PickleValue*> memo_;
    std::map<std::string, PickleValue*> storages_;
    uint64_t elements_ = 0;
    int depth_ = 0;
};

PickleDocument unpickle_torch(const char* data, size_t size, const std::string& label, const PickleLimits& limits) {
    PickleDocument doc;
    Unpickler u(data, size, label, limits, doc);
    u.run();
    return doc;
}

} // namespace anchor
