// CI's sanitizer subset. The whole suite under AddressSanitizer + UndefinedBehaviorSanitizer (`tests/run.sh
// --sanitize`) needs an instrumented LibTorch-heavy build that does not fit CI's budget, so CI builds only the code
// that reads untrusted bytes and needs no LibTorch -- the safetensors header parser, the GPT-2 and CLIP BPE tokenizers
// (with their vocabulary readers), the torch.save zip reader and restricted unpickler -- with
// -fsanitize=address,undefined, and drives it here with:
//   1. every replayable fuzz input (seed corpora and kept crashes, tests/fuzz/fuzz_inputs.h);
//   2. N deterministic mutations per target (fixed seed: bit flips, interesting bytes, inserts, deletes, duplicated
//      ranges, splices of two inputs), a small in-process fuzzer for compilers without libFuzzer.
// Any sanitizer report or contract violation aborts, so the CTest entry fails.
// Usage: sanitized_parsers FUZZ_DIR [--mutations N] | --overflow-on-purpose
#include "cache/io/error.h"
#include "cache/io/pickle.h"
#include "cache/io/safetensors_header.h"
#include "cache/io/zip_file.h"
#include "fuzz/fuzz_inputs.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#define LLVMFuzzerTestOneInput fuzz_one_gpt2_tokenizer
#include "fuzz/fuzz_gpt2_tokenizer.cpp"
#undef LLVMFuzzerTestOneInput
#define LLVMFuzzerTestOneInput fuzz_one_clip_tokenizer
#include "fuzz/fuzz_clip_tokenizer.cpp"
#undef LLVMFuzzerTestOneInput

namespace {

// The header parser alone (fuzz_safetensors.cpp also builds tensors, which needs LibTorch). Contract: it accepts or
// throws anchor::Error; every accepted tensor lies inside the buffer, and reading all of its bytes stays in bounds.
int fuzz_one_safetensors_header(const uint8_t* data, size_t size) {
    try {
        const auto h = anchor::parse_safetensors_header(reinterpret_cast<const char*>(data), size, "fuzz");
        unsigned sum = 0;
        for (const auto& t : h.tensors) {
            if (t.end > h.data_size || t.begin > t.end || h.data_offset + h.data_size != size) std::abort();
            for (uint64_t i = t.begin; i < t.end; ++i) sum += data[h.data_offset + i];
        }
        (void)sum;
    } catch (const anchor::Error&) {
    }
    return 0;
}

// The torch.save readers without LibTorch (fuzz_torch_checkpoint.cpp also builds tensors): a zip archive's entries
// and its data.pkl, or bare pickle bytes. Contract: accept or throw anchor::Error; every tensor view accepted lies
// inside its storage.
void check_pickle(const char* data, size_t size) {
    const auto doc = anchor::unpickle_torch(data, size, "fuzz");
    const anchor::PickleValue& root = doc.root();
    const anchor::PickleValue* sd = root.get("state_dict");
    for (const anchor::PickleValue* d : {&root, sd}) {
        if (!d) continue;
        for (const auto& kv : d->entries) {
            const anchor::PickleValue* t = kv.second;
            if (!t->is(anchor::PickleValue::Kind::Tensor)) continue;
            const uint64_t es = anchor::storage_dtype_size(t->dtype);
            const uint64_t bytes = t->storage->untyped
                                       ? t->storage->numel
                                       : t->storage->numel * anchor::storage_dtype_size(t->storage->dtype);
            uint64_t last = static_cast<uint64_t>(t->offset);
            bool empty = false;
            for (size_t i = 0; i < t->shape.size(); ++i) {
                if (t->shape[i] == 0) empty = true;
                if (t->shape[i] > 0)
                    last += static_cast<uint64_t>(t->shape[i] - 1) * static_cast<uint64_t>(t->stride[i]);
            }
            if (!empty && last >= bytes / es) std::abort();
        }
    }
}

int fuzz_one_torch_checkpoint(const uint8_t* data, size_t size) {
    const char* d = reinterpret_cast<const char*>(data);
    try {
        if (!anchor::looks_like_zip(d, size)) {
            check_pickle(d, size);
            return 0;
        }
        const anchor::ZipReader zip(d, size, "fuzz");
        for (const auto& e : zip.entries()) {
            if (e.data_offset + e.compressed_size > size) std::abort();
            const std::string bytes = zip.read(e, 1 << 20);
            if (e.name.size() >= 8 && e.name.compare(e.name.size() - 8, 8, "data.pkl") == 0)
                check_pickle(bytes.data(), bytes.size());
        }
    } catch (const anchor::Error&) {
    }
    return 0;
}

// One to four random edits of `in`, with `other` as splice material.
std::string mutate(std::string s, const std::string& other, std::mt19937_64& rng) {
    static const char kInteresting[] = {'\0', '\xff', '\x7f', '\x80', '"', '\\', '{',    '}',    '[',    ']', ',', ':',
                                        '-',  '0',    '9',    'e',    ' ', '\n', '\xc3', '\xe2', '\xf0', '<', '|', '>'};
    auto pick = [&](size_t n) { return n ? static_cast<size_t>(rng() % n) : 0; };
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
        switch (rng() % 6) {
        case 0: // flip a bit
            if (!s.empty()) s[pick(s.size())] ^= static_cast<char>(1u << (rng() % 8));
            break;
        case 1: // set an interesting byte
            if (!s.empty()) s[pick(s.size())] = kInteresting[pick(sizeof(kInteresting))];
            break;
        case 2: // insert 1..8 bytes
            s.insert(pick(s.size() + 1), std::string(1 + rng() % 8, kInteresting[pick(sizeof(kInteresting))]));
            break;
        case 3: // delete a range
            if (!s.empty()) {
                const size_t at = pick(s.size());
                s.erase(at, 1 + pick(std::min<size_t>(16, s.size() - at)));
            }
            break;
        case 4: // duplicate a range
            if (!s.empty()) {
                const size_t at = pick(s.size()), len = 1 + pick(std::min<size_t>(32, s.size() - at));
                s.insert(pick(s.size() + 1), s.substr(at, len));
            }
            break;
        default: // splice: a prefix of s and a suffix of other
            s = s.substr(0, pick(s.size() + 1)) + other.substr(pick(other.size() + 1));
        }
    }
    return s;
}

} // namespace

