// A restricted unpickler for PyTorch state dicts (the data.pkl of a torch.save zip archive), free of LibTorch so the
// parser that sees untrusted bytes can be built alone under the sanitizers (tests/sanitize).
//
// It is a parser, not an evaluator: no Python object is ever created and no code ever runs. It implements the
// pickle virtual machine (opcodes as documented in CPython's Lib/pickletools.py) for the opcodes torch.save writes
// (protocol 2, plus the binary opcodes of protocols 3-5 so a pickle_protocol=4/5 file reads too) and builds a tree of
// PickleValue: None, bool, int, float, str, bytes, tuple, list, dict, set, and three torch values: a storage (a
// persistent id), a tensor (a strided view of a storage) and a dtype.
//
// Globals -- the one rule:
//   * A global is only ever a name. The names this reader understands are evaluated by our own code:
//     collections.OrderedDict, builtins.dict/list/set/frozenset/tuple, torch.Size, torch._utils._rebuild_tensor /
//     _rebuild_tensor_v2 / _rebuild_tensor_v3 / _rebuild_parameter / _rebuild_parameter_with_state,
//     torch._tensor._rebuild_from_type_v2 (plain tensors and parameters), the storage types (torch.FloatStorage,
//     HalfStorage, BFloat16Storage, DoubleStorage, LongStorage, IntStorage, ShortStorage, CharStorage, ByteStorage,
//     BoolStorage, UntypedStorage) and the dtypes (torch.float32, ...).
//   * Names of code that runs programs, evaluates or imports (os.*, posix.*, nt.*, subprocess.*, sys.*, runpy.*,
//     pty.*, importlib.*, ctypes.*, pickle.*, marshal.*, shutil.*, socket.*, webbrowser.*, multiprocessing.*,
//     builtins eval/exec/compile/getattr/setattr/delattr/__import__/open/globals/locals/vars/input/breakpoint,
//     operator.attrgetter/methodcaller, ...) are refused as soon as the GLOBAL opcode names them, wherever they are
//     in the file: a checkpoint has no use for them, so their presence means the file is hostile. The error names
//     the global.
//   * Every other name (pytorch_lightning.callbacks...ModelCheckpoint, numpy.core.multiarray.scalar,
//     _codecs.encode, argparse.Namespace, ...) is an inert placeholder: calling it (REDUCE, NEWOBJ), building it
//     (BUILD) or adding items to it yields a placeholder. Metadata sections of a checkpoint (callbacks, hyper
//     parameters, optimizer states) therefore read. A placeholder where tensor data is needed (the storage, shape or
//     stride of a tensor, the function of _rebuild_from_type_v2) is an error naming the global it came from.
//
// Limits: the memo, the stack, the mark stack, every string, the number of values and the total number of container
// elements (copies included) are bounded (PickleLimits); a length or index past a limit or past the end of the input is
// an error, checked before anything is allocated. Values live in one arena owned by the PickleDocument, so cyclic or
// deeply nested input neither leaks nor recurses on destruction. Every error is an anchor::Error naming the file
// (label), the opcode and its byte offset.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <utility>
#include <vector>

namespace anchor {

// The element types of torch storages (torch.<Name>Storage) and dtypes.
enum class StorageDType { Float, Half, BFloat16, Double, Long, Int, Short, Char, Byte, Bool };
size_t storage_dtype_size(StorageDType t);
const char* storage_dtype_name(StorageDType t); // "float32", "float16", ... (torch's dtype names)

struct PickleValue {
    enum class Kind {
        None,
        Bool,
        Int,
        Float,
        String,
        Bytes,
        Tuple,
        List,
        Dict,
        Set,
        Global,
        Opaque,
        Storage,
        Tensor,
        DType
    };
    Kind kind = Kind::None;
    bool boolean = false;
    int64_t integer = 0;
    double real = 0;
    std::string text;                      // String, Bytes; Global/Opaque: "module.name"
    std::vector<const PickleValue*> items; // Tuple, List, Set
    std::vector<std::pair<const PickleValue*, const PickleValue*>> entries; // Dict, in insertion order

    // Storage (persistent id ('storage', <type>, key, location, numel)); DType: `dtype` only.
    StorageDType dtype = StorageDType::Float;
    bool untyped = false; // torch.UntypedStorage: numel counts bytes, the tensor names its dtype
    std::string key;      // the archive's data/<key> record
    std::string location; // "cpu", "cuda:0", ... (everything is read to the CPU)
    uint64_t numel = 0;   // elements of `dtype` (bytes when untyped)

    // Tensor: a strided view of `storage` (a Storage value), elements counted in `dtype`.
    const PickleValue* storage = nullptr;
    int64_t offset = 0;
    std::vector<int64_t> shape, stride;

    bool is(Kind k) const { return kind == k; }
    // The dict value under a string key (the last one set, as in Python), nullptr when absent or not a dict.
    const PickleValue* get(const std::string& key) const;
    std::string describe() const; // "a dict", "a placeholder of 'x.y'" ... for error messages
};

struct PickleLimits {
    size_t max_memo = size_t(1) << 22;         // memo entries (and the largest memo index accepted)
    size_t max_stack = size_t(1) << 20;        // values on the stack, marks included
    uint64_t max_string = uint64_t(1) << 28;   // bytes of one str/bytes
    uint64_t max_elements = uint64_t(1) << 24; // container elements added in total (copies included)
    // Values built in total: what bounds the arena (a few hundred bytes each). A state dict tensor costs about
    // 20 + 2 x its dimensions, so the default holds some 80,000 tensors.
    size_t max_values = size_t(1) << 21;
    int max_dims = 64; // dimensions of a tensor
};

// The values of one pickle; the root is what STOP returned.
class PickleDocument {
public:
    const PickleValue& root() const { return *root_; }
    size_t size() const { return values_.size(); }

private:
    friend class Unpickler;
    std::deque<PickleValue> values_;
    const PickleValue* root_ = nullptr;
};

// Parses the pickle bytes. Throws anchor::Error naming `label`, the opcode and its offset.
PickleDocument unpickle_torch(const char* data, size_t size, const std::string& label, const PickleLimits& limits = {});

} // namespace anchor
