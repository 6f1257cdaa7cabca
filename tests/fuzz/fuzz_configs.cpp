// libFuzzer target: every JSON file reader (UNet/VAE/CLIP/GPT-2/MDLM configs, scheduler config, both anchor-profile
// formats). The first byte picks the reader, the rest is written to a file and read as a user's file would be.
// Contract: a reader returns a valid config or throws anchor::Error (which names the file) — no other exception type
// (a bare nlohmann message would not say which file or field is wrong), no crash, no unbounded allocation.
#include "cache/anchor_profile.h"
#include "cache/io/error.h"
#include "text/gpt2/gpt2_model.h"
#include "text/diffusion/mdlm_cache.h"
#include "text/diffusion/mdlm_model.h"
#include "unet/model/clip_text.h"
#include "unet/cache/freq_cache.h"
#include "unet/samplers/scheduler.h"
#include "unet/model/unet_model.h"
#include "unet/model/vae.h"

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

namespace {
const std::string& scratch_path() {
    static const std::string p = "/tmp/anchor_fuzz_config_" + std::to_string(getpid()) + ".json";
    return p;
}
} // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    using namespace anchor;
    if (size == 0) return 0;
    const int which = data[0] % 8;
    const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
    const auto& path = scratch_path();
    if (FILE* f = std::fopen(path.c_str(), "wb")) {
        std::fwrite(text.data(), 1, text.size(), f);
        std::fclose(f);
    } else {
        return 0;
    }
    try {
        switch (which) {
        case 0:
            (void)unet::UNetConfig::from_json_file(path);
            break;
        case 1:
            (void)unet::VaeConfig::from_json_file(path);
            break;
        case 2:
            (void)unet::ClipTextConfig::from_json_file(path);
            break;
        case 3:
            text::Gpt2Config::from_json_file(path).validate();
            break;
        case 4:
            (void)text::MdlmConfig::load(path);
            break;
        case 5:
            (void)unet::SchedulerConfig::from_json_text(text, "fuzz.json");
            break;
        default: // both profile kinds (SD step ranges, text layer classes) are one type
            (void)cache::AnchorProfile::load(path);
            break;
        }
    } catch (const anchor::Error&) {
    }
    return 0;
}
