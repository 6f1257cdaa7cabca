#include "unet/serve/sd_server.h"
#include "unet/serve/a1111_controlnet.h"

#include "cache/io/png_text.h"
#include "cache/util/threads.h"
#include "unet/pipeline/hires.h"
#include "unet/pipeline/infotext.h"
#include "unet/pipeline/preview.h"
#include "unet/serve/sd_server_routes.h"
#include "unet/pipeline/txt2img_job.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>

namespace anchor::unet {

namespace fs = std::filesystem;
using serve::openapi_document;
using serve::openapi_get;
using serve::openapi_post;

void SdServerParams::validate() const {
    http.validate();
    if (max_steps < 1) throw ParamError("max_steps", "must be >= 1, got " + std::to_string(max_steps));
    if (max_pixels < 64) throw ParamError("max_pixels", "must be >= 64, got " + std::to_string(max_pixels));
    if (max_images < 1) throw ParamError("max_images", "must be >= 1, got " + std::to_string(max_images));
    if (max_modes < 1) throw ParamError("max_modes", "must be >= 1, got " + std::to_string(max_modes));
    if (preview_every < 0) throw ParamError("preview_every", "must be >= 0, got " + std::to_string(preview_every));
}

namespace {

// Sampler names as A1111 lists them ("DPM++ 2M" with scheduler "Karras", or the older "DPM++ 2M Karras") or as
// anchor-sd's --sampler spells them.
SamplerKind sampler_of(const RequestFields& f, SamplerKind dflt) {
    const std::string field = f.has("sampler_name") ? "sampler_name" : "sampler_index";
    const std::string name = f.string(field, "");
    if (name.empty()) return dflt;
    const std::string schedule = f.string("scheduler", "");
    if (auto k = sampler_from_any_name(name, schedule)) return *k;
    std::string choices;
    for (const auto& [n, k] : sampler_table()) {
        const auto a = a1111_sampler(k);
        choices += (choices.empty() ? "" : ", ") + a.sampler + (a.schedule_type == "Karras" ? " Karras" : "");
    }
    throw HttpError(400, field,
                    field + ": unknown sampler '" + name + "' (choices: " + choices + "; or " +
                        enum_choices(sampler_table()) + ")");
}

// The request's cache mode, parsed here once (its error is one line: the key, its range and the forms).
CacheConfig cache_of(const RequestFields& f, const std::string& field, const CacheConfig& dflt) {
    if (!f.has(field)) return dflt;
    try {
        return parse_cache_config(f.string(field, ""), field);
    } catch (const ParamError& e) {
        throw HttpError(400, field, field + ": " + e.detail());
    }
}

int64_t random_seed() {
    std::random_device rd;
    return int64_t((uint64_t(rd()) << 31 ^ rd()) & 0x7fffffffffffLL);
}

} // namespace

// A decoded image of the request as uint8 pixels: written to a private file and read by the pipeline's own reader
// (PIL's convert("RGB") / convert("L")), so the server decodes exactly as `anchor-sd --init-img` does.
torch::Tensor sd_routes::request_image(const std::string& b64, const std::string& field, bool grey) {
    const std::string bytes = serve::base64_decode(b64, field);
    char tmpl[] = "/tmp/anchor-serve-XXXXXX";
    const int fd = mkstemp(tmpl);
    if (fd < 0) throw Error("serve: cannot create a temporary file for " + field);
    close(fd);
    struct Remove {
        std::string p;
        ~Remove() {
            std::error_code ec;
            fs::remove(p, ec);
        }
    } remove{tmpl};
    {
        std::ofstream out(tmpl, std::ios::binary);
        out.write(bytes.data(), std::streamsize(bytes.size()));
        if (!out) throw Error("serve: cannot write a temporary file for " + field);
    }
    try {
        return grey ? read_image_grey(tmpl, field) : read_image_rgb(tmpl, field);
    } catch (const ParamError&) {
        throw HttpError(400, field,
                        field + ": not a PNG/JPEG image this server can decode (" + std::to_string(bytes.size()) +
                            " bytes)");
    }
}

namespace sd_routes {

// A mode's demands on the model (its branch exists), as a 400 naming `field`.
void check_cache_for_model(const CacheConfig& c, const SDModels& models, const std::string& field) {
    if (!models.unet) return;
    try {
        check_cache_config(c, *models.unet, field);
    } catch (const ParamError& e) {
        throw HttpError(400, field, field + ": " + e.detail());
    }
}

// The request's name of a library params field (A1111's names where they differ).
std::string request_field(const std::string& field) {
    static const std::vector<std::pair<std::string, std::string>> names = {
        {"prompts", "prompt"},         {"negative_prompts", "negative_prompt"}, {"guidance_scale", "cfg_scale"},
        {"sampler", "sampler_name"},   {"images_per_prompt", "batch_size"},     {"batch_count", "n_iter"},
        {"init_image", "init_images"}, {"strength", "denoising_strength"},      {"compare", "modes"},
        {"hires_scale", "hr_scale"},   {"hires_width", "hr_resize_x"},          {"hires_height", "hr_resize_y"},
        {"hires_steps", "hr_second_pass_steps"}, {"hires_denoise", "denoising_strength"},
        {"hires_upscaler", "hr_upscaler"}};
    for (const auto& [lib, req] : names)
        if (lib == field) return req;
    return field;
}

// The request's prompt fields within their bounds (unet/pipeline/prompt_syntax.h) before anything reads them further: bytes
// here, then A1111 tokens on the connection thread (linear in the bytes, so bounded) before the job is queued.
void check_prompts(Txt2ImgPipeline& pipe, const Txt2ImgParams& p, const std::string& prompt) {
    const std::string negative = p.negative_prompts.empty() ? std::string() : p.negative_prompts[0];
    for (const auto& [field, text] : {std::pair<std::string, const std::string*>{"prompt", &prompt},
                                      std::pair<std::string, const std::string*>{"negative_prompt", &negative}}) {
        try {
            check_prompt_bytes(*text, field);
            if (p.prompt_syntax == PromptSyntax::A1111) (void)pipe.prompt_chunks({*text});
        } catch (const ParamError& e) {
            throw HttpError(text->size() > kMaxPromptBytes ? 413 : 400, field, field + ": " + e.detail());
        }
        // The embeddings it names fit the model's text encoders (another model's: 400 naming file and shapes).
        if (!p.embeddings) continue;
        Txt2ImgParams q = p;
        q.prompts = {*text};
        q.negative_prompts.clear();
        try {
            pipe.check_embeddings(q);
        } catch (const ParamError& e) {
            throw HttpError(400, field, field + ": " + e.detail());
        } catch (const Error& e) {
            throw HttpError(400, field, field + ": " + e.what());
        }
    }
}

// Progress of a job for /sdapi/v1/progress (A1111's fields, and ours under "anchor").
nlohmann::json progress_json(const ProgressInfo& pi, int unit, int units, const std::string& mode, int full_steps) {
    const double done = units > 0 && pi.total > 0 ? (double(unit) + double(pi.step) / pi.total) / units : 0.0;
    const double eta = pi.step > 0 ? pi.elapsed_s / pi.step * (pi.total - pi.step) +
                                         (units - unit - 1) * pi.elapsed_s / pi.step * pi.total
                                   : 0.0;
    return {{"progress", done},
            {"eta_relative", eta},
            {"state",
             {{"job_count", units},
              {"job_no", unit},
              {"sampling_step", pi.step},
              {"sampling_steps", pi.total},
              {"interrupted", false}}},
            {"anchor", {{"cache", mode}, {"step_full", pi.full}, {"full_steps", full_steps}}}};
}

} // namespace sd_routes

using sd_routes::as_request;
using sd_routes::check_cache_for_model;
using sd_routes::check_prompts;
using sd_routes::progress_json;
using sd_routes::request_image;

SdServer::SdServer(Txt2ImgPipeline& pipe, SdServerParams p)
    : pipe_(pipe), p_((p.validate(), std::move(p))), threads_(at::get_num_threads()),
      infotext_(infotext_facts(pipe.models(), "off")), http_(p_.http) {
    add_routes();
}

void SdServer::serve() {
    http_.drain_on_signals();
    // One step at the model's size before the first request: the one-time costs of a process's first run (allocator
    // pools, lazily built kernels) would otherwise land in the first request, and in a compare on its first mode.
    const auto t0 = std::chrono::steady_clock::now();
    Txt2ImgParams warm;
    warm.steps = 1;
    {
        torch::NoGradGuard no_grad;
        (void)pipe_.run(warm);
    }
    (void)first_at_shape(pipe_.resolved(warm));
    std::fprintf(stderr, "warm-up: one step in %.2fs\n",
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    http_.serve();
}

bool SdServer::first_at_shape(const Txt2ImgParams& p) {
    const auto rows = std::max<size_t>(p.prompts.size(), 1) * size_t(std::max(p.images_per_prompt, 1));
    const std::string key = std::to_string(p.width) + "x" + std::to_string(p.height) + "/" + std::to_string(rows) +
                            (p.guidance_scale > 1.0 ? "/cfg" : "") + (p.init.enabled() ? "/init" : "");
    std::lock_guard<std::mutex> lock(warm_mu_);
    return warm_shapes_.insert(key).second;
}

std::string SdServer::model_name() const {
    return fs::path(p_.model).filename().string();
}

void SdServer::read_image_fields(const RequestFields& f, Txt2ImgParams& p) const {
    p.embeddings = p_.embeddings; // the server's, read at start
    p.negative_prompts = {f.string("negative_prompt", "")};
    p.steps = int(f.integer("steps", 20, 1, p_.max_steps));
    p.guidance_scale = f.number("cfg_scale", 7.0, 0.0, 100.0);
    p.sampler = sampler_of(f, SamplerKind::EulerAncestral);
    p.seed = f.integer("seed", -1, -1, (int64_t(1) << 47) - 1);
    if (p.seed < 0) p.seed = random_seed();
    p.width = int(f.integer("width", 0, 0, 1 << 14));
    p.height = int(f.integer("height", 0, 0, 1 << 14));
    p.vae_decoder = p_.default_vae_decoder;
    if (f.has("vae_decoder")) {
        VaeDecoderChoice c;
        as_request([&] { c = VaeDecoderChoice::parse(f.string("vae_decoder", ""), "vae_decoder"); });
        if (!c.file.empty())
            throw HttpError(400, "vae_decoder", "vae_decoder: full or taesd (the server's own TAESD), got a file");
        p.vae_decoder = c.kind;
    }
}

// Our own request fields (A1111 has no standard one): "vae_tiling": true, and optionally "vae_tile_size" (image
// pixels) and "vae_tile_overlap", each of which turns tiling on; the pipeline's validate checks them against the VAE.
namespace {
void read_vae_tiling(const serve::RequestFields& f, VaeTiling& t) {
    t.enabled = f.boolean("vae_tiling", t.enabled);
    if (f.has("vae_tile_size")) t.tile_sample_size = int(f.integer("vae_tile_size", 512, 1, 1 << 14)), t.enabled = true;
    if (f.has("vae_tile_overlap")) t.overlap = f.number("vae_tile_overlap", 0.25, 0.0, 1.0), t.enabled = true;
}
} // namespace

void SdServer::check_pixels(const Txt2ImgParams& resolved) const {
    if (int64_t(resolved.width) * resolved.height > p_.max_pixels)
        throw HttpError(400, "width",
                        "width: width x height must be <= " + std::to_string(p_.max_pixels) + " pixels, got " +
                            std::to_string(resolved.width) + "x" + std::to_string(resolved.height));
}

Txt2ImgJob SdServer::image_job(const RequestFields& f, bool img2img) {
    Txt2ImgJob job;
    auto& p = job.params;
    job.prompts = {f.string("prompt", "")};
    read_image_fields(f, p);
    check_prompts(pipe_, p, job.prompts[0]);
    if (f.has("eta")) p.eta = f.number("eta", 0.0, 0.0, 10.0);
    read_vae_tiling(f, p.vae_tiling);
    job.batch_size = int(f.integer("batch_size", 1, 1, p_.max_images));
    job.batch_count = int(f.integer("n_iter", 1, 1, p_.max_images));
    if (job.batch_size * job.batch_count > p_.max_images)
        throw HttpError(400, "batch_size",
                        "batch_size: batch_size x n_iter must be <= " + std::to_string(p_.max_images) + ", got " +
                            std::to_string(job.batch_size) + " x " + std::to_string(job.batch_count));
    job.cache = cache_of(f, "cache", p_.default_cache);
    check_cache_for_model(job.cache, pipe_.models(), "cache");
    if (img2img) {
        const auto inits = f.strings("init_images");
        if (inits.empty())
            throw HttpError(400, "init_images", "init_images: expected one or more base64 images, got none");
        // One image for the whole batch, or several (a count dividing batch_size; Img2ImgParams tiles them as
        // diffusers' image=[...]), all of one size.
        std::vector<torch::Tensor> imgs;
        for (size_t k = 0; k < inits.size(); ++k) {
            imgs.push_back(request_image(inits[k], "init_images", false));
            if (imgs[k].sizes() != imgs[0].sizes())
                throw HttpError(400, "init_images",
                                "init_images: image " + std::to_string(k) + " is " + std::to_string(imgs[k].size(1)) +
                                    "x" + std::to_string(imgs[k].size(0)) + ", image 0 is " +
                                    std::to_string(imgs[0].size(1)) + "x" + std::to_string(imgs[0].size(0)) +
                                    ": the images of a batch need one size");
        }
        p.init.init_pixels = imgs.size() == 1 ? imgs[0] : torch::stack(imgs, 0);
        if (f.has("mask")) p.init.mask_pixels = request_image(f.string("mask", ""), "mask", true);
        p.init.strength = f.number("denoising_strength", 0.75, 1e-6, 1.0);
    }
    { // the sd-webui-controlnet extension's units (422 naming the unit's field); img2img: a unit without an image
      // takes the first init image, as the extension does
        static ControlNetLibrary none;
        const auto& px = p.init.init_pixels;
        p.control = a1111_control_units(
            f.json(), p_.controlnets ? *p_.controlnets : none, pipe_.models(),
            [](const std::string& b64, const std::string& field) { return request_image(b64, field, false); },
            px.defined() && px.dim() == 4 ? px[0] : px);
        try {
            validate_control(p.control, pipe_.models().unet->config(), 1);
        } catch (const ParamError& e) {
            throw HttpError(422, "alwayson_scripts.controlnet.args", "alwayson_scripts.controlnet.args: " + e.detail());
        }
    }
    if (!img2img && f.boolean("enable_hr", false)) { // A1111's hires fix (unet/pipeline/hires.h)
        auto& h = p.hires;
        h.enabled = true;
        h.scale = f.number("hr_scale", 2.0, 0.0, 16.0);
        h.width = int(f.integer("hr_resize_x", 0, 0, 1 << 14));
        h.height = int(f.integer("hr_resize_y", 0, 0, 1 << 14));
        h.steps = int(f.integer("hr_second_pass_steps", 0, 0, p_.max_steps));
        h.denoise = f.number("denoising_strength", 0.75, 0.0, 1.0); // A1111's txt2img default
        if (f.has("hr_upscaler") && !f.string("hr_upscaler", "").empty()) {
            parse_hires_upscaler(f.string("hr_upscaler", ""), h);
            if (h.upscaler == HiresUpscaler::Model) // a request never names a file to read
                throw HttpError(400, "hr_upscaler",
                                "hr_upscaler: '" + f.string("hr_upscaler", "") + "' is not one of " +
                                    enum_choices(hires_upscaler_table()) + " (or A1111's Latent, Lanczos, ...)");
        }
    }
    Txt2ImgParams r;
    as_request([&] { r = pipe_.resolved(p); });
    check_pixels(r);
    if (r.hires.enabled) { // the second pass's size, too
        Txt2ImgParams t = r;
        as_request([&] {
            const auto plan = hires_plan(r.hires, r.width, r.height, r.steps, pipe_.models().vae_scale_factor());
            t.width = plan.width, t.height = plan.height;
        });
        check_pixels(t);
    }
    job.write_files = false;
    job.facts = p_.facts;
    job.infotext = infotext_;
    // The job's and the pipeline's own checks, the memory estimate among them, before the job is queued.
    as_request([&] {
        job.validate();
        Txt2ImgParams check = r;
        check.prompts = job.prompts;
        check.images_per_prompt = job.batch_size;
        pipe_.validate(check);
    });
    return job;
}

nlohmann::json SdServer::run_images(const HttpRequest& req, const Txt2ImgJob& job) {
    return http_.run_job(req, [this, job](JobControl& c) {
        torch::NoGradGuard no_grad; // grad mode and the OpenMP thread count are per thread: the worker's own
        anchor::util::configure_threads(threads_);
        c.check();
        const int units = job.batch_count; // one pipeline run per batch
        int unit = 0, full = 0;
        std::string current_image; // this job's latest preview (base64 PNG): its own state, never another job's
        PreviewHook preview(pipe_.models(), p_.preview_every,
                            [&current_image](const std::string& png, int, int) {
                                current_image = serve::base64_encode(png);
                            });
        Txt2ImgJobCallbacks cb;
        cb.progress = [&](const ProgressInfo& pi, const std::string&) {
            c.check(); // an interrupt or a client gone stops the job here: before encoding, each step, the decode
            if (pi.phase != ProgressPhase::Step) return;
            full = pi.step == 1 ? int(pi.full) : full + int(pi.full);
            preview(pi);
            auto pj = progress_json(pi, unit, units, job.cache.label, full);
            if (!current_image.empty()) pj["current_image"] = current_image;
            c.set_progress(std::move(pj));
        };
        cb.batch_done = [&](const std::vector<Txt2ImgJobImage>&, double, double, int64_t) { ++unit; };
        const auto r = run_txt2img_job(pipe_, job, cb);
        nlohmann::json images = nlohmann::json::array(), records = nlohmann::json::array(),
                       infotexts = nlohmann::json::array(), seeds = nlohmann::json::array();
        for (const auto& im : r.images) {
            images.push_back(serve::base64_encode(im.png_bytes));
            records.push_back(im.record);
            seeds.push_back(im.record["seed"]);
            const auto chunks = parse_png_text_chunks(im.png_bytes, "image");
            const auto* t = find_png_text(chunks, kInfotextKeyword);
            infotexts.push_back(t ? t->text : "");
        }
        return nlohmann::json{{"images", images},
                              {"records", records},
                              {"infotexts", infotexts},
                              {"seeds", seeds},
                              {"warnings", r.warnings}};
    });
}

void SdServer::add_routes() {
    register_a1111_routes(*this, http_);
    register_openai_routes(*this, http_);
    register_anchor_routes(*this, http_);
    register_a1111_extras_routes(*this, http_);
    http_.add_health(model_name());
    http_.add_openapi(openapi());
}

nlohmann::json SdServer::openapi() const {
    using nlohmann::json;
    const json str = {{"type", "string"}};
    auto integer = [](int64_t lo, int64_t hi) { return json{{"type", "integer"}, {"minimum", lo}, {"maximum", hi}}; };
    auto number = [](double lo, double hi) { return json{{"type", "number"}, {"minimum", lo}, {"maximum", hi}}; };
    json image = {{"prompt", {{"type", "string"}, {"maxLength", kMaxPromptBytes}}},
                  {"negative_prompt", {{"type", "string"}, {"maxLength", kMaxPromptBytes}}},
                  {"steps", integer(1, p_.max_steps)},
                  {"cfg_scale", number(0, 100)},
                  {"sampler_name", str},
                  {"sampler_index", str},
                  {"scheduler", str},
                  {"seed", integer(-1, (int64_t(1) << 47) - 1)},
                  {"width", integer(0, 1 << 14)},
                  {"height", integer(0, 1 << 14)},
                  {"vae_decoder", {{"type", "string"}, {"enum", {"full", "taesd"}}}}};
    json txt = image;
    txt["eta"] = number(0, 10);
    txt["batch_size"] = integer(1, p_.max_images);
    txt["n_iter"] = integer(1, p_.max_images);
    txt["cache"] = str;
    txt["vae_tiling"] = {{"type", "boolean"}};
    txt["vae_tile_size"] = integer(1, 1 << 14);
    txt["vae_tile_overlap"] = number(0, 1);
    json img = txt;
    img["init_images"] = {{"type", "array"}, {"items", str}, {"minItems", 1}};
    img["mask"] = str;
    img["denoising_strength"] = number(1e-6, 1);
    json gen = txt;
    gen["n"] = integer(1, p_.max_images);
    gen["size"] = str;
    gen["response_format"] = {{"type", "string"}, {"enum", {"b64_json"}}};
    // A1111's hires fix fields (txt2img only)
    txt["enable_hr"] = {{"type", "boolean"}};
    txt["hr_scale"] = number(0, 16);
    txt["hr_resize_x"] = integer(0, 1 << 14);
    txt["hr_resize_y"] = integer(0, 1 << 14);
    txt["hr_second_pass_steps"] = integer(0, p_.max_steps);
    txt["hr_upscaler"] = str;
    txt["denoising_strength"] = number(0, 1);
    json compare = image;
    compare["modes"] = {{"oneOf", {str, {{"type", "array"}, {"items", str}}}}};
    const json extras = {{"image", str},
                         {"upscaler_1", str},
                         {"upscaling_resize", number(0.05, 8)},
                         {"resize_mode", integer(0, 0)}};
    json paths = {
        {"/sdapi/v1/extra-single-image", openapi_post("A1111 Extras: one image upscaled by an ESRGAN of --upscaler-dir",
                                                      extras, {"image", "upscaler_1"})},
        {"/sdapi/v1/txt2img", openapi_post("A1111 text to image", txt)},
        {"/sdapi/v1/img2img", openapi_post("A1111 image to image", img, {"init_images"})},
        {"/v1/images/generations", openapi_post("OpenAI image generation", gen)},
        {"/anchor/v1/compare", openapi_post("several cache modes of one image", compare)},
        {"/sdapi/v1/samplers", openapi_get("the samplers")},
        {"/sdapi/v1/sd-models", openapi_get("the one model")},
        {"/sdapi/v1/embeddings", openapi_get("the textual-inversion embeddings of --embedding-dir")},
        {"/controlnet/model_list", openapi_get("the ControlNets of --control-net-dir (sd-webui-controlnet's list)")},
        {"/sdapi/v1/upscalers", openapi_get("None, Lanczos and the ESRGAN files of --upscaler-dir (A1111's list)")},
        {"/sdapi/v1/latent-upscale-modes", openapi_get("the hires fix's latent upscalers by A1111's names")},
        {"/sdapi/v1/options", openapi_get("the server's settings")},
        {"/sdapi/v1/progress", openapi_get("the running job's progress")},
        {"/sdapi/v1/interrupt", openapi_post("stop the running job (no body needed)", json::object())},
        {"/sdapi/v1/skip", openapi_post("stop the running job, as A1111's skip of its last image", json::object())},
        {"/health", openapi_get("status, model and queue (503 while draining)")},
        {"/openapi.json", openapi_get("this description")}};
    paths["/sdapi/v1/options"].update(
        openapi_post("set the checkpoint (only the loaded one is accepted)", {{"sd_model_checkpoint", str}}));
    return openapi_document("anchor-sd serve", "AUTOMATIC1111's and OpenAI's image APIs on AnchorCache", paths);
}

} // namespace anchor::unet
