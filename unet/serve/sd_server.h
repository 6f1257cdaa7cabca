// `anchor-sd serve`: the AUTOMATIC1111 API subset that clients use (/sdapi/v1/txt2img, img2img, samplers, sd-models,
// options, progress, interrupt), OpenAI's /v1/images/generations, and our own POST /anchor/v1/compare (several cache
// modes side by side with their figures and per-step records), over the shared server core (cache/serve/). One model
// in memory; every request runs as its own job (unet/pipeline/txt2img_job.h, unet/cache/compare.h) with caches of its own, so two
// requests never share cache state.
// This header's SdServer is the core (lifecycle, queue, the jobs, /health, /openapi.json); the routes of each API
// dialect are registered by a file of their own (unet/serve/sd_server_routes.h).
#pragma once

#include "cache/serve/http_server.h"
#include "unet/cache/cache_config.h"
#include "unet/pipeline/infotext.h"
#include "unet/pipeline/pipeline.h"
#include "unet/pipeline/txt2img_job.h"

#include <nlohmann/json.hpp>

#include <mutex>
#include <set>
#include <string>

namespace anchor::unet {

class ControlNetLibrary;
class UpscalerLibrary;

struct SdServerParams {
    serve::ServerOptions http;
    std::string model;         // what the clients see as the checkpoint (the -m path)
    CacheConfig default_cache; // when a request has no `cache` field (off)
    // Limits checked before anything is allocated (400 naming the field); the pipeline's memory estimate
    // (Txt2ImgPipeline::validate) is checked too.
    int max_steps = 150;
    int64_t max_pixels = 1024 * 1024;                // width x height
    int max_images = 8;                              // batch_size x n_iter of one request
    int max_modes = 6;                               // modes of one compare
    nlohmann::json facts = nlohmann::json::object(); // copied into every image record (program, threads, ...)
    // Live previews (unet/pipeline/preview.h): every N steps the job's latest preview becomes /sdapi/v1/progress's
    // current_image (0 = none).
    int preview_every = 5;
    // The decoder of requests without a `vae_decoder` field ("full" or "taesd"; taesd needs SDModels::taesd).
    VaeDecoder default_vae_decoder = VaeDecoder::Full;
    // Textual-inversion embeddings (--embedding-dir), read once at start and shared, unchanged, by every request.
    std::shared_ptr<const EmbeddingDatabase> embeddings;
    // ControlNets of A1111 requests' alwayson_scripts.controlnet (--control-net-dir), loaded at first use and kept.
    std::shared_ptr<ControlNetLibrary> controlnets;
    // ESRGAN upscalers of /sdapi/v1/extra-single-image's upscaler_1 (--upscaler-dir), loaded at first use and kept.
    std::shared_ptr<UpscalerLibrary> upscalers;
    void validate() const;                           // ParamError naming the field
};

class SdServer {
public:
    SdServer(Txt2ImgPipeline& pipe, SdServerParams p);
    // Binds (the port, 0 = any) and serves until a drain (SIGTERM) ends.
    void serve();
    serve::HttpServer& http() { return http_; }

private:
    // Each dialect's routes (unet/routes_*.cpp) use the core's request readers and job runner below.
    friend void register_a1111_routes(SdServer& s, serve::HttpServer& http);
    friend void register_openai_routes(SdServer& s, serve::HttpServer& http);
    friend void register_anchor_routes(SdServer& s, serve::HttpServer& http);
    friend void register_a1111_extras_routes(SdServer& s, serve::HttpServer& http);
    void add_routes();
    nlohmann::json openapi() const; // the OpenAPI description served at /openapi.json
    std::string model_name() const; // the checkpoint's file name, as the clients see it
    // A1111's fields every image request shares (the prompt aside), each range-checked (400 naming it).
    void read_image_fields(const serve::RequestFields& f, Txt2ImgParams& p) const;
    void check_pixels(const Txt2ImgParams& resolved) const; // width x height within max_pixels (400)
    // The job of a txt2img / img2img / images-generations request, every field checked before anything runs.
    Txt2ImgJob image_job(const serve::RequestFields& f, bool img2img);
    // Runs a job in the queue: the images (base64 PNG) with their records, infotexts, seeds and warnings.
    nlohmann::json run_images(const serve::HttpRequest& req, const Txt2ImgJob& job);
    Txt2ImgPipeline& pipe_;
    SdServerParams p_;
    int threads_;            // the program's intra-op threads, set again on the job thread
    InfotextFacts infotext_; // the model file's hash, once at start (not per request)
    serve::HttpServer http_;
    // Shapes (size, batch rows, guidance, init image) a UNet step already ran at in this process: a compare at one of
    // them needs no untimed warm-up step (run_compare_modes).
    std::mutex warm_mu_;
    std::set<std::string> warm_shapes_;
    bool first_at_shape(const Txt2ImgParams& resolved);
};

} // namespace anchor::unet
