// libFuzzer target: any bytes as a torch.save checkpoint (.ckpt/.pt). The zip reader, the restricted unpickler and
// the tensor views must accept or throw anchor::Error -- never crash, read out of bounds, allocate without bound or
// run anything.
#include "cache/io/error.h"
#include "cache/io/torch_checkpoint.h"

#include <cstdint>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    try {
        auto ck = anchor::TorchCheckpoint::from_bytes(std::string(reinterpret_cast<const char*>(data), size), "fuzz");
        for (const auto& name : ck->names()) {
            auto t = ck->tensor(name);
            if (t.numel() > 0) (void)t.flatten()[-1].item<double>();
        }
    } catch (const anchor::Error&) {
    }
    return 0;
}
