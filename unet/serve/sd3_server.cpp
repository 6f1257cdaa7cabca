// `anchor-sd serve` on SD 3 / 3.5 models (see sd3_server.h).
#include "unet/serve/sd3_server.h"

#include "cache/io/png_text.h"
#include "cache/modes/mode_list.h"
#include "cache/util/threads.h"
#include "unet/cache/compare.h"
#include "unet/cache/dit_cache_config.h"
#include "unet/pipeline/infotext.h"
#include "unet/pipeline/prompt_syntax.h"
#include "unet/pipeline/sd3_compare.h"
#include "unet/pipeline/sd3_record.h"
#include "unet/serve/sd_server_routes.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <random>

namespace anchor::unet {

namespace fs = std::filesystem;
using sd_routes::as_request;

namespace {

std::string sd3_lower_alnum(const std::string& s) {
    std::string out;
    for (char c : s)
        if (std::isalnum(static_cast<unsigned char>(c))) out += char(std::tolower(static_cast<unsigned char>(c)));
    return out;
}

// SD 3 samples with flow-matching Euler only: A1111's "Euler" (schedule "Simple" / "Automatic"), our
// flow_match_euler, or nothing; any other sampler or schedule is a 400 naming its field.
void sd3_check_sampler(const RequestFields& f) {
    for (const char* field : {"sampler_name", "sampler_index"}) {
        const std::string name = f.string(field, "");
        const std::string k = sd3_lower_alnum(name);
        if (!k.empty() && k != "euler" && k != "flowmatcheuler")
            throw HttpError(400, field,
                            std::string(field) + ": SD 3 / 3.5 models sample with flow-matching Euler only ('Euler' "
                                                 "or 'flow_match_euler'), got '" + name + "'");
    }
    const std::string schedule = f.string("scheduler", "");
    const std::string k = sd3_lower_alnum(schedule);
    if (!k.empty() && k != "simple" && k != "automatic")
        throw HttpError(400, "scheduler",
                        "scheduler: SD 3 / 3.5 models run the flow-matching schedule ('Simple'), got '" + schedule +
                            "'");
}

// The prompt within its byte bound (413 past it), and no A1111 LoRA tag: SD 3 has no LoRA in the prompt yet, and
// read as text the tag would silently become tokens.
void sd3_check_prompt(const std::string& text, const std::string& field) {
    try {
        check_prompt_bytes(text, field);
    } catch (const ParamError& e) {
        throw HttpError(text.size() > kMaxPromptBytes ? 413 : 400, field, field + ": " + e.detail());
    }
    std::string lower = text;
    std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return char(std::tolower(c)); });
    for (const char* tag : {"<lora:", "<lyco:", "<hypernet:"})
        if (lower.find(tag) != std::string::npos)
            throw HttpError(400, field,
                            field + ": " + std::string(tag) +
                                "...> is not available for SD 3 / 3.5 models (no LoRA in the prompt); the prompt is "
                                "read as plain text");
}

// Fields of the UNet server that the SD 3 pipeline does not run: refused when they ask for something (A1111 clients
// send many of them at their "off" values, which pass).
void sd3_refuse_unsupported(const RequestFields& f, bool img2img) {
    auto refuse = [](const std::string& field, const std::string& what) {
        throw HttpError(400, field, field + ": " + what + " is not available for SD 3 / 3.5 models");
    };
    if (f.boolean("enable_hr", false)) refuse("enable_hr", "the hires fix");
    const auto& body = f.json();
    if (body.contains("alwayson_scripts") && body["alwayson_scripts"].is_object()) {
        const auto& scripts = body["alwayson_scripts"];
        if (scripts.contains("controlnet")) {
            const auto& cn = scripts["controlnet"];
            const auto* args = cn.is_object() && cn.contains("args") ? &cn["args"] : nullptr;
            bool any = false;
            if (args && args->is_array())
                for (const auto& u : *args) {
                    const bool off = u.is_object() && u.contains("enabled") && u["enabled"].is_boolean() &&
                                     !u["enabled"].get<bool>();
                    any = any || !off;
                }
            if (any) refuse("alwayson_scripts.controlnet.args", "ControlNet");
        }
    }
    if (img2img && f.has("mask") && !f.string("mask", "").empty()) refuse("mask", "inpainting (a mask)");
    if (f.has("vae_decoder") && f.string("vae_decoder", "full") != "full") refuse("vae_decoder", "TAESD decoding");
    if (f.boolean("vae_tiling", false)) refuse("vae_tiling", "VAE tiling");
    for (const char* k : {"vae_tile_size", "vae_tile_overlap"})
        if (f.has(k)) refuse(k, "VAE tiling");
    if (f.has("eta") && f.number("eta", 0.0, 0.0, 10.0) != 0.0) refuse("eta", "eta (flow-matching Euler has none)");
}

