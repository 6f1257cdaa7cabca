// libFuzzer target: the CLIP BPE tokenizer (bundled vocabulary) on arbitrary bytes. Contract: encode either succeeds
// with ids inside the vocabulary or throws anchor::Error; it never crashes, reads out of bounds or loops.
#include "cache/io/error.h"
#include "unet/model/clip_tokenizer.h"

#include <cstdint>
#include <cstdlib>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    static const auto tok = anchor::unet::ClipTokenizer::bundled();
    const std::string s(reinterpret_cast<const char*>(data), size);
    try {
        for (auto id : tok.encode(s))
            if (id < 0 || id >= static_cast<int64_t>(tok.vocab_size())) std::abort();
    } catch (const anchor::Error&) {
    }
    return 0;
}
