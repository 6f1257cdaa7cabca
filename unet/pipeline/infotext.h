// Generation parameters in the PNGs the image ecosystem reads: AUTOMATIC1111's `parameters` text ("infotext", written
// by create_infotext in stable-diffusion-webui modules/processing.py, read back by parse_generation_parameters in
// modules/infotext_utils.py; also what ComfyUI's and Civitai's readers take) and our own JSON record, the sidecar's
// content, as an iTXt chunk `anchorcache`. Both ways: the chunks of an image, and the parameters of a PNG to run again.
#pragma once

#include "cache/io/png_text.h"
#include "unet/pipeline/pipeline.h"

#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace anchor::unet {

inline constexpr const char* kInfotextKeyword = "parameters"; // A1111's tEXt keyword
inline constexpr const char* kRecordKeyword = "anchorcache";  // our JSON record (iTXt)

// A1111's name of a sampler and its "Schedule type" (A1111 >= 1.9 splits "DPM++ 2M Karras" into the two).
struct A1111Sampler {
    std::string sampler, schedule_type;
};
A1111Sampler a1111_sampler(SamplerKind k);
// Ours from A1111's sampler name and schedule type (also the older one-field "DPM++ 2M Karras"); nullopt when this
// engine has no such sampler.
std::optional<SamplerKind> sampler_from_a1111(const std::string& sampler, const std::string& schedule_type = "");
// Any name a user may give a sampler: A1111's (as sampler_from_a1111), ours (sampler_table), an alias
// (sampler_alias_table: stable-diffusion.cpp's "dpm++2m", ComfyUI's "dpm_2_ancestral", ...) or stable-diffusion.cpp's
// infotext form "dpm++2m karras"; nullopt when none matches.
std::optional<SamplerKind> sampler_from_any_name(const std::string& name, const std::string& schedule_type);
// The same for a name given as option `field` (the CLI's --sampler): ParamError(field) naming the choices.
SamplerKind parse_sampler_name(const std::string& name, const std::string& field);

// An infotext: the prompt, the negative prompt and the "Key: value" fields of its last line, in order, values as
// they read after unquoting.
struct Infotext {
    std::string prompt, negative_prompt;
    std::vector<std::pair<std::string, std::string>> fields;
    // Replaces the value of `key` or appends the field.
    void set(const std::string& key, const std::string& value);
    const std::string* get(const std::string& key) const; // nullptr when absent
};

// create_infotext's layout: "<prompt>[\nNegative prompt: <neg>]\n<K: v, K: v, ...>" stripped, each value quoted as
// infotext_utils.quote does (JSON string when it holds ',', ':' or a newline).
std::string format_infotext(const Infotext& t);
// parse_generation_parameters: the last line holds the fields when it has at least 3 of them, the lines before are
// the prompt up to "Negative prompt:", the rest the negative prompt; quoted values are JSON-unquoted.
Infotext parse_infotext(const std::string& text);
std::string infotext_quote(const std::string& value);
// A number as Python's str() spells it, less the ".0" of whole numbers (A1111's UI hands whole numbers over as ints:
// "CFG scale: 7", "CFG scale: 7.5").
std::string infotext_number(double v);

// What the infotext says beyond Txt2ImgParams, the same for every image of a job.
struct InfotextFacts {
    std::string model_hash; // A1111's short hash: first 10 hex digits of the model file's SHA-256
    std::string model_name; // the checkpoint's file stem (a diffusers folder: its name)
    // A1111's "Lora hashes": name and first 12 hex digits of the file's SHA-256. A1111 itself hashes a .safetensors
    // LoRA without its header (the "addnet" hash of modules/hashes.py), so its own hash of the same file differs.
    std::vector<std::pair<std::string, std::string>> lora_hashes;
    // A1111's "TI hashes": the textual-inversion embeddings the batch's prompts named (Txt2ImgResult::ti_hashes),
    // name and first 10 hex digits of the file's SHA-256; set per batch.
    std::vector<std::pair<std::string, std::string>> ti_hashes;
    std::string cache_mode = "off"; // written as the extra field "AnchorCache" unless off
    std::string version;            // "AnchorCache <version>"
};
// The facts of a loaded model: hashes the model file (once per job: it is the size of the checkpoint).
InfotextFacts infotext_facts(const SDModels& models, const std::string& cache_mode);

