// Finding a model: the one resolver every loader goes through (Stable Diffusion pipelines and components, GPT-2,
// the text-diffusion LM). Given the path a user typed it says what it is (layout), what kind of model (architecture,
// from the config's class / model_type, else from tensor names), which weight files hold it (a file, the shards of
// an index, the loose files of a folder, a diffusers component's standard names and variants), where its config is,
// and for a diffusers pipeline the same for each component folder. Loading is then a lookup: WeightMap::load_files
// over `weight_files`.
#pragma once

#include "cache/io/enum_table.h"

#include <nlohmann/json.hpp>

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace anchor {

class WeightMap;

enum class ModelLayout {
    WeightsFile,        // one .safetensors or torch.save (.ckpt/.pt/.pth/.bin) file (e.g. a single-file SD checkpoint)
    ShardedIndex,       // a *.safetensors.index.json and its shards
    WeightsFolder,      // a folder of weights (+ config.json), e.g. a Hugging Face GPT-2 folder
    DiffusersPipeline,  // model_index.json / unet/ vae/ text_encoder/ ... component folders
    DiffusersComponent, // one component folder: config.json + diffusion_pytorch_model / model weights
};
const EnumTable<ModelLayout>& model_layout_table();

enum class ModelArch {
    Unknown,
    StableDiffusion, // a pipeline, or a single file with model.diffusion_model.* tensors
    UNet2DCondition,
    AutoencoderKL,
    ClipText, // CLIPTextModel / CLIPTextModelWithProjection
    Gpt2,
    MaskedDiffusionLM, // the text-diffusion LM (MDLM)
};
const EnumTable<ModelArch>& model_arch_table();

struct ModelSource {
    std::string path; // as given
    ModelLayout layout = ModelLayout::WeightsFile;
    ModelArch arch = ModelArch::Unknown;
    std::vector<std::string> weight_files;         // weight files in load order (shards: those of the index)
    std::string index_file;                        // the *.safetensors.index.json of a sharded checkpoint, else empty
    std::string config_file;                       // config.json (model_index.json for a pipeline), else empty
    nlohmann::json config;                         // its parsed content (null when there is none)
    std::map<std::string, ModelSource> components; // diffusers pipeline: unet, vae, text_encoder, ... (present ones)
    std::map<std::string, std::string> files;      // other files found: scheduler_config, tokenizer (a folder), hints

    bool has_component(const std::string& name) const { return components.count(name) != 0; }
    // The component; throws anchor::Error naming the pipeline folder and the components it has.
    const ModelSource& component(const std::string& name) const;
    // The path of a named file, "" when absent.
    std::string file(const std::string& name) const;
    // Every tensor of the weight files (or of the index), all problems reported at once (WeightMap).
    WeightMap load_weights() const;
    std::string describe() const; // "diffusers-pipeline stable-diffusion '<path>'"
};

struct ResolveOptions {
    // A folder with several loose .safetensors files keeps those holding at least one tensor this accepts (e.g.
    // GPT-2's wte.weight / h.N.*); unset: all of them.
    std::function<bool(const std::string& tensor_name)> tensor_filter;
    // What the caller expects, for error messages ("GPT-2 model", "Stable Diffusion model").
    std::string what = "model";
};

// Throws anchor::Error naming the path and what was looked for when nothing fits.
ModelSource resolve_model(const std::string& path, const ResolveOptions& opts = {});

} // namespace anchor
