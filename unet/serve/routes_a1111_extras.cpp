// A1111's Extras tab on `anchor-sd serve`: POST /sdapi/v1/extra-single-image upscales one image with an ESRGAN of
// --upscaler-dir (`upscaler_1`, by file stem) by `upscaling_resize` (A1111's "Scale by": the network, then a Lanczos
// resize to floor(side x scale / 8) x 8, unet/pipeline/upscale.h). The reply is A1111's: `image` (base64 PNG with the
// `postprocessing` chunk) and `html_info`.
#include "unet/pipeline/hires.h"
#include "unet/pipeline/upscale.h"
#include "unet/serve/sd_server_routes.h"

namespace anchor::unet {

void register_a1111_extras_routes(SdServer& s, serve::HttpServer& http) {
    // A1111's upscaler list: its built-in "None" and "Lanczos" (listed with scale 4, as A1111 lists its resizers),
    // then the ESRGAN files of --upscaler-dir by stem, each with its file and the network's own scale (a file is
    // loaded at the first listing that names it and kept, as for extra-single-image; a file that is not an RRDBNet
    // is listed with scale null, and naming it in a request says why).
    http.get("/sdapi/v1/upscalers", [&s](const HttpRequest&) {
        auto item = [](const std::string& name, const nlohmann::json& model_name, const nlohmann::json& path,
                       const nlohmann::json& scale) {
            return nlohmann::json{{"name", name},
                                  {"model_name", model_name},
                                  {"model_path", path},
                                  {"model_url", nullptr},
                                  {"scale", scale}};
        };
        nlohmann::json out =
            nlohmann::json::array({item("None", nullptr, nullptr, 4), item("Lanczos", nullptr, nullptr, 4)});
        if (s.p_.upscalers)
            for (const auto& name : s.p_.upscalers->names()) {
                nlohmann::json scale = nullptr, path = nullptr;
                try {
                    const auto m = s.p_.upscalers->get(name, "upscaler_1");
                    scale = m->scale, path = m->path;
                } catch (const Error&) {
                }
                out.push_back(item(name, "ESRGAN", path, scale));
            }
        return HttpReply::json(out);
    });
    // The hires fix's latent upscalers (hr_upscaler) by A1111's names, as its /sdapi/v1/latent-upscale-modes.
    http.get("/sdapi/v1/latent-upscale-modes", [](const HttpRequest&) {
        nlohmann::json out = nlohmann::json::array();
        for (const auto& [key, kind] : hires_upscaler_table()) {
            if (kind == HiresUpscaler::Lanczos || kind == HiresUpscaler::Model) continue;
            HiresParams h;
            h.upscaler = kind;
            out.push_back({{"name", hires_upscaler_a1111_name(h)}});
        }
        return HttpReply::json(out);
    });
    http.post("/sdapi/v1/extra-single-image", [&s](const HttpRequest& req) {
        const auto f = RequestFields::parse(req.body);
        if (!s.p_.upscalers)
            throw HttpError(400, "upscaler_1",
                            "upscaler_1: this server has no upscalers (start it with --upscaler-dir)");
        // Only "Scale by" (resize_mode 0) and one upscaler: the fields of anything else are refused, not ignored.
        if (f.integer("resize_mode", 0, 0, 1) != 0)
            throw HttpError(400, "resize_mode", "resize_mode: only 0 (scale by upscaling_resize) is supported");
        for (const char* k : {"upscaler_2", "gfpgan_visibility", "codeformer_visibility"})
            if (f.has(k) && !(k == std::string("upscaler_2") && f.string(k, "None") == "None") &&
                !(k != std::string("upscaler_2") && f.number(k, 0, 0, 1) == 0))
                throw HttpError(400, k, std::string(k) + ": not supported by this server");
        if (!f.has("image")) throw HttpError(400, "image", "image: a base64 image is required");
        const std::string name = f.string("upscaler_1", "");
        if (name.empty() || name == "None")
            throw HttpError(400, "upscaler_1", "upscaler_1: name an upscaler of --upscaler-dir");
        const double by = f.number("upscaling_resize", 2.0, 0.05, 8.0); // A1111's default and slider range
        const auto img = sd_routes::request_image(f.string("image", ""), "image", false);
        // The server's pixel bound, 16x for the upscale's output (an upscaled image is a few generated images' size).
        const double out_px = double(img.size(0)) * by * double(img.size(1)) * by;
        if (out_px > 16.0 * double(s.p_.max_pixels))
            throw HttpError(400, "upscaling_resize",
                            "upscaling_resize: " + std::to_string(img.size(1)) + "x" + std::to_string(img.size(0)) +
                                " scaled by " + python_float_str(by) + " is more than 16 x max_pixels (" +
                                std::to_string(16 * s.p_.max_pixels) + ") output pixels");
        std::shared_ptr<const EsrganModel> model;
        try {
            model = s.p_.upscalers->get(name, "upscaler_1");
        } catch (const ParamError& e) {
            throw HttpError(400, "upscaler_1", "upscaler_1: " + e.detail());
        } catch (const Error& e) { // a file of the folder that is not an RRDBNet
            throw HttpError(400, "upscaler_1", std::string("upscaler_1: ") + e.what());
        }
        at::Tensor out;
        try {
            out = a1111_upscale_by(*model, img, by);
        } catch (const ParamError& e) {
            throw HttpError(400, e.field(), e.field() + ": " + e.detail());
        }
        const std::string info = "Postprocess upscale by: " + python_float_str(by) +
                                 ", Postprocess upscaler: " + infotext_quote(model->name);
        const std::string png = encode_png(out, {png_text("postprocessing", info)}, "image");
        HttpReply r = HttpReply::json({{"image", serve::base64_encode(png)}, {"html_info", "<p>" + info + "</p>"}});
        r.note = "upscaler=" + model->name;
        return r;
    });
}

} // namespace anchor::unet
