// libFuzzer target: the GPT-2 byte-level BPE tokenizer (assets/vocab/gpt2) on arbitrary bytes. Contract: encode either
// succeeds or throws anchor::Error (invalid UTF-8 is rejected with the byte offset), and for every input it accepts,
// decode(encode(s)) == s — with and without `<|endoftext|>` as a special token.
#include "cache/io/error.h"
#include "text/gpt2/gpt2_tokenizer.h"

#include <cstdint>
#include <cstdlib>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    static const auto tok = anchor::text::Gpt2Tokenizer::load_default();
    if (size == 0) return 0;
    const bool special = data[0] & 1;
    const std::string s(reinterpret_cast<const char*>(data) + 1, size - 1);
    try {
        const auto ids = tok.encode(s, special);
        if (tok.decode(ids) != s) std::abort(); // round trip must be exact for accepted input
        if (!special) { // encode_first has no special-token mode: it is a prefix of the plain encoding
            const auto first = tok.encode_first(s, ids.size() / 2);
            for (size_t i = 0; i < first.size(); ++i)
                if (first[i] != ids[i]) std::abort();
        }
    } catch (const anchor::Error&) {
    }
    return 0;
}