// The infotext of image i of a run with resolved params `p` (A1111's field order: Steps, Sampler, Schedule type, CFG
// scale, Seed, Size, Model hash, Model, Denoising strength, Clip skip, extra fields, Version).
Infotext infotext_of(const Txt2ImgParams& p, int image, const InfotextFacts& facts);
// The chunks of an image: `parameters` (tEXt, iTXt when the text is not Latin-1, as PIL writes it) and the JSON
// record as iTXt `anchorcache`.
std::vector<PngTextChunk> image_text_chunks(const Infotext& t, const nlohmann::json& record);

// What a PNG says it was made with; unset fields were not in it.
struct ImageParameters {
    std::string source; // "anchorcache" (our JSON record) or "parameters" (an A1111 infotext)
    std::optional<std::string> prompt, negative_prompt, cache_mode, init_image, mask;
    std::optional<int> steps, width, height;
    std::optional<int> clip_skip; // A1111's and anchor-sd's --clip-skip counting: 1 = last layer, 2 = penultimate
    std::optional<SamplerKind> sampler;
    std::optional<NoiseSchedule> schedule;
    std::optional<PromptSyntax> prompt_syntax; // our record's; an A1111 infotext's prompt is A1111 syntax
    std::optional<double> cfg_scale, strength, eta;
    std::optional<int64_t> seed;
    // Our record's decoding and spacing choices (A1111's infotext has none of them): --timestep-spacing,
    // --vae-decoder (taesd: the TAESD found next to the model; the record does not name the file) and --vae-tiling
    // with its tile size and overlap.
    std::optional<TimestepSpacing> timestep_spacing;
    std::optional<VaeDecoder> vae_decoder;
    std::optional<VaeTiling> vae_tiling;
    std::vector<std::string> notes; // fields read but not applied (unknown ones, LoRAs, the model, batches)
    // The textual-inversion embeddings the image was made with (A1111's "TI hashes" / our record's
    // "textual_inversion"): name and short hash, to compare with the embeddings loaded now.
    std::vector<std::pair<std::string, std::string>> ti_hashes;
    // sd-webui-controlnet's "ControlNet N" fields, in N order (the control image is not in an infotext).
    struct ControlUnit {
        std::string module, model;
        std::string image; // our record's control image file ("" in an infotext, or an image a request sent)
        double weight = 1.0, start = 0.0, end = 1.0;
        bool guess_mode = false; // Control Mode: ControlNet is more important
    };
    std::vector<ControlUnit> control;
    // A1111's hires fix (Hires upscale / Hires resize, Hires steps, Hires upscaler and the Denoising strength; our
    // record's "hires"); strength is then unset.
    std::optional<HiresParams> hires;
};
// From our JSON record (the sidecar or the `anchorcache` chunk); `what` names the source in errors.
ImageParameters image_parameters_from_record(const nlohmann::json& record, const std::string& what);
// From an A1111 infotext; unknown fields become notes.
ImageParameters image_parameters_from_infotext(const std::string& text, const std::string& what);
// From a PNG file: the `anchorcache` chunk when present, else the `parameters` chunk. Throws anchor::Error naming the
// file when it is not a readable PNG or has neither chunk.
ImageParameters read_image_parameters(const std::string& png);
// A1111's short model hash of a file (modules/hashes.py model_hash: SHA-256 of the 64 KiB at offset 1 MiB, first 8
// hex digits), which sd-webui-controlnet writes after a ControlNet's name; "" for a folder or an unreadable file.
std::string a1111_legacy_hash(const std::string& path);

// "name: hash, name: hash" (A1111's TI hashes / Lora hashes value) -> pairs; entries without ':' are skipped.
std::vector<std::pair<std::string, std::string>> parse_name_hashes(const std::string& value);

} // namespace anchor::unet
