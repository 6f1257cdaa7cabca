// What `anchor-sd` does with a prompt or a prompts file: the batches of plan_batches, each run through the pipeline
// with its cache mode, every image written as a PNG with a JSON sidecar (and optionally its tensors), outputs
// checked before anything runs. A library call, so that a server or an MPI job runs the same thing.
#pragma once

#include "unet/cache/cache_config.h"
#include "unet/pipeline/infotext.h"
#include "unet/pipeline/pipeline.h"
#include "unet/pipeline/upscale.h"

#include <nlohmann/json.hpp>

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace anchor::unet {

struct Txt2ImgJob {
    // The settings of every batch (prompts and seed are set per batch). Init images / masks: one for every image, one
    // per prompt of a prompts file (each batch gets those of its prompts), or, with one prompt, one per image of a
    // batch (Img2ImgParams).
    Txt2ImgParams params;
    std::vector<std::string> prompts;  // one prompt, or the lines of a prompts file
    int batch_size = 1;                // images per UNet batch (plan_batches)
    int batch_count = 1;               // batches per prompt group, batch k with seed + k
    CacheConfig cache;                 // cache mode, parsed at the edge (unet/cache/cache_config.h)
    std::string output = "output.png"; // image k > 0 gets a _k suffix; every image a <png>.json sidecar
    std::string save_latents;          // "": none; else initial noise, latents, embeddings, image per image
    bool overwrite = false;
    // false: nothing is written (no output checks, no sidecars); every image's PNG bytes, with the same text chunks,
    // come back in Txt2ImgJobImage::png_bytes (a server's reply).
    bool write_files = true;
    // Sharding over processes (mpirun -np N): this process runs batch b of plan_batches when b % shard_count ==
    // shard_rank; the image numbering stays the job's global one, so N processes write the files one process writes.
    int shard_rank = 0, shard_count = 1;
    // A batch whose every PNG and sidecar exists is not run again (a failed job resumes); its records are read back.
    bool skip_existing = false;
    nlohmann::json facts = nlohmann::json::object(); // copied into every sidecar (program, model, threads, ...)
    // The infotext's model facts (infotext_facts: the model file's hash, the LoRAs') when known already: a server
    // hashes the checkpoint once at load, not per request. Unset: computed at the job's start. Its cache mode is
    // the job's in any case.
    std::optional<InfotextFacts> infotext;
    // An ESRGAN upscale of every image before it is written (--upscale-model): the record says it, the PNG gets
    // A1111's `postprocessing` chunk as its Extras tab writes it.
    PostUpscale upscale;

    // ParamError naming the field (the pipeline validates its own params when it runs).
    void validate() const;
    // The output file of image k of the job: `base` itself for k = 0, <stem>_k<ext> after; a folder `base` (ending
    // in '/') gets DIR/00000.png, DIR/00001.png, ...
    static std::string numbered(const std::string& base, int k);
    // Images of the whole job (every shard).
    int image_count() const;
    // The init images and masks of one batch of plan_batches (see params).
    Img2ImgParams init_of(const BatchJob& batch) const;
};

struct Txt2ImgJobImage {
    std::string png;       // the file written ("" without write_files)
    nlohmann::json record; // what the sidecar holds
    std::string png_bytes; // without write_files: the encoded PNG with its infotext and record chunks
};

struct Txt2ImgJobResult {
    std::vector<Txt2ImgJobImage> images;
    std::vector<std::string> warnings;    // of the first batch (prompt truncation, ...)
    int64_t rss_first = -1, rss_max = -1; // resident set size after the first batch, and its maximum
};

struct Txt2ImgJobCallbacks {
    std::function<void(const ProgressInfo&, const std::string& label)> progress;
    std::function<void(const std::vector<Txt2ImgJobImage>& batch, double denoise_s, double decode_s, int64_t rss)>
        batch_done;
};

// Checks every output path first (none is replaced without job.overwrite), then runs the batches.
Txt2ImgJobResult run_txt2img_job(Txt2ImgPipeline& pipe, const Txt2ImgJob& job, const Txt2ImgJobCallbacks& cb = {});

// The manifest of a job written to files: every image's record (its sidecar: parameters, seed, timings), read from
// the sidecars, waiting up to `wait_s` seconds for those other shards are still writing. Throws anchor::Error naming
// the missing files after that.
nlohmann::json job_manifest(const Txt2ImgJob& job, double wait_s);
// Where the manifest goes: DIR/manifest.json for a folder output, else <stem>_manifest.json.
std::string manifest_path(const Txt2ImgJob& job);

// What every image of the job (and a compare report) records about the model: version, layout, family, attention
// kernel, the LoRAs merged at load, the prediction type in effect, how it was decided and the v-prediction test's mean
// (null when it did not run), the replacement VAE file (null: the model's own), the weights' storage dtype.
nlohmann::json model_record(const Txt2ImgPipeline& pipe);
// The sidecar record of image i of a run: every parameter, the seed, timings, the cache mode's per-step record.
nlohmann::json image_record(const Txt2ImgParams& p, const Txt2ImgResult& r, int i, const DenoiseController* ctl);

} // namespace anchor::unet
