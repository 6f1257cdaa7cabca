// AUTOMATIC1111's web API (/sdapi/v1/*) on `anchor-sd serve`: txt2img and img2img with A1111's reply (images,
// parameters, `info` as a JSON string), and the samplers, models, options, progress, interrupt and skip that its
// clients poll. The jobs are the core's (unet/serve/sd_server.cpp).
#include "unet/serve/sd_server_routes.h"
#include "unet/serve/a1111_controlnet.h"

namespace anchor::unet {

void register_a1111_routes(SdServer& s, serve::HttpServer& http) {
    const std::string model_name = s.model_name();

    // A1111's reply: images, the request's parameters, and `info` as a JSON string.
    auto a1111_reply = [&s, model_name](const HttpRequest& req, bool img2img) {
        const auto f = RequestFields::parse(req.body);
        const Txt2ImgJob job = s.image_job(f, img2img);
        auto out = s.run_images(req, job);
        const auto& p = job.params;
        const auto rp = s.pipe_.resolved(p);
        nlohmann::json prompts = nlohmann::json::array(), negatives = nlohmann::json::array();
        for (size_t i = 0; i < out["images"].size(); ++i)
            prompts.push_back(job.prompts[0]), negatives.push_back(p.negative_prompts[0]);
        const nlohmann::json info = {
            {"prompt", job.prompts[0]},
            {"all_prompts", prompts},
            {"negative_prompt", p.negative_prompts[0]},
            {"all_negative_prompts", negatives},
            {"seed", p.seed},
            {"all_seeds", out["seeds"]},
            {"width", rp.width},
            {"height", rp.height},
            {"sampler_name", a1111_sampler(p.sampler).sampler},
            {"scheduler", a1111_sampler(p.sampler).schedule_type},
            {"cfg_scale", p.guidance_scale},
            {"steps", p.steps},
            {"batch_size", job.batch_size},
            {"n_iter", job.batch_count},
            {"sd_model_name", model_name},
            {"denoising_strength", img2img ? nlohmann::json(p.init.strength) : nlohmann::json(nullptr)},
            {"infotexts", out["infotexts"]},
            {"cache", job.cache.label},
            {"anchorcache", out["records"]},
            {"warnings", out["warnings"]}};
        nlohmann::json params = f.json();
        if (params.contains("init_images")) params["init_images"] = nlohmann::json::array(); // not echoed back
        if (params.contains("mask")) params["mask"] = nullptr;
        HttpReply r = HttpReply::json({{"images", out["images"]},
                                       {"parameters", params},
                                       {"info", info.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)}});
        r.note = "cache=" + job.cache.label;
        return r;
    };

    http.post("/sdapi/v1/txt2img", [a1111_reply](const HttpRequest& req) { return a1111_reply(req, false); });
    http.post("/sdapi/v1/img2img", [a1111_reply](const HttpRequest& req) { return a1111_reply(req, true); });

