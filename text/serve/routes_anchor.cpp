// AnchorCache's own routes on `anchor-text serve`: POST /anchor/v1/diffusion (text diffusion with a cache mode,
// text/diffusion/mdlm_run.h).
#include "cache/util/threads.h"
#include "text/serve/text_server_routes.h"

#include "text/diffusion/mdlm_model.h"
#include "text/diffusion/mdlm_run.h"
#include "text/params.h"
#include "text/text_job.h"

#include <climits>

namespace anchor::text {

using text_routes::as_field;
using text_routes::check_prompt_bytes;

void register_anchor_routes(TextServer& srv, serve::HttpServer& http) {
    // Text diffusion (MDLM) with a cache mode; the prompt is text, the reply the generated text, the tokens and the
    // run's figures (cache reuse, forward passes, seconds).
    http.post("/anchor/v1/diffusion", [&srv](const HttpRequest& req) {
        if (srv.p_.diffusion_model.empty())
            throw HttpError(404, "", "this server has no diffusion model (start it with --diffusion-model)");
        const auto f = RequestFields::parse(req.body);
        DiffusionGenerateParams d;
        d.model = srv.p_.diffusion_model;
        auto& s = d.sampler;
        const std::string prompt = f.string("prompt", "");
        check_prompt_bytes(prompt, srv.p_.max_prompt_bytes, "prompt");
        if (!prompt.empty()) s.prompt = srv.tok_->encode(prompt);
        s.length = f.integer("length", 128, 2, srv.p_.max_length);
        s.steps = f.integer("steps", 64, 1, srv.p_.max_steps);
        s.temperature = f.number("temperature", 1.0, 0.0, 2.0);
        s.top_p = f.number("top_p", 1.0, 1e-9, 1.0);
        s.seed = uint64_t(f.integer("seed", 0, 0, INT64_MAX));
        s.block_length = f.integer("block_length", 0, 0, srv.p_.max_length);
        const std::string cache = f.string("cache", "off");
        d.caches = {as_field("cache", [&] { return parse_decode_spec(cache); })};
        // One model serves every request: its linear layers are the server's choice (--diffusion-gemm).
        if (d.caches[0].gemm)
            throw HttpError(400, "cache", "cache: gemm= is the server's setting (--diffusion-gemm), not a request's");
        as_field("length", [&] { s.validate(); });
        // The memory a run of this length needs, before it is queued.
        as_field("length", [&] { check_sampling_memory(srv.mdlm_->config(), s); });
        try {
            check_prompt_vocabulary(*srv.mdlm_, s.prompt);
        } catch (const TokenOutsideVocabulary& e) {
            throw HttpError(400, "prompt", "prompt: " + e.describe(srv.tok_->decode({e.id()})));
        }
        const int64_t P = int64_t(s.prompt.size());
        if (P >= s.length)
            throw HttpError(400, "length",
                            "length: must exceed the prompt's " + std::to_string(P) + " tokens, got " +
                                std::to_string(s.length));
        auto out = srv.http_.run_job(req, [&srv, d, P](JobControl& c) {
            torch::NoGradGuard no_grad;
            anchor::util::configure_threads(srv.threads_);
            auto rep = generate_diffusion(srv.mdlm_, d, [&](const StepInfo&) { c.check(); });
            auto j = rep.to_json();
            j["text"] = generated_text(rep.runs[0].result.tokens, P, *srv.tok_);
            return j;
        });
        HttpReply r = HttpReply::json(out);
        r.note = "cache=" + cache;
        return r;
    });
}

} // namespace anchor::text