int64_t sd3_random_seed() {
    std::random_device rd;
    return int64_t((uint64_t(rd()) << 31 ^ rd()) & 0x7fffffffffffLL);
}

CacheConfig sd3_cache_of(const RequestFields& f, const std::string& field, const CacheConfig& dflt) {
    CacheConfig c = dflt;
    try {
        if (f.has(field)) c = parse_cache_config(f.string(field, ""), field);
        check_dit_cache_config(c, field);
    } catch (const ParamError& e) {
        throw HttpError(400, field, field + ": " + e.detail());
    }
    return c;
}

} // namespace

Sd3Server::Sd3Server(SD3Models& models, SdServerParams p)
    : m_(models), p_((p.validate(), std::move(p))), threads_(at::get_num_threads()), http_(p_.http) {
    check_dit_cache_config(p_.default_cache, "cache");
    if (!m_.text_encoder || !m_.text_encoder_2)
        throw ParamError("model", "'" + p_.model +
                                      "' has no text_encoder/ and text_encoder_2/: the server runs SD 3 pipeline "
                                      "folders (prompts need the CLIP encoders)");
    if (!m_.vae) throw ParamError("model", "'" + p_.model + "' has no VAE (vae/ or first_stage_model.*)");
    add_routes();
}

void Sd3Server::serve() {
    http_.drain_on_signals();
    // One step at the model's size before the first request, as the UNet server does (one-time costs).
    const auto t0 = std::chrono::steady_clock::now();
    SD3Txt2ImgParams warm;
    warm.prompts = {""};
    warm.steps = 1;
    {
        torch::NoGradGuard no_grad;
        (void)sd3_txt2img(m_, warm);
    }
    (void)first_at_shape(warm, sd3_check_params(m_, warm));
    std::fprintf(stderr, "warm-up: one step in %.2fs\n",
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    http_.serve();
}

bool Sd3Server::first_at_shape(const SD3Txt2ImgParams& p, const SD3RunShape& s) {
    const std::string key = std::to_string(s.width) + "x" + std::to_string(s.height) + "/" +
                            std::to_string(p.prompts.size()) + (p.guidance_scale > 1.0 ? "/cfg" : "") +
                            (p.init.enabled() ? "/init" : "");
    std::lock_guard<std::mutex> lock(warm_mu_);
    return warm_shapes_.insert(key).second;
}

std::string Sd3Server::model_name() const {
    const fs::path path(p_.model);
    return path.filename().empty() ? path.parent_path().filename().string() : path.filename().string();
}

void Sd3Server::read_run_fields(const RequestFields& f, SD3Txt2ImgParams& p) const {
    const std::string prompt = f.string("prompt", "");
    sd3_check_prompt(prompt, "prompt");
    p.prompts = {prompt};
    if (f.has("negative_prompt")) {
        const std::string negative = f.string("negative_prompt", "");
        sd3_check_prompt(negative, "negative_prompt");
        p.negative_prompts = {negative};
    }
    sd3_check_sampler(f);
    // anchor-sd's SD 3 defaults (diffusers'): 28 steps, guidance 7.
    p.steps = int(f.integer("steps", 28, 1, p_.max_steps));
    p.guidance_scale = f.number("cfg_scale", 7.0, 0.0, 100.0);
    p.seed = f.integer("seed", -1, -1, (int64_t(1) << 47) - 1);
    if (p.seed < 0) p.seed = sd3_random_seed();
    p.width = int(f.integer("width", 0, 0, 1 << 14));
    p.height = int(f.integer("height", 0, 0, 1 << 14));
    // SD 3's own fields, as anchor-sd's --shift, --max-sequence-length and --slg-*.
    if (f.has("shift")) p.shift = f.number("shift", 3.0, 1e-6, 1000.0);
    p.max_sequence_length = int(f.integer("max_sequence_length", 256, 1, 512));
    if (f.has("slg_layers")) {
        const auto& v = f.json()["slg_layers"];
        const int64_t blocks = m_.transformer->config().num_layers;
        if (!v.is_array())
            throw HttpError(400, "slg_layers", "slg_layers: expected an array of block indices, got " + v.dump());
        for (const auto& l : v) {
            if (!l.is_number_integer() || l.get<int64_t>() < 0 || l.get<int64_t>() >= blocks)
                throw HttpError(400, "slg_layers",
                                "slg_layers: expected block indices in [0, " + std::to_string(blocks - 1) + "], got " +
                                    l.dump());
            p.slg.layers.push_back(l.get<int>());
        }
        if (!p.slg.layers.empty() && p.guidance_scale <= 1.0)
            throw HttpError(400, "slg_layers",
                            "slg_layers: skip-layer guidance needs classifier-free guidance (cfg_scale > 1)");
    }
    p.slg.scale = f.number("slg_scale", p.slg.scale, 0.0, 100.0);
    p.slg.start = f.number("slg_start", p.slg.start, 0.0, 1.0);
    p.slg.stop = f.number("slg_end", p.slg.stop, 0.0, 1.0);
}

SD3RunShape Sd3Server::check_run(const SD3Txt2ImgParams& p, int batch) const {
    SD3Txt2ImgParams q = p;
    q.prompts.assign(size_t(batch), p.prompts.at(0));
    if (!p.negative_prompts.empty()) q.negative_prompts.assign(size_t(batch), p.negative_prompts[0]);
    SD3RunShape s;
    as_request([&] { s = sd3_check_params(m_, q); });
    if (int64_t(s.width) * s.height > p_.max_pixels)
        throw HttpError(400, "width",
                        "width: width x height must be <= " + std::to_string(p_.max_pixels) + " pixels, got " +
                            std::to_string(s.width) + "x" + std::to_string(s.height));
    return s;
}

Sd3ImageJob Sd3Server::image_job(const RequestFields& f, bool img2img) {
    sd3_refuse_unsupported(f, img2img);
    Sd3ImageJob job;
    auto& p = job.params;
    read_run_fields(f, p);
    job.batch_size = int(f.integer("batch_size", 1, 1, p_.max_images));
    job.batch_count = int(f.integer("n_iter", 1, 1, p_.max_images));
    if (job.batch_size * job.batch_count > p_.max_images)
        throw HttpError(400, "batch_size",
                        "batch_size: batch_size x n_iter must be <= " + std::to_string(p_.max_images) + ", got " +
                            std::to_string(job.batch_size) + " x " + std::to_string(job.batch_count));
    p.cache = sd3_cache_of(f, "cache", p_.default_cache);
    if (img2img) {
        const auto inits = f.strings("init_images");
        if (inits.empty())
            throw HttpError(400, "init_images", "init_images: expected one or more base64 images, got none");
        std::vector<torch::Tensor> imgs;
        for (const auto& b64 : inits) imgs.push_back(sd_routes::request_image(b64, "init_images", false));
        for (size_t k = 1; k < imgs.size(); ++k)
            if (imgs[k].sizes() != imgs[0].sizes())
                throw HttpError(400, "init_images",
                                "init_images: image " + std::to_string(k) + " is " + std::to_string(imgs[k].size(1)) +
                                    "x" + std::to_string(imgs[k].size(0)) + ", image 0 is " +
                                    std::to_string(imgs[0].size(1)) + "x" + std::to_string(imgs[0].size(0)) +
                                    ": the images of a batch need one size");
        p.init.init_pixels = imgs.size() == 1 ? imgs[0] : torch::stack(imgs, 0);
        p.init.strength = f.number("denoising_strength", 0.6, 1e-6, 1.0); // anchor-sd's SD 3 default (diffusers')
    }
    job.shape = check_run(p, job.batch_size);
    return job;
}

nlohmann::json Sd3Server::run_images(const HttpRequest& req, const Sd3ImageJob& job) {
    return http_.run_job(req, [this, job](JobControl& c) {
        torch::NoGradGuard no_grad; // grad mode and the OpenMP thread count are per thread: the worker's own
        anchor::util::configure_threads(threads_);
        c.check();
        const auto& base = job.params;
        const auto batches = plan_batches(base.prompts, job.batch_size, job.batch_count, base.seed);
        nlohmann::json images = nlohmann::json::array(), records = nlohmann::json::array(),
                       infotexts = nlohmann::json::array(), seeds = nlohmann::json::array();
        const int begin = job.shape.begin;
        for (size_t unit = 0; unit < batches.size(); ++unit) {
            const auto& b = batches[unit];
            SD3Txt2ImgParams p = base;
            p.prompts.assign(size_t(b.images()), base.prompts[0]);
            if (!base.negative_prompts.empty()) p.negative_prompts.assign(size_t(b.images()), base.negative_prompts[0]);
            p.seed = b.seed;
            const auto t0 = std::chrono::steady_clock::now();
            const auto r = sd3_txt2img(m_, p, [&](int i, int n) {
                c.check(); // an interrupt or a client gone stops the job at the next step
                ProgressInfo pi;
                pi.step = i + 1 - begin;
                pi.total = n - begin;
                pi.elapsed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
                c.set_progress(sd_routes::progress_json(pi, int(unit), int(batches.size()), p.cache.label, 0));
            });
            c.check();
            const Infotext info = sd3_infotext(p, r, p_.model);
            for (int k = 0; k < b.images(); ++k) {
                nlohmann::json rec = sd3_run_record(p, r, {p_.model, "f32", "", threads_, 0.0});
                for (const auto& [key, v] : p_.facts.items()) rec[key] = v;
                rec["index_in_batch"] = k;
                rec["base_seed"] = base.seed;
                if (p.cache.kind() != CacheKind::Off) rec["cache"] = r.cache_log;
                const std::string png = encode_png(r.image_uint8[k], image_text_chunks(info, rec), "image");
                images.push_back(serve::base64_encode(png));
                records.push_back(rec);
                infotexts.push_back(format_infotext(info));
                seeds.push_back(p.seed);
            }
        }
        return nlohmann::json{{"images", images}, {"records", records}, {"infotexts", infotexts}, {"seeds", seeds}};
    });
}

nlohmann::json Sd3Server::a1111_info(const Sd3ImageJob& job, const nlohmann::json& out, bool img2img) const {
    const auto& p = job.params;
    const std::string negative = p.negative_prompts.empty() ? std::string() : p.negative_prompts[0];
    nlohmann::json prompts = nlohmann::json::array(), negatives = nlohmann::json::array();
    for (size_t i = 0; i < out["images"].size(); ++i) prompts.push_back(p.prompts[0]), negatives.push_back(negative);
    return {{"prompt", p.prompts[0]},
            {"all_prompts", prompts},
            {"negative_prompt", negative},
            {"all_negative_prompts", negatives},
            {"seed", p.seed},
            {"all_seeds", out["seeds"]},
            {"width", job.shape.width},
            {"height", job.shape.height},
            {"sampler_name", "Euler"},
            {"scheduler", "Simple"},
            {"cfg_scale", p.guidance_scale},
            {"steps", p.steps},
            {"batch_size", job.batch_size},
            {"n_iter", job.batch_count},
            {"sd_model_name", model_name()},
            {"family", "sd3"},
            {"denoising_strength", img2img ? nlohmann::json(p.init.strength) : nlohmann::json(nullptr)},
            {"infotexts", out["infotexts"]},
            {"cache", p.cache.label},
            {"anchorcache", out["records"]},
            {"warnings", nlohmann::json::array()}};
}

void Sd3Server::add_routes() {
    auto a1111 = [this](const HttpRequest& req, bool img2img) {
        const auto f = RequestFields::parse(req.body);
        const Sd3ImageJob job = image_job(f, img2img);
        const auto out = run_images(req, job);
        nlohmann::json params = f.json();
        if (params.contains("init_images")) params["init_images"] = nlohmann::json::array(); // not echoed back
        const auto info = a1111_info(job, out, img2img);
        HttpReply r = HttpReply::json({{"images", out["images"]},
                                       {"parameters", params},
                                       {"info", info.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)}});
        r.note = "cache=" + job.params.cache.label;
        return r;
    };
    http_.post("/sdapi/v1/txt2img", [a1111](const HttpRequest& req) { return a1111(req, false); });
    http_.post("/sdapi/v1/img2img", [a1111](const HttpRequest& req) { return a1111(req, true); });
    http_.post("/v1/images/generations", [this](const HttpRequest& req) {
        const RequestFields f(sd_routes::openai_image_body(RequestFields::parse(req.body), p_.max_images));
        const Sd3ImageJob job = image_job(f, false);
        const auto out = run_images(req, job);
        return sd_routes::openai_image_reply(out["images"], out["seeds"], job.params.prompts[0],
                                             job.params.cache.label);
    });
    // Several cache modes of one image side by side (sd3_compare_modes), as the UNet server's compare answers.
    http_.post("/anchor/v1/compare", [this](const HttpRequest& req) {
        const auto f = RequestFields::parse(req.body);
        sd3_refuse_unsupported(f, false);
        SD3Txt2ImgParams p;
        read_run_fields(f, p);
        const auto texts =
            sd_routes::request_mode_texts(f, "off,freq,fbcache,teacache,taylorseer", p_.max_modes);
        std::vector<CacheConfig> modes;
        std::string list;
        for (size_t i = 0; i < texts.size(); ++i) {
            const std::string field = "modes[" + std::to_string(i) + "]";
            try {
                modes.push_back(parse_cache_config(texts[i], field));
                check_dit_cache_config(modes.back(), field);
            } catch (const ParamError& e) {
                throw HttpError(400, "modes", field + ": " + e.detail());
            }
            list += (i ? ";" : "") + texts[i];
        }
        const SD3RunShape shape = check_run(p, 1);
        const bool warm = first_at_shape(p, shape);
        auto out = http_.run_job(req, [this, p, modes, warm, shape](JobControl& c) {
            torch::NoGradGuard no_grad;
            anchor::util::configure_threads(threads_);
            c.check();
            int mode = -1;
            auto t0 = std::chrono::steady_clock::now();
            const auto run = sd3_compare_modes(
                m_, p, modes, {p_.model, "f32", "", threads_, 0.0},
                [&](int i, int n) {
                    c.check();
                    ProgressInfo pi;
                    pi.step = i + 1 - shape.begin;
                    pi.total = n - shape.begin;
                    pi.elapsed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
                    c.set_progress(sd_routes::progress_json(pi, std::max(mode, 0), int(modes.size()),
                                                            modes[size_t(std::max(mode, 0))].label, 0));
                },
                [&](const std::string&) { ++mode, t0 = std::chrono::steady_clock::now(); }, warm);
            nlohmann::json rep = compare_report(run.entries, run.meta);
            for (size_t i = 0; i < run.entries.size(); ++i)
                rep["modes"][i]["image"] = serve::base64_encode(encode_png(run.entries[i].image_uint8));
            return rep;
        });
        HttpReply r = HttpReply::json(out);
        r.note = "cache=" + list;
        return r;
    });
    http_.get("/sdapi/v1/samplers", [](const HttpRequest&) {
        return HttpReply::json(nlohmann::json::array(
            {{{"name", "Euler"},
              {"aliases", nlohmann::json::array({"flow_match_euler"})},
              {"options", {{"scheduler", "Simple"}}}}}));
    });
    // What A1111 clients list at start: no embeddings or ControlNets for SD 3.
    http_.get("/sdapi/v1/embeddings", [](const HttpRequest&) {
        return HttpReply::json({{"loaded", nlohmann::json::object()}, {"skipped", nlohmann::json::object()}});
    });
    http_.get("/controlnet/model_list",
              [](const HttpRequest&) { return HttpReply::json({{"model_list", nlohmann::json::array()}}); });
    http_.get("/sdapi/v1/options", [this](const HttpRequest&) {
        const auto& tc = m_.transformer->config();
        return HttpReply::json({{"sd_model_checkpoint", model_name()},
                                {"anchor_family", "sd3"},
                                {"anchor_transformer_blocks", tc.num_layers},
                                {"anchor_t5", bool(m_.text_encoder_3)},
                                {"anchor_default_size", tc.sample_size * m_.vae_scale_factor()},
                                {"anchor_default_cache", p_.default_cache.label},
                                {"anchor_cache_modes", dit_cache_help()},
                                {"anchor_cache_keys", cache_keys_json()},
                                {"anchor_max_steps", p_.max_steps},
                                {"anchor_max_pixels", p_.max_pixels},
                                {"anchor_max_images", p_.max_images}});
    });
    sd_routes::register_model_routes(http_, model_name(), p_.model);
    sd_routes::register_job_routes(http_);
    http_.add_health(model_name());
    http_.add_openapi(openapi());
}

