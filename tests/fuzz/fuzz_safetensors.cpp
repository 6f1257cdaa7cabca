// libFuzzer target: the safetensors header/offset parser must reject any byte string with anchor::Error, never crash,
// read out of bounds or allocate without bound.
#include "cache/io/error.h"
#include "cache/io/safetensors.h"

#include <cstdint>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    try {
        auto f = anchor::SafeTensorsFile::from_bytes(std::string(reinterpret_cast<const char*>(data), size), "fuzz");
        for (const auto& ti : f->tensors()) {
            auto t = f->tensor(ti.name);
            if (t.numel() > 0) (void)t.flatten()[0].item<double>();
        }
    } catch (const anchor::Error&) {
    }
    return 0;
}
