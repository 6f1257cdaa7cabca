// AnchorCache's own routes on `anchor-sd serve`: POST /anchor/v1/compare (several cache modes of one image side by
// side, unet/cache/compare.h).
#include "cache/util/threads.h"
#include "unet/serve/sd_server_routes.h"

#include "cache/io/png_text.h"
#include "cache/modes/mode_list.h"
#include "unet/cache/compare.h"

namespace anchor::unet {

using sd_routes::as_request;
using sd_routes::check_cache_for_model;
using sd_routes::check_prompts;
using sd_routes::progress_json;

// An array of modes, or one list as anchor-sd --compare takes it (cache/modes/mode_list.h).
std::vector<std::string> sd_routes::request_mode_texts(const RequestFields& f, const std::string& dflt,
                                                       int max_modes) {
    std::vector<std::string> texts;
    try {
        if (f.json().contains("modes") && f.json()["modes"].is_array())
            texts = f.strings("modes");
        else
            texts = cache::modes::split_mode_list(f.string("modes", dflt), "modes");
    } catch (const ParamError& e) {
        throw HttpError(400, "modes", "modes: " + e.detail());
    }
    if (texts.empty()) throw HttpError(400, "modes", "modes: expected at least one cache mode, got none");
    if (int(texts.size()) > max_modes)
        throw HttpError(400, "modes",
                        "modes: at most " + std::to_string(max_modes) + " modes, got " + std::to_string(texts.size()));
    return texts;
}

void register_anchor_routes(SdServer& s, serve::HttpServer& http) {
    // Several cache modes of one image side by side: each image with its wall time, speed-up, full steps, PSNR and
    // SSIM against the first mode, and its per-step record.
    http.post("/anchor/v1/compare", [&s](const HttpRequest& req) {
        const auto f = RequestFields::parse(req.body);
        Txt2ImgParams p;
        p.prompts = {f.string("prompt", "")};
        s.read_image_fields(f, p);
        check_prompts(s.pipe_, p, p.prompts[0]);
        const auto texts = sd_routes::request_mode_texts(f, "off,deepcache:3,freq", s.p_.max_modes);
        std::vector<CacheConfig> modes;
        std::string list;
        for (size_t i = 0; i < texts.size(); ++i) {
            const std::string field = "modes[" + std::to_string(i) + "]";
            try {
                modes.push_back(parse_cache_config(texts[i], field));
            } catch (const ParamError& e) {
                throw HttpError(400, "modes", field + ": " + e.detail());
            }
            check_cache_for_model(modes.back(), s.pipe_.models(), "modes");
            list += (i ? ";" : "") + texts[i];
        }
        as_request([&] { p = s.pipe_.resolved(p); });
        s.check_pixels(p);
        as_request([&] { s.pipe_.validate(p); });
        auto out = s.http_.run_job(req, [&s, p, list, modes](JobControl& c) {
            torch::NoGradGuard no_grad;
            anchor::util::configure_threads(s.threads_);
            c.check();
            int full = 0;
            auto run = run_compare_modes(
                s.pipe_, p, modes, s.p_.facts, {},
                [&](size_t mode, const ProgressInfo& pi) {
                    c.check();
                    if (pi.phase != ProgressPhase::Step) return;
                    full = pi.step == 1 ? int(pi.full) : full + int(pi.full);
                    auto pj = progress_json(pi, int(mode), int(modes.size()), modes[mode].label, full);
                    c.set_progress(pj);
                },
                s.first_at_shape(p));
            nlohmann::json rep = compare_report(run.entries, run.meta);
            for (size_t i = 0; i < run.entries.size(); ++i)
                rep["modes"][i]["image"] = serve::base64_encode(encode_png(run.entries[i].image_uint8));
            return rep;
        });
        HttpReply r = HttpReply::json(out);
        r.note = "cache=" + list;
        return r;
    });
}

} // namespace anchor::unet