int main(int argc, char** argv) {
    // Proof that the instrumentation is live: a one-past-the-end heap read that AddressSanitizer must stop
    // (CTest runs this as sanitized_parsers_catches_overflow, which is expected to fail).
    if (argc == 2 && std::string(argv[1]) == "--overflow-on-purpose") {
        std::vector<char> v(16, 'x');
        volatile const char* p = v.data();
        std::printf("read past the end: %d\n", p[v.size()]);
        return 0;
    }
    long mutations = 2000;
    if (argc == 4 && std::string(argv[2]) == "--mutations") mutations = std::strtol(argv[3], nullptr, 10);
    if ((argc != 2 && argc != 4) || mutations < 0) {
        std::fprintf(stderr, "usage: sanitized_parsers FUZZ_DIR [--mutations N]\n");
        return 2;
    }
    using Fn = int (*)(const uint8_t*, size_t);
    struct Target {
        const char* corpus;
        Fn fn;
    };
    const Target targets[] = {{"safetensors", fuzz_one_safetensors_header},
                              {"gpt2_tokenizer", fuzz_one_gpt2_tokenizer},
                              {"clip_tokenizer", fuzz_one_clip_tokenizer},
                              {"torch_checkpoint", fuzz_one_torch_checkpoint}};
    std::mt19937_64 rng(20261130);
    for (const auto& t : targets) {
        const auto inputs = anchor::fuzz::fuzz_inputs(argv[1], t.corpus);
        if (inputs.empty()) {
            std::fprintf(stderr, "sanitized_parsers: no inputs for %s under %s\n", t.corpus, argv[1]);
            return 1;
        }
        auto run = [&](const std::string& b) { t.fn(reinterpret_cast<const uint8_t*>(b.data()), b.size()); };
        for (const auto& b : inputs) run(b);
        for (long i = 0; i < mutations; ++i)
            run(mutate(inputs[rng() % inputs.size()], inputs[rng() % inputs.size()], rng));
        std::printf("sanitized_parsers: %s: %zu inputs + %ld mutations, no sanitizer report\n", t.corpus, inputs.size(),
                    mutations);
    }
    return 0;
}
