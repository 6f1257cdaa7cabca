// The routes of `anchor-sd serve`, one file per API dialect (the shape of stable-diffusion.cpp's
// examples/server/routes_*.cpp): unet/serve/routes_a1111.cpp (AUTOMATIC1111's /sdapi/v1/*), unet/serve/routes_openai.cpp
// (OpenAI's /v1/images/generations) and unet/serve/routes_anchor.cpp (our /anchor/v1/compare). The server core
// (unet/serve/sd_server.cpp: lifecycle, queue, jobs, /health, /openapi.json) calls each registration once, and the request
// checks that several dialects share are declared here.
#pragma once

#include "cache/serve/http_server.h"
#include "unet/serve/sd_server.h"

#include <nlohmann/json.hpp>

#include <string>

namespace anchor::unet {

// The server core's names every route file uses.
using serve::HttpError;
using serve::HttpReply;
using serve::HttpRequest;
using serve::JobControl;
using serve::RequestFields;

void register_a1111_routes(SdServer& s, serve::HttpServer& http);
void register_openai_routes(SdServer& s, serve::HttpServer& http);
void register_anchor_routes(SdServer& s, serve::HttpServer& http);
// A1111's Extras: POST /sdapi/v1/extra-single-image with the --upscaler-dir models (routes_a1111_extras.cpp).
void register_a1111_extras_routes(SdServer& s, serve::HttpServer& http);

namespace sd_routes {

// A mode's demands on the model (its branch exists), as a 400 naming `field`.
void check_cache_for_model(const CacheConfig& c, const SDModels& models, const std::string& field);

// The request's name of a library params field (A1111's names where they differ).
std::string request_field(const std::string& field);

// Runs `f`; a library ParamError comes out as the 400 of the request field it is about.
template <class F> void as_request(F&& f) {
    try {
        f();
    } catch (const ParamError& e) {
        const std::string field = request_field(e.field());
        throw serve::HttpError(400, field, field + ": " + e.detail());
    }
}

// The request's prompt fields within their bounds (unet/pipeline/prompt_syntax.h) before anything reads them further: bytes
// here, then A1111 tokens on the connection thread (linear in the bytes, so bounded) before the job is queued.
void check_prompts(Txt2ImgPipeline& pipe, const Txt2ImgParams& p, const std::string& prompt);

// A base64 image of a request as uint8 pixels, decoded as `anchor-sd --init-img` reads a file (400 naming `field`).
torch::Tensor request_image(const std::string& b64, const std::string& field, bool grey);
// Progress of a job for /sdapi/v1/progress (A1111's fields, and ours under "anchor").
nlohmann::json progress_json(const ProgressInfo& pi, int unit, int units, const std::string& mode, int full_steps);

// The routes every model kind serves alike (routes_a1111.cpp): /sdapi/v1/progress (the running job's progress, the
// queue, its preview), /sdapi/v1/interrupt and /sdapi/v1/skip (stop the running job).
void register_job_routes(serve::HttpServer& http);
// /sdapi/v1/sd-models (the one model: `name`, its path `filename`) and POST /sdapi/v1/options (only that name is
// accepted as sd_model_checkpoint).
void register_model_routes(serve::HttpServer& http, const std::string& name, const std::string& filename);
// A compare request's `modes`: an array, or one comma list as anchor-sd --compare takes it (`dflt` when absent);
// none or more than `max_modes` is a 400 naming "modes".
std::vector<std::string> request_mode_texts(const RequestFields& f, const std::string& dflt, int max_modes);
// OpenAI's image request as an A1111 txt2img body: n -> batch_size (<= max_images), size "WxH" -> width, height,
// response_format b64_json only (400 naming the field).
nlohmann::json openai_image_body(const RequestFields& f, int max_images);
// OpenAI's reply: data[i] = {b64_json, revised_prompt, seed}.
HttpReply openai_image_reply(const nlohmann::json& images, const nlohmann::json& seeds, const std::string& prompt,
                             const std::string& cache_label);

} // namespace sd_routes

} // namespace anchor::unet
