// libFuzzer target: the command-line mode parsers (UNet --cache/--compare modes, GPT-2 --kv, MDLM --cache, KJV
// --holdout, sampler / position-policy / unmask names). The first byte picks the parser. Contract: a parser returns
// a value or throws anchor::Error (UsageError for bad syntax); it never crashes or hangs.
#include "cache/io/error.h"
#include "cache/sink_rolling_kv.h"
#include "text/gpt2/gpt2_model.h"
#include "text/diffusion/mdlm_cache.h"
#include "text/diffusion/mdlm_sampler.h"
#include "text/train/gpt2_train.h"
#include "unet/cache/freq_cache.h"
#include "unet/samplers/scheduler.h"

#include <cstdint>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    using namespace anchor;
    if (size == 0) return 0;
    const int which = data[0] % 7;
    std::string s(reinterpret_cast<const char*>(data) + 1, size - 1);
    // A profile= value is a file name: keep the fuzzer away from reading arbitrary files (fuzz_configs covers them).
    if (s.find("profile") != std::string::npos) return 0;
    try {
        switch (which) {
        case 0:
            (void)unet::parse_cache_mode(s);
            break;
        case 1:
            (void)text::KvSpec::parse(s);
            break;
        case 2:
            (void)text::parse_cache_spec(s);
            break;
        case 3:
            (void)text::HoldoutSpec::parse(s);
            break;
        case 4:
            (void)unet::sampler_from_string(s);
            break;
        case 5:
            (void)enum_from_string(text::position_mode_table(), s, "position policy");
            break;
        default:
            (void)enum_from_string(text::unmask_rule_table(), s, "unmasking rule");
            break;
        }
    } catch (const anchor::Error&) {
    }
    return 0;
}
