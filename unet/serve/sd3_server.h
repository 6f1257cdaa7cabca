// `anchor-sd serve -m <SD 3 / 3.5 model>`: the image APIs of unet/serve/sd_server.h on an MMDiT model, over the same
// server core (cache/serve/): A1111's /sdapi/v1/txt2img and img2img, OpenAI's /v1/images/generations, our
// /anchor/v1/compare, and the listing / progress / interrupt routes. Every run is the library's SD 3 pipeline
// (unet/pipeline/sd3_pipeline.h: sd3_txt2img, whose cache controller is built per call, so two requests never share
// cache state); this file only reads requests and writes replies. What the SD 3 pipeline does not run (ControlNet
// units, the hires fix, masks, TAESD, VAE tiling, other samplers, LoRA in the prompt) is refused with a 400 naming
// the field, never ignored.
#pragma once

#include "cache/serve/http_server.h"
#include "unet/pipeline/sd3_pipeline.h"
#include "unet/serve/sd_server.h"

#include <nlohmann/json.hpp>

#include <mutex>
#include <set>
#include <string>

namespace anchor::unet {

// One image request: the run's parameters (one prompt; seed of the first batch) and A1111's batch fields (batch k of
// n_iter runs batch_size images with seed + k, as plan_batches plans the UNet's).
struct Sd3ImageJob {
    SD3Txt2ImgParams params;
    int batch_size = 1, batch_count = 1;
    SD3RunShape shape; // the size and first loop step sd3_check_params resolved
};

class Sd3Server {
public:
    // The model needs its text encoders and VAE (a pipeline folder); `p.default_cache` a mode of the transformer.
    // ParamError naming the field otherwise.
    Sd3Server(SD3Models& models, SdServerParams p);
    // Binds (the port, 0 = any) and serves until a drain (SIGTERM) ends.
    void serve();
    serve::HttpServer& http() { return http_; }

    // The job of a txt2img / img2img / images-generations request, every field checked before anything runs
    // (HttpError 400 naming the field).
    Sd3ImageJob image_job(const serve::RequestFields& f, bool img2img);

private:
    void add_routes();
    nlohmann::json openapi() const;
    std::string model_name() const;
    // The fields of a run every image route and the compare share (prompt aside), range-checked.
    void read_run_fields(const serve::RequestFields& f, SD3Txt2ImgParams& p) const;
    SD3RunShape check_run(const SD3Txt2ImgParams& p, int batch) const; // sd3_check_params and max_pixels (400)
    // Runs a job in the queue: the images (base64 PNG), their records, infotexts and seeds.
    nlohmann::json run_images(const serve::HttpRequest& req, const Sd3ImageJob& job);
    nlohmann::json a1111_info(const Sd3ImageJob& job, const nlohmann::json& out, bool img2img) const;
    bool first_at_shape(const SD3Txt2ImgParams& p, const SD3RunShape& s);
    SD3Models& m_;
    SdServerParams p_;
    int threads_;
    serve::HttpServer http_;
    std::mutex warm_mu_;
    std::set<std::string> warm_shapes_;
};

} // namespace anchor::unet