    http.get("/sdapi/v1/samplers", [](const HttpRequest&) {
        nlohmann::json out = nlohmann::json::array();
        for (const auto& [name, k] : sampler_table()) {
            const auto a = a1111_sampler(k);
            auto aliases = nlohmann::json::array({name});
            for (const auto& [alias, kind] : sampler_alias_table())
                if (kind == k) aliases.push_back(alias);
            out.push_back({{"name", a.sampler + (a.schedule_type == "Karras" ? " Karras" : "")},
                           {"aliases", aliases},
                           {"options", {{"scheduler", a.schedule_type}}}});
        }
        return HttpReply::json(out);
    });
    // A1111's listing of the textual-inversion embeddings: "shape" is the vectors' width (SDXL: both widths summed,
    // as A1111 counts them), "step" and the checkpoint fields are what A1111 reads from its own .pt files (null here).
    http.get("/sdapi/v1/embeddings", [&s](const HttpRequest&) {
        nlohmann::json loaded = nlohmann::json::object();
        if (s.p_.embeddings)
            for (const auto& e : s.p_.embeddings->items())
                loaded[e.name] = {{"step", nullptr},
                                  {"sd_checkpoint", nullptr},
                                  {"sd_checkpoint_name", nullptr},
                                  {"shape", e.sdxl() ? e.clip_l.size(1) + e.clip_g.size(1) : e.vectors.size(1)},
                                  {"vectors", e.count()}};
        return HttpReply::json({{"loaded", loaded}, {"skipped", nlohmann::json::object()}});
    });
    // sd-webui-controlnet's model list: "NAME [hash]" as its clients send the name back in a unit's "model".
    http.get("/controlnet/model_list", [&s](const HttpRequest&) {
        nlohmann::json list = nlohmann::json::array();
        if (s.p_.controlnets)
            for (const auto& [name, path] : s.p_.controlnets->models()) {
                const auto h = a1111_legacy_hash(path);
                list.push_back(h.empty() ? name : name + " [" + h + "]");
            }
        return HttpReply::json({{"model_list", list}});
    });
    http.get("/sdapi/v1/options", [&s, model_name](const HttpRequest&) {
        return HttpReply::json({{"sd_model_checkpoint", model_name},
                                {"anchor_default_cache", s.p_.default_cache.label},
                                {"anchor_cache_modes", cache_mode_help()},
                                {"anchor_cache_keys", cache_keys_json()},
                                {"anchor_max_steps", s.p_.max_steps},
                                {"anchor_max_pixels", s.p_.max_pixels},
                                {"anchor_max_images", s.p_.max_images}});
    });
    sd_routes::register_model_routes(http, model_name, s.p_.model);
    sd_routes::register_job_routes(http);
}

void sd_routes::register_model_routes(serve::HttpServer& http, const std::string& name, const std::string& filename) {
    http.get("/sdapi/v1/sd-models", [name, filename](const HttpRequest&) {
        return HttpReply::json(nlohmann::json::array({{{"title", name},
                                                       {"model_name", name},
                                                       {"hash", nullptr},
                                                       {"sha256", nullptr},
                                                       {"filename", filename},
                                                       {"config", nullptr}}}));
    });
    // Clients set the checkpoint through the options; one model is loaded, so only its own name is accepted.
    http.post("/sdapi/v1/options", [model_name = name](const HttpRequest& req) {
        const auto f = RequestFields::parse(req.body);
        const std::string want = f.string("sd_model_checkpoint", model_name);
        if (want != model_name)
            throw HttpError(400, "sd_model_checkpoint",
                            "sd_model_checkpoint: this server has one model, '" + model_name + "', got '" + want + "'");
        return HttpReply::json(nullptr);
    });
}

void sd_routes::register_job_routes(serve::HttpServer& http) {
    http.get("/sdapi/v1/progress", [&http](const HttpRequest&) {
        const auto t = http.jobs().running();
        nlohmann::json pj = t ? t->control.progress() : nlohmann::json::object();
        if (pj.empty())
            pj = {{"progress", 0.0},
                  {"eta_relative", 0.0},
                  {"state", {{"job_count", 0}, {"sampling_step", 0}, {"sampling_steps", 0}, {"interrupted", false}}}};
        pj["state"]["queue"] = http.jobs().pending();
        if (t) pj["state"]["interrupted"] = t->control.cancelled();
        // The running job's latest preview (SdServerParams::preview_every), A1111's current_image; null before one.
        if (!pj.contains("current_image")) pj["current_image"] = nullptr;
        return HttpReply::json(pj);
    });
    http.post("/sdapi/v1/interrupt", [&http](const HttpRequest&) {
        const auto t = http.jobs().running();
        if (t) t->control.cancel("interrupted by POST /sdapi/v1/interrupt");
        return HttpReply::json({{"interrupted", t != nullptr}});
    });
    // A1111's skip ends the image being sampled and goes on with the batch; a job here is one request, so skip
    // stops the running job as interrupt does (its client gets 503 naming skip).
    http.post("/sdapi/v1/skip", [&http](const HttpRequest&) {
        const auto t = http.jobs().running();
        if (t) t->control.cancel("skipped by POST /sdapi/v1/skip");
        return HttpReply::json({{"skipped", t != nullptr}});
    });
}

} // namespace anchor::unet
