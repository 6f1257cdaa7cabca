// `anchor-sd serve`: the AUTOMATIC1111 API subset that clients use (/sdapi/v1/txt2img, img2img, samplers, sd-models,
// options, progress, interrupt), OpenAI's /v1/images/generations, and our own POST /anchor/v1/compare (several cache
// modes side by side with their figures and per-step records), over the shared server core (cache/serve/). One model
// in memory; every request runs as its own job (unet/txt2img_job.h, unet/compare.h) with caches of its own, so two
// requests never share cache state.
#pragma once

#include "cache/serve/http_server.h"
#include "unet/cache_config.h"
#include "unet/infotext.h"
#include "unet/pipeline.h"

#include <nlohmann/json.hpp>

#include <mutex>
#include <set>
#include <string>

namespace anchor::unet {

struct SdServerParams {
    serve::ServerOptions http;
    std::string model;                 // what the clients see as the checkpoint (the -m path)
    CacheConfig default_cache; // when a request has no `cache` field (off)
    // Limits checked before anything is allocated (400 naming the field); the pipeline's memory estimate
    // (Txt2ImgPipeline::validate) is checked too.
    int max_steps = 150;
    int64_t max_pixels = 1024 * 1024;                // width x height
    int max_images = 8;                              // batch_size x n_iter of one request
    int max_modes = 6;                               // modes of one compare
    nlohmann::json facts = nlohmann::json::object(); // copied into every image record (program, threads, ...)
    void validate() const;                           // ParamError naming the field
};

class SdServer {
public:
    SdServer(Txt2ImgPipeline& pipe, SdServerParams p);
    // Binds (the port, 0 = any) and serves until a drain (SIGTERM) ends.
    void serve();
    serve::HttpServer& http() { return http_; }

private:
    void add_routes();
    nlohmann::json openapi() const; // the OpenAPI description served at /openapi.json
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
