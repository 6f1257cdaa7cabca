// The routes of `anchor-text serve`, one file per API dialect (the shape of stable-diffusion.cpp's
// examples/server/routes_*.cpp): text/serve/routes_openai.cpp (OpenAI's /v1/models and /v1/completions) and
// text/serve/routes_anchor.cpp (our /anchor/v1/diffusion). The server core (text/serve/text_server.cpp: lifecycle, queue,
// /health, /openapi.json) calls each registration once; the request checks both dialects use are declared here.
#pragma once

#include "cache/serve/http_server.h"
#include "text/serve/text_server.h"

#include <cstdint>
#include <string>

namespace anchor::text {

// The server core's names every route file uses.
using serve::HttpError;
using serve::HttpReply;
using serve::HttpRequest;
using serve::JobControl;
using serve::RequestFields;

void register_openai_routes(TextServer& srv, serve::HttpServer& http);
void register_anchor_routes(TextServer& srv, serve::HttpServer& http);
void register_dlm_chat_routes(TextServer& srv, serve::HttpServer& http); // text/serve/routes_dlm_chat.cpp

namespace text_routes {

// A library ParamError about a request field, as the 400 of that field.
template <class F> auto as_field(const std::string& field, F&& f) -> decltype(f()) {
    try {
        return f();
    } catch (const ParamError& e) {
        throw serve::HttpError(400, field, field + ": " + e.detail());
    }
}

// A prompt within the byte bound, before it is tokenized: 413 naming the field.
void check_prompt_bytes(const std::string& text, int64_t max_bytes, const std::string& field);

} // namespace text_routes

} // namespace anchor::text
