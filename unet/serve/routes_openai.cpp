// OpenAI's image generation (POST /v1/images/generations) on `anchor-sd serve`, as a txt2img job of the core
// (unet/serve/sd_server.cpp); the request and reply conversions are shared with the SD 3 server (sd3_server.cpp).
#include "unet/serve/sd_server_routes.h"

#include <chrono>
#include <sstream>

namespace anchor::unet {

nlohmann::json sd_routes::openai_image_body(const RequestFields& f0, int max_images) {
    nlohmann::json body = f0.json();
    const std::string format = f0.string("response_format", "b64_json");
    if (format != "b64_json")
        throw HttpError(400, "response_format",
                        "response_format: only b64_json is served (no image hosting), got '" + format + "'");
    body["batch_size"] = f0.integer("n", 1, 1, max_images);
    if (f0.has("size")) {
        const std::string size = f0.string("size", "");
        int w = 0, h = 0;
        char x = 0;
        std::istringstream is(size);
        if (!(is >> w >> x >> h) || x != 'x' || w <= 0 || h <= 0 || !is.eof())
            throw HttpError(400, "size", "size: expected WIDTHxHEIGHT such as 512x512, got '" + size + "'");
        body["width"] = w, body["height"] = h;
    }
    return body;
}

HttpReply sd_routes::openai_image_reply(const nlohmann::json& images, const nlohmann::json& seeds,
                                        const std::string& prompt, const std::string& cache_label) {
    nlohmann::json data = nlohmann::json::array();
    for (size_t i = 0; i < images.size(); ++i)
        data.push_back({{"b64_json", images[i]}, {"revised_prompt", prompt}, {"seed", seeds[i]}});
    HttpReply r = HttpReply::json(
        {{"created",
          std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch())
              .count()},
         {"data", data}});
    r.note = "cache=" + cache_label;
    return r;
}

void register_openai_routes(SdServer& s, serve::HttpServer& http) {
    // OpenAI's image generation: prompt, n, size "WxH", response_format b64_json; our fields as in txt2img.
    http.post("/v1/images/generations", [&s](const HttpRequest& req) {
        const RequestFields f(sd_routes::openai_image_body(RequestFields::parse(req.body), s.p_.max_images));
        const Txt2ImgJob job = s.image_job(f, false);
        auto out = s.run_images(req, job);
        return sd_routes::openai_image_reply(out["images"], out["seeds"], job.prompts[0], job.cache.label);
    });
}

} // namespace anchor::unet
