// What an SD 3 / 3.5 image says about how it was made: the JSON record (PNG iTXt chunk and sidecar) and the A1111
// infotext, from the run's parameters and result, as unet/pipeline/infotext.h does for SD 1.x / SDXL.
#pragma once

#include "unet/pipeline/infotext.h"
#include "unet/pipeline/sd3_pipeline.h"

#include <nlohmann/json.hpp>

#include <string>

namespace anchor::unet {

// What the record holds beyond the parameters and result: how the program was invoked.
struct SD3RunInfo {
    std::string model;  // as given (-m)
    std::string dtype;  // as given (--dtype)
    std::string output; // the PNG written
    int threads = 0;
    double load_s = 0;
    std::vector<LoraApplied> loras; // merged at load (SD3Models::loras)
};

// The record of the first image of `p` (one prompt per run): prompt, negative prompt (null when none was given),
// seed, steps, guidance, size, sampler, shift, T5 use, skip-layer guidance, the LoRAs merged, timings, peak RSS.
nlohmann::json sd3_run_record(const SD3Txt2ImgParams& p, const SD3Txt2ImgResult& r, const SD3RunInfo& run);

// A1111's parameters text: Steps, Sampler (Euler), Schedule type (Simple), CFG scale, Seed, Size, Model (the folder's
// or file's name), Shift, T5 off where it was, the SLG fields where it ran, Lora hashes (A1111's "name: first 12 hex
// digits of the file's SHA-256") where LoRAs were merged, Version.
Infotext sd3_infotext(const SD3Txt2ImgParams& p, const SD3Txt2ImgResult& r, const std::string& model,
                      const std::vector<LoraApplied>& loras = {});

} // namespace anchor::unet