nlohmann::json Sd3Server::openapi() const {
    using nlohmann::json;
    using serve::openapi_get;
    using serve::openapi_post;
    const json str = {{"type", "string"}};
    auto integer = [](int64_t lo, int64_t hi) { return json{{"type", "integer"}, {"minimum", lo}, {"maximum", hi}}; };
    auto number = [](double lo, double hi) { return json{{"type", "number"}, {"minimum", lo}, {"maximum", hi}}; };
    json image = {{"prompt", {{"type", "string"}, {"maxLength", kMaxPromptBytes}}},
                  {"negative_prompt", {{"type", "string"}, {"maxLength", kMaxPromptBytes}}},
                  {"steps", integer(1, p_.max_steps)},
                  {"cfg_scale", number(0, 100)},
                  {"sampler_name", {{"type", "string"}, {"enum", {"Euler", "flow_match_euler"}}}},
                  {"scheduler", {{"type", "string"}, {"enum", {"Simple", "Automatic"}}}},
                  {"seed", integer(-1, (int64_t(1) << 47) - 1)},
                  {"width", integer(0, 1 << 14)},
                  {"height", integer(0, 1 << 14)},
                  {"shift", number(1e-6, 1000)},
                  {"max_sequence_length", integer(1, 512)},
                  {"slg_layers", {{"type", "array"}, {"items", {{"type", "integer"}}}}},
                  {"slg_scale", number(0, 100)},
                  {"slg_start", number(0, 1)},
                  {"slg_end", number(0, 1)}};
    json txt = image;
    txt["batch_size"] = integer(1, p_.max_images);
    txt["n_iter"] = integer(1, p_.max_images);
    txt["cache"] = str;
    json img = txt;
    img["init_images"] = {{"type", "array"}, {"items", str}, {"minItems", 1}};
    img["denoising_strength"] = number(1e-6, 1);
    json gen = txt;
    gen["n"] = integer(1, p_.max_images);
    gen["size"] = str;
    gen["response_format"] = {{"type", "string"}, {"enum", {"b64_json"}}};
    json compare = image;
    compare["modes"] = {{"oneOf", {str, {{"type", "array"}, {"items", str}}}}};
    json paths = {
        {"/sdapi/v1/txt2img", openapi_post("A1111 text to image (SD 3 / 3.5)", txt)},
        {"/sdapi/v1/img2img", openapi_post("A1111 image to image (SD 3 / 3.5)", img, {"init_images"})},
        {"/v1/images/generations", openapi_post("OpenAI image generation", gen)},
        {"/anchor/v1/compare", openapi_post("several cache modes of one image", compare)},
        {"/sdapi/v1/samplers", openapi_get("the sampler (flow-matching Euler)")},
        {"/sdapi/v1/sd-models", openapi_get("the one model")},
        {"/sdapi/v1/embeddings", openapi_get("none for SD 3")},
        {"/controlnet/model_list", openapi_get("none for SD 3")},
        {"/sdapi/v1/options", openapi_get("the server's settings")},
        {"/sdapi/v1/progress", openapi_get("the running job's progress")},
        {"/sdapi/v1/interrupt", openapi_post("stop the running job (no body needed)", json::object())},
        {"/sdapi/v1/skip", openapi_post("stop the running job, as A1111's skip of its last image", json::object())},
        {"/health", openapi_get("status, model and queue (503 while draining)")},
        {"/openapi.json", openapi_get("this description")}};
    paths["/sdapi/v1/options"].update(
        openapi_post("set the checkpoint (only the loaded one is accepted)", {{"sd_model_checkpoint", str}}));
    return serve::openapi_document("anchor-sd serve (SD 3 / 3.5)",
                                   "AUTOMATIC1111's and OpenAI's image APIs on an MMDiT model", paths);
}

} // namespace anchor::unet
